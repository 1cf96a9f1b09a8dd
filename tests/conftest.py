"""Shared test set-up.

* Output is pinned (NO_COLOR, COLUMNS) so CLI assertions are exact.
* `run_cli(...)` runs the real console entry point in a subprocess, as a user would.
* The emulated Ray cluster used by launch tests is started once per session (`shared_cluster`)
  and shared; only lifecycle tests start their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAKES = REPO / "tests" / "fakes"

os.environ["NO_COLOR"] = "1"
os.environ["COLUMNS"] = "100"
os.environ.pop("FORCE_COLOR", None)
os.environ.pop("RAY_ADDRESS", None)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: str | Path | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m tpulaunch ARGS...` and capture stdout/stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "tpulaunch", *args],
        env=env or cli_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd, input=input,
    )


def run_json(*args: str, **kw) -> dict:
    proc = run_cli(*args, "--json", **kw)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)

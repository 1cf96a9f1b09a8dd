"""The active gcloud configuration (`gcloud config get-value KEY`), for project/zone defaults.

The only discovery code that runs `gcloud`. Only used when a value is not given by flag or env,
only when `gcloud` is on PATH, and bounded by a short timeout (gcloud itself takes ~1 s to start).
"""

from __future__ import annotations

import os
import shutil
import subprocess

GCLOUD_TIMEOUT_ENV = "TPULAUNCH_GCLOUD_TIMEOUT"
DEFAULT_TIMEOUT = 5.0


def config_get(key: str, timeout: float | None = None) -> str | None:
    """The value of `gcloud config get-value KEY`, or None (unset, no gcloud, error, too slow)."""
    exe = shutil.which("gcloud")
    if not exe:
        return None
    if timeout is None:
        try:
            timeout = float(os.environ.get(GCLOUD_TIMEOUT_ENV, "") or DEFAULT_TIMEOUT)
        except ValueError:
            timeout = DEFAULT_TIMEOUT
    try:
        proc = subprocess.run(
            [exe, "config", "get-value", key],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    value = lines[-1] if lines else ""
    return value if value and value != "(unset)" else None

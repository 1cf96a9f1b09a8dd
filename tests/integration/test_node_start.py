"""Ray nodes on a busy machine: a dashboard agent slower to start than Ray's fixed 15 s no longer
kills its raylet (before, the node never registered: "The current node timed out during startup").

The agents are slowed for real: a `sitecustomize` on PYTHONPATH, which every Python process of the
cluster imports first, sleeps 20 s in the processes running Ray's `dashboard/agent.py` (as a
starved agent, still importing its modules, would) and then notes that it did.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from support import cli_env, run_cli

SLOW_AGENT = """
import os, sys, time
if sys.argv and sys.argv[0].endswith(os.path.join("dashboard", "agent.py")):
    time.sleep(20)
    with open({marker!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
"""


def _lines(path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.mark.lifecycle
def test_a_dashboard_agent_slower_than_the_raylets_wait_does_not_stop_its_node(tmp_path):
    hook, marker = tmp_path / "hook", tmp_path / "slept.txt"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_AGENT.format(marker=str(marker)))
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    env = cli_env(TPULAUNCH_HOME=str(tmp_path / "home"), PYTHONPATH=path)
    try:
        up = run_cli("cluster", "up", "--topology", "2x2x2", "--accelerator", "v5p", "--prewarm", "none", "--json",
                     env=env, timeout=300)
        assert up.returncode == 0, up.stderr[-3000:]
        end = time.monotonic() + 180
        while time.monotonic() < end and len(_lines(marker)) < 2:
            time.sleep(0.5)
        assert len(_lines(marker)) == 2  # both nodes' agents slept past the raylets' 15 s
        status = run_cli("cluster", "status", "--json", env=env, timeout=120)
        assert status.returncode == 0, status.stderr
        hosts = [h for s in json.loads(status.stdout)["slices"] for h in s["hosts"]]
        assert len(hosts) == 2 and all(h["alive"] for h in hosts), hosts  # ... and their nodes lived on
    finally:
        down = run_cli("cluster", "down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr

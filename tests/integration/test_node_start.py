"""Ray nodes on a busy machine: agents slower to start than the raylet waits for them no longer kill
it. A dashboard agent past Ray's fixed 15 s (before, the node never registered: "The current node
timed out during startup"), a runtime-env agent past Ray's default 30 s (before, the node registered,
then its raylet exited: "Runtime Env Agent timed out in 30000ms").

The agents are slowed for real: a `sitecustomize` on PYTHONPATH, which every Python process of the
cluster imports first, sleeps in the processes running Ray's `dashboard/agent.py` (20 s) and
`runtime_env/agent/main.py` (50 s), as a starved agent still importing its modules would, and then
notes that it did. A run starts on the cluster as soon as it is up, so the raylets ask their
runtime-env agents for its host agents' environment while those still sleep.
"""

from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path

import pytest

from support import emulated_cluster, run_cli
from tpulaunch.cluster.emulated import EMULATED_NODE_IP
from tpulaunch.errors import ExitCode
from tpulaunch.run.fleet import reachable

SLOW_AGENT = """
import os, sys, time
for agent, s in (("dashboard/agent.py", 20), ("runtime_env/agent/main.py", 50)):
    if sys.argv and sys.argv[0].endswith(os.path.join(*agent.split("/"))):
        time.sleep(s)
        with open({marker!r}, "a") as f:
            f.write(f"{{agent}}:{{os.getpid()}}\\n")
"""


def _lines(path) -> list[str]:
    return path.read_text().split() if path.exists() else []


UP = ("--topology", "2x2x2", "--accelerator", "v5p", "--prewarm", "none", "--no-dashboard")


def _hooked(tmp_path: Path, hook: str) -> tuple[str, Path]:
    """A PYTHONPATH with `hook` (a format string of `marker`) as every Python process's
    `sitecustomize`, and the marker file the hook writes."""
    site, marker = tmp_path / "hook", tmp_path / "slept.txt"
    site.mkdir()
    (site / "sitecustomize.py").write_text(hook.format(marker=str(marker)))
    return os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p), marker


@pytest.mark.lifecycle
def test_agents_slower_than_their_raylets_waits_do_not_stop_its_node(tmp_path):
    path, marker = _hooked(tmp_path, SLOW_AGENT)
    with emulated_cluster(tmp_path / "home", *UP, PYTHONPATH=path) as cluster:
        env = cluster["env"]
        # a run at once: each host's agent (an actor with a runtime env) asks its raylet for a worker,
        # and the raylet asks the runtime-env agent, still asleep, for the environment
        (tmp_path / "hi.py").write_text("print('hi', flush=True)\n")
        run = run_cli("run", "hi.py", "--address", "auto", "--framework", "none", "--log-dir", str(tmp_path / "runs"),
                      env=env, cwd=tmp_path, timeout=300)
        assert run.returncode == 0 and run.stdout.count("hi") >= 2, run.stdout[-2000:] + run.stderr[-3000:]
        end = time.monotonic() + 180
        while time.monotonic() < end and len(_lines(marker)) < 4:
            time.sleep(0.5)
        slept = sorted(line.split(":")[0] for line in _lines(marker))
        # both nodes' agents slept past their raylets' waits (15 s and 30 s)
        assert slept == ["dashboard/agent.py"] * 2 + ["runtime_env/agent/main.py"] * 2, slept
        status = run_cli("cluster", "status", "--json", env=env, timeout=120)
        assert status.returncode == 0, status.stderr
        hosts = [h for s in json.loads(status.stdout)["slices"] for h in s["hosts"]]
        assert len(hosts) == 2 and all(h["alive"] for h in hosts), hosts  # ... and their nodes lived on


HOST_1_ENV_AGENT_ASLEEP = """
import os, sys, time
if (sys.argv and sys.argv[0].endswith(os.path.join("runtime_env", "agent", "main.py"))
        and any("/s0w1/" in a for a in sys.argv)):
    with open({marker!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    time.sleep(60)
"""


def _env_agent_port(cluster_dir: str, host: int) -> int:
    """The runtime-env agent port written ahead for an emulated host (host 0 is the head, in `ray/`)."""
    node_dir = "ray" if host == 0 else f"s0w{host}"
    (path,) = glob.glob(f"{cluster_dir}/{node_dir}/session_latest/runtime_env_agent_port_*")
    return int(Path(path).read_text())


def _wait_listening(port: int, wait_s: float = 120.0) -> None:
    end = time.monotonic() + wait_s
    while not reachable(f"{EMULATED_NODE_IP}:{port}"):
        assert time.monotonic() < end, f"nothing listens on {EMULATED_NODE_IP}:{port}"
        time.sleep(0.2)


@pytest.mark.lifecycle
def test_a_node_that_dies_as_its_host_agent_starts_is_that_hosts_loss(tmp_path):
    """A deployment's own `agent_register_timeout_ms` (10 s here) is kept, and host 1's runtime-env
    agent sleeps past it: its raylet exits as the run's host agents start. Host 1 is lost, said in
    one line with Ray's reason, exit 75, every host's log kept (before: "internal error:
    ActorDiedError ... This is a tpulaunch bug")."""
    path, marker = _hooked(tmp_path, HOST_1_ENV_AGENT_ASLEEP)
    with emulated_cluster(tmp_path / "home", *UP, PYTHONPATH=path, RAY_agent_register_timeout_ms="10000") as cluster:
        env = cluster["env"]
        record = json.loads((tmp_path / "home" / "cluster.json").read_text())
        _wait_listening(_env_agent_port(record["temp_dir"], host=0))  # host 0's is up (10 s is short)
        (tmp_path / "hi.py").write_text("print('hi', flush=True)\n")
        run = run_cli("run", "hi.py", "--address", "auto", "--framework", "none", "--max-restarts", "0", "--json",
                      "--log-dir", str(tmp_path / "runs"), env=env, cwd=tmp_path, timeout=300)
        assert len(_lines(marker)) == 1  # host 1's agent, asleep
        assert run.returncode == ExitCode.HOST_LOST, run.stdout[-2000:] + run.stderr[-3000:]
        assert "internal error" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
        assert "host 1 lost (node lost as its agent started: Raylet could not connect to Runtime Env Agent)" in run.stderr
        s = json.loads(run.stdout)
        f = s["first_failure"]
        assert (f["process_index"], f["cause"]) == (1, "node-lost"), f
        for h in s["hosts"]:
            assert Path(h["log"]).exists(), h
        status = run_cli("cluster", "status", "--json", env=env, timeout=120)
        hosts = [h for sl in json.loads(status.stdout)["slices"] for h in sl["hosts"]]
        assert [h["alive"] for h in sorted(hosts, key=lambda h: h["worker_id"])] == [True, False], hosts

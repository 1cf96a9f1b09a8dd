"""Preflight, `tpulaunch stacks` and stragglers on the shared emulated slice (2 hosts), each finding
caused for real: a host whose Python sees another package version, a port held by a listener
that never accepts, a process holding the libtpu lockfile, a host slowed with SIGSTOP/SIGCONT.

The scripts boot no framework (`--framework none`): what is under test is what the launcher
checks and sees around them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support import SHARED, SHARED_HOSTS, last_summary, run_cli, write_scripts
from test_faults import _host_pid
from tpulaunch.errors import ExitCode

SCRIPTS = {
    "mark.py": """
        import os, tpulaunch
        ctx = tpulaunch.context()
        open(f"started-{ctx.run_id}-{ctx.process_index}", "w").close()
        print("ran", ctx.process_index, flush=True)
    """,
    "loop.py": """
        import os, time, tpulaunch

        def train_step(i):
            time.sleep(0.05)
            tpulaunch.heartbeat(step=i)

        ctx = tpulaunch.context()
        print("looping", ctx.process_index, flush=True)
        end = time.time() + float(os.environ.get("LOOP_S", "600"))
        i = 0
        while time.time() < end and not os.path.exists("stop-looping"):
            i += 1
            train_step(i)
        print("steps", i, flush=True)
    """,
    # For one host only (process index 1), another copy of a package comes first on sys.path: the
    # way a stale virtualenv or a leftover PYTHONPATH entry on one VM shadows the one the others use.
    "shadow/sitecustomize.py": """
        import os, sys
        if os.environ.get("TPULAUNCH_PROCESS_INDEX") == "1":
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "host1"))
    """,
}


def _dist(root: Path, name: str, version: str) -> None:
    """An installed distribution's metadata (what importlib.metadata and pip read)."""
    d = root / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("preflight")
    (w / "shadow").mkdir()
    return write_scripts(w, SCRIPTS)


def cli(shared_cluster, work, *args, env=None, **kw):
    return run_cli(*args, env={**shared_cluster["env"], **(env or {})}, cwd=work, **kw)


def _run(shared_cluster, work, script, *flags, env=None):
    return cli(shared_cluster, work, "run", script, *SHARED, "--address", "auto", "--framework", "none",
               *flags, env=env)


def _version(name: str) -> str:
    from importlib import metadata

    return metadata.version(name)


def test_a_healthy_slice_passes_preflight_and_says_nothing(shared_cluster, work):
    p = _run(shared_cluster, work, "mark.py", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["attempts"][0]["findings"] == [] and "preflight" not in p.stderr
    assert doc["attempts"][0]["timings"]["preflight_s"] > 0


def test_another_minor_version_on_one_host_stops_the_run_before_any_script(shared_cluster, work, tmp_path):
    torch = _version("torch")
    major, minor = torch.split(".")[:2]
    other = f"{major}.{int(minor) - 1}.0" if int(minor) else f"{major}.{int(minor) + 1}.0"
    host1 = work / "shadow" / "host1"
    _dist(host1, "torch", other)
    try:
        p = _run(shared_cluster, work, "mark.py", "--env", f"PYTHONPATH={work / 'shadow'}", "--json")
        assert p.returncode == ExitCode.PREFLIGHT, p.stderr
        line = f"preflight: host 1 has torch {other}, the others torch {torch}. install the same torch on every host"
        assert line in p.stderr
        doc = json.loads(p.stdout)
        assert doc["outcome"] == "preflight" and doc["exit_code"] == ExitCode.PREFLIGHT
        (f,) = [f for f in doc["attempts"][0]["findings"] if f["severity"] == "error"]
        assert f["hosts"] == [1] and f"torch {other}" in f["what"]
        assert not list(work.glob(f"started-{doc['run_id']}-*")), "no script may start after a failed preflight"
        assert "Traceback" not in p.stderr
    finally:
        shutil.rmtree(host1, ignore_errors=True)


def test_a_patch_version_apart_is_a_warning_and_the_run_goes_on(shared_cluster, work):
    torch = _version("torch")
    major, minor, patch = (torch.split("+")[0].split(".") + ["0"])[:3]
    other = f"{major}.{minor}.{int(patch) + 1}"
    host1 = work / "shadow" / "host1"
    _dist(host1, "torch", other)
    try:
        p = _run(shared_cluster, work, "mark.py", "--env", f"PYTHONPATH={work / 'shadow'}", "--json")
        assert p.returncode == 0, p.stderr
        assert f"preflight warning: host 1 has torch {other}, the others torch {torch} (a patch version apart)" in p.stderr
        doc = json.loads(p.stdout)
        assert len(list(work.glob(f"started-{doc['run_id']}-*"))) == SHARED_HOSTS
    finally:
        shutil.rmtree(host1, ignore_errors=True)


def test_a_port_held_by_a_listener_that_never_accepts(shared_cluster, work):
    """Process 0's host cannot listen on the coordinator port, and the others' connections time out
    (the listener's queue is full: the kernel drops their SYNs, as a firewall would)."""
    lis = socket.socket()
    lis.bind(("", 0))
    lis.listen(0)
    port = lis.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port), timeout=2)  # fills the queue of 1: nobody accepts
    try:
        p = _run(shared_cluster, work, "mark.py", "--coordinator-port", str(port), "--json")
    finally:
        filler.close()
        lis.close()
    assert p.returncode == ExitCode.PREFLIGHT, p.stderr
    assert (f"preflight: host 0 cannot listen on port {port} (MASTER_PORT): something else holds it."
            " stop what holds it (`ss -ltnp`), or choose other ports") in p.stderr
    assert f"preflight: host 1 cannot reach host 0:{port} (MASTER_PORT): timeout." in p.stderr
    doc = json.loads(p.stdout)
    assert not list(work.glob(f"started-{doc['run_id']}-*"))


# A process holding the libtpu lockfile stops a run on real TPU hosts (test_recreate.py, on the fake
# Cloud TPU's VMs); an emulated host holds no TPU and does not look.


def test_no_preflight_skips_the_checks(shared_cluster, work):
    host1 = work / "shadow" / "host1"
    _dist(host1, "torch", "0.1.0")
    try:
        p = _run(shared_cluster, work, "mark.py", "--no-preflight", "--env", f"PYTHONPATH={work / 'shadow'}", "--json")
    finally:
        shutil.rmtree(host1, ignore_errors=True)
    assert p.returncode == 0, p.stderr
    assert "preflight" not in p.stderr and json.loads(p.stdout)["attempts"][0]["findings"] == []


def _start_loop(shared_cluster, work, *flags, loop_s: str = "600") -> tuple[subprocess.Popen, str]:
    (work / "stop-looping").unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "tpulaunch", "run", "loop.py", *SHARED, "--address", "auto",
                             "--framework", "none", "--env", f"LOOP_S={loop_s}", *flags],
                            env=shared_cluster["env"], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    end = time.monotonic() + 120
    while sum("looping" in ln for ln in lines) < SHARED_HOSTS:
        assert proc.poll() is None and time.monotonic() < end, "".join(lines)
        time.sleep(0.2)
    (run_dir,) = [d for d in (work / "runs").iterdir() if (d / "attempt-0").is_dir() and not (d / "summary.json").exists()]
    proc.lines = lines  # type: ignore[attr-defined]
    return proc, run_dir.name


def test_stacks_of_a_running_run_then_it_goes_on_to_exit_0(shared_cluster, work):
    proc, run_id = _start_loop(shared_cluster, work)
    try:
        p = cli(shared_cluster, work, "stacks", "--json", timeout=120)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["run_id"] == run_id and doc["attempt"] == 0 and doc["hosts"] == list(range(SHARED_HOSTS)) and doc["missing"] == []
        # one line naming every host once, by the frame it is in: nearly always all in train_step's
        # sleep, but a dump may catch one host between steps (in os.path.exists, the loop's own test)
        groups = [g.split(": in ", 1) for g in doc["where"].split("; ")]
        named = sorted(int(h) for who, _ in groups for h in who.split(" ", 1)[1].split(","))
        assert named == list(range(SHARED_HOSTS)), doc["where"]
        assert any(frame.startswith(("train_step (loop.py:", "<module> (loop.py:")) for _, frame in groups), doc["where"]
        dump_dir = Path(doc["dir"])
        assert dump_dir.parent == work / "runs" / run_id / "attempt-0" and dump_dir.name.startswith("stacks-")
        for i in range(SHARED_HOSTS):
            text = (dump_dir / f"host-{i}.txt").read_text()
            assert "loop.py" in text and "Thread" in text
        human = cli(shared_cluster, work, "stacks", run_id, timeout=120)
        assert human.returncode == 0 and human.stdout.startswith(f"run {run_id} attempt 0:\n  host")
        assert proc.poll() is None, "stacks must not stop the run"
    finally:
        (work / "stop-looping").write_text("")
    assert proc.wait(timeout=120) == 0, "".join(proc.lines)
    assert last_summary(work / "runs")["exit_code"] == 0


def test_a_host_slowed_by_sigstop_is_named_a_straggler_and_rates_are_kept(shared_cluster, work):
    proc, run_id = _start_loop(shared_cluster, work, loop_s="7")
    pid = _host_pid(run_id, 1)
    try:
        while proc.poll() is None:  # host 1 runs a fifth of the time
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.4)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)
    except ProcessLookupError:
        pass  # its script ended
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert proc.wait(timeout=60) == 0, "".join(proc.lines)
    said = [ln for ln in proc.lines if "straggler" in ln]
    assert said and said[0].startswith("tpulaunch: host 1 is a straggler: "), "".join(proc.lines)
    assert not any(f"host {h} is a straggler" in ln for ln in said for h in range(SHARED_HOSTS) if h != 1)
    hosts = last_summary(work / "runs")["hosts"]
    rates = [h["step_rate"] for h in hosts]
    assert all(r is not None for r in rates) and rates[1] < 0.7 * min(r for i, r in enumerate(rates) if i != 1), rates
    assert [h["step"] > 0 for h in hosts] == [True] * SHARED_HOSTS

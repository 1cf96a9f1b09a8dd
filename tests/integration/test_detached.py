"""Detached runs on the side cluster (conftest.py `side_cluster`, an emulated slice shaped as the
shared one): the supervision as a Ray job on the head, read back with `runs`, `status`, `logs`,
`stop`, `wait` from other processes, as a user in another terminal would.

The scripts boot no framework (`--framework none`): what is under test is where the supervision
lives and what the commands show; the supervision itself is the one test_faults.py covers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import SHARED, SHARED_HOSTS, cli_env, run_cli, status_doc, write_scripts
from tpulaunch.cluster.emulated import ray_temp_dir
from tpulaunch.errors import ExitCode

SCRIPTS = {
    "tick.py": """
        import signal, time, tpulaunch
        def on_term(signum, frame):  # a checkpoint that takes longer than the grace it is given
            print("saving on SIGTERM", flush=True)
            time.sleep(60)
        signal.signal(signal.SIGTERM, on_term)
        ctx = tpulaunch.context()
        for i in range(600):
            print(f"tick {i} host {ctx.process_index}", flush=True)
            time.sleep(0.5)
    """,
    "crash1.py": """
        import sys, time, tpulaunch
        ctx = tpulaunch.context()
        print("up", ctx.process_index, flush=True)
        if ctx.process_index == 1:
            sys.exit(3)
        time.sleep(120)
    """,
    "flaky.py": """
        import sys, tpulaunch
        ctx = tpulaunch.context()
        print(f"attempt {ctx.restart_count} host {ctx.process_index}", flush=True)
        if ctx.process_index == 1 and ctx.restart_count == 0:
            sys.exit(3)
    """,
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("detached"), SCRIPTS)


def cli(side_cluster, *args, env=None, **kw):
    return run_cli(*args, env=env or side_cluster["env"], **kw)


def _run_dir(side_cluster, run_id: str) -> Path:
    """On an emulated cluster the head is this machine: the run's files, where Ray's log API serves them."""
    temp = Path(side_cluster["info"]["token_path"]).parent
    return Path(ray_temp_dir(str(temp))) / "session_latest" / "logs" / "tpulaunch" / "runs" / run_id


def _until(cond, timeout: float = 120, every: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError("timed out waiting")


def _detach(side_cluster, work, script, *flags):
    t0 = time.monotonic()
    proc = cli(side_cluster, "run", script, *SHARED, "--address", "auto", "--framework", "none",
               "--detach", *flags, cwd=work)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip()
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", run_id), proc.stdout
    assert f"tpulaunch logs {run_id} --follow" in proc.stderr
    return run_id, took


@pytest.mark.cluster
def test_a_detached_run_is_listed_watched_logged_stopped_and_waited_for(side_cluster, work):
    run_id, took = _detach(side_cluster, work, "tick.py")
    assert took < 15, "the submitting process returns within seconds"
    # another process: the run, its hosts running, host 1's own log
    runs = json.loads(cli(side_cluster, "runs", "--json").stdout)["runs"]
    assert run_id in [r["run_id"] for r in runs] and next(r for r in runs if r["run_id"] == run_id)["script"] == "tick.py"

    def running():
        doc = status_doc(side_cluster["env"], run_id)
        ok = doc["state"] == "running" and [h["state"] for h in doc["hosts"]] == ["running"] * SHARED_HOSTS
        return doc if ok and all((h["last_line"] or "").startswith("tick") for h in doc["hosts"]) else None

    doc = _until(running)
    assert [(h["process_index"], h["slice_index"], h["worker_id"]) for h in doc["hosts"]] == [(i, 0, i) for i in range(SHARED_HOSTS)]
    # the run holds every chip of the slice: the cluster says so, and no other run would be given it
    held = json.loads(cli(side_cluster, "cluster", "status", "--json").stdout)
    assert [h["busy"] for h in held["slices"][0]["hosts"]] == [True] * SHARED_HOSTS, held
    assert all(h["since_last_s"] is not None and h["since_last_s"] < 30 for h in doc["hosts"])
    log1 = cli(side_cluster, "logs", run_id, "--host", "1")
    assert log1.returncode == 0 and re.search(r"^tick \d+ host 1$", log1.stdout, re.M), log1.stderr
    stream = cli(side_cluster, "logs", "last")
    assert "[host 0] tick" in stream.stdout and "[host 1] tick" in stream.stdout
    assert "EMULATED slice" in stream.stdout + stream.stderr
    # stop from yet another process: the same stop a SIGTERM gives a foreground launcher. The hosts
    # outlast their grace: the supervisor must outlive Ray's 3 s abort alarm on SIGTERM, which it does
    # by setting its handler after connecting, and connect itself takes SIGTERM back (take_back_sigterm)
    stop = cli(side_cluster, "stop", run_id)
    assert stop.returncode == 0 and f"run {run_id} stopped" in stop.stdout, stop.stderr
    wait = cli(side_cluster, "wait", run_id)
    assert wait.returncode == ExitCode.TERMINATED == 143, wait.stderr
    summary = json.loads((_run_dir(side_cluster, run_id) / "summary.json").read_text())
    assert summary["exit_code"] == 143 and summary["interrupted"] == "SIGTERM"
    assert all(h["stopped_by_tpulaunch"] for h in summary["hosts"])
    for h in summary["hosts"]:  # the hosts had SIGTERM and their grace, the supervisor outlived it
        assert Path(h["log"]).is_file() and "tick" in (text := Path(h["log"]).read_text()) and "saving on SIGTERM" in text
    final = json.loads(cli(side_cluster, "status", run_id, "--json").stdout)
    assert final["state"] == "stopped" and final["exit_code"] == 143


@pytest.mark.cluster
def test_a_detached_run_whose_host_fails_waits_with_that_code_and_names_the_host(side_cluster, work):
    run_id, _ = _detach(side_cluster, work, "crash1.py")
    wait = cli(side_cluster, "wait", run_id, "--json")
    assert wait.returncode == 3, wait.stderr
    doc = json.loads(wait.stdout)
    assert doc["state"] == "failed" and doc["exit_code"] == 3
    assert doc["attempts"][0]["who"] == "host 1 exit 3"
    status = cli(side_cluster, "status", run_id)
    assert "host 1 exit 3" in status.stdout and "exit=3" in status.stdout


@pytest.mark.cluster
def test_a_detached_run_restarts_within_its_budget_and_keeps_every_attempts_logs(side_cluster, work):
    run_id, _ = _detach(side_cluster, work, "flaky.py", "--max-restarts", "1")
    wait = cli(side_cluster, "wait", run_id)
    assert wait.returncode == 0, wait.stderr
    for k in (0, 1):
        log = cli(side_cluster, "logs", run_id, "--host", "1", "--attempt", str(k))
        assert log.returncode == 0 and f"attempt {k} host 1" in log.stdout, log.stderr
    doc = json.loads(cli(side_cluster, "status", run_id, "--json").stdout)
    assert [a["outcome"] for a in doc["attempts"]] == ["failed", "ok"]


@pytest.mark.cluster
def test_a_foreground_run_on_a_remote_cluster_outlives_its_terminal(side_cluster, work, tmp_path):
    """From a machine with only the address and the token (no record of the cluster here): the run is
    submitted to the head and followed; killing the submitting terminal's process group leaves it
    running to its end; `logs --follow` reattaches and `wait` gives its code."""
    info = side_cluster["info"]
    env = cli_env(TPULAUNCH_HOME=str(tmp_path / "laptop"), RAY_AUTH_TOKEN_PATH=info["token_path"])
    (work / "short.py").write_text("import time, tpulaunch\nfor i in range(12):\n"
                                   "    print('beat', i, tpulaunch.context().process_index, flush=True)\n"
                                   "    time.sleep(0.5)\n")
    term = subprocess.Popen([sys.executable, "-m", "tpulaunch", "run", "short.py", *SHARED, "--address",
                             info["address"], "--framework", "none"], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    first = term.stdout.readline()  # the run is going (on the head): what it prints comes back here
    assert "beat" in first or "EMULATED" in first or "tpulaunch:" in first or "note" in first, first + term.stderr.read()
    os.killpg(term.pid, signal.SIGKILL)  # the laptop lid
    term.wait()
    run_id = json.loads(run_cli("runs", "--address", info["address"], "--json", env=env).stdout)["runs"][-1]["run_id"]
    follow = run_cli("logs", run_id, "--follow", "--address", info["address"], env=env, timeout=120)
    assert follow.returncode == 0 and "[host 1] beat 11 1" in follow.stdout, follow.stdout[-2000:] + follow.stderr
    wait = run_cli("wait", run_id, "--address", info["address"], env=env)
    assert wait.returncode == 0, wait.stderr


@pytest.mark.cluster
def test_every_run_command_without_the_token_is_one_line_and_exit_5(side_cluster, tmp_path):
    info = side_cluster["info"]
    env = cli_env(TPULAUNCH_HOME=str(tmp_path / "nobody"))  # no record, no token
    dash = f"http://{info['dashboard']}"
    for args in (["runs"], ["status", "last"], ["logs", "last"], ["stop", "last"], ["wait", "last"]):
        proc = run_cli(*args, "--address", dash, env=env)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == ExitCode.CLUSTER and len(lines) == 1 and "refused no token (401)" in lines[0], (
            args, proc.stderr)
    (tmp_path / "t.py").write_text("print(1)\n")
    proc = run_cli("run", "t.py", "--address", info["address"], "--framework", "none", cwd=tmp_path, env=env)
    assert proc.returncode == ExitCode.CLUSTER and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.cluster
def test_stacks_of_a_detached_run_from_a_machine_with_only_the_token(side_cluster, work, tmp_path):
    """`tpulaunch stacks RUN` against the dashboard: it runs on the head, where the run's files are,
    and the dumps land in the run's attempt directory there; the run goes on."""
    run_id, _ = _detach(side_cluster, work, "tick.py")
    info = side_cluster["info"]
    laptop = cli_env(TPULAUNCH_HOME=str(tmp_path / "laptop"), RAY_AUTH_TOKEN_PATH=info["token_path"])
    dash = f"http://{info['dashboard']}"
    try:
        _until(lambda: all((h["last_line"] or "").startswith("tick")
                           for h in status_doc(side_cluster["env"], run_id)["hosts"] or [{"last_line": ""}]))
        p = run_cli("stacks", run_id, "--address", dash, "--json", env=laptop, cwd=tmp_path, timeout=180)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["run_id"] == run_id and doc["hosts"] == list(range(SHARED_HOSTS)) and "(tick.py:" in doc["where"]
        dumps = Path(doc["dir"])
        assert dumps.parent.resolve() == (_run_dir(side_cluster, run_id) / "attempt-0").resolve()
        assert all("tick.py" in (dumps / f"host-{i}.txt").read_text() for i in range(SHARED_HOSTS))
        assert json.loads(cli(side_cluster, "status", run_id, "--json").stdout)["state"] == "running"
        listed = [r["run_id"] for r in json.loads(cli(side_cluster, "runs", "--json").stdout)["runs"]]
        assert run_id in listed and not [r for r in listed if r.startswith("tpulaunch-")]  # the helper job is no run
    finally:
        cli(side_cluster, "stop", run_id)

"""Hostile records, orphaned clusters, wrong tokens and scripts that leave processes behind, for real.

The rules themselves (one line, exit code, nothing started) are unit-tested in
tests/unit/test_bad_input.py; here real processes must survive, or must not.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from support import SHARED, cli_env, last_summary, processes_mentioning, run_cli, write_scripts
from tpulaunch.cluster import ownership
from tpulaunch.errors import ExitCode


def _one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("kind", ["another directory", "a tpl- directory without our marker"])
def test_cluster_down_never_touches_what_a_record_names_but_tpulaunch_did_not_make(tmp_path, kind):
    """The incident: a cluster.json whose temp_dir named another directory made `cluster down` kill a
    process whose arguments named that path and delete the directory."""
    decoy = Path(f"/tmp/decoy-{uuid.uuid4().hex[:8]}" if kind == "another directory" else f"/tmp/tpl-{uuid.uuid4().hex[:8]}")
    decoy.mkdir()
    (decoy / "precious").write_text("keep me")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", str(decoy)], cwd=decoy,
                              env={"PATH": os.environ["PATH"], "NOTE": str(decoy)})  # its args, env and cwd name the dir
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "cluster.json").write_text(json.dumps({
        "address": "127.0.0.2:1", "temp_dir": str(decoy), "token_path": str(decoy / "auth_token"), "emulated": True,
        "cluster_id": "0123456789abcdef"}))
    try:
        proc = run_cli("cluster", "down", env=cli_env(TPULAUNCH_HOME=str(home)))
        assert proc.returncode == ExitCode.STATE
        line = _one_error_line(proc)
        assert f"cluster record {home / 'cluster.json'}: field 'temp_dir'" in line and "nothing was stopped or deleted" in line
        assert victim.poll() is None, "the decoy process was killed"
        assert (decoy / "precious").read_text() == "keep me"
        force = run_cli("cluster", "down", "--force", env=cli_env(TPULAUNCH_HOME=str(home)))
        assert force.returncode == 0, force.stderr
        assert victim.poll() is None and (decoy / "precious").exists(), "--force touched what is not ours"
    finally:
        victim.kill()
        victim.wait()
        import shutil

        shutil.rmtree(decoy, ignore_errors=True)


@pytest.mark.lifecycle
def test_a_corrupt_record_does_not_orphan_its_cluster_and_a_wrong_token_says_so(tmp_path, shared_cluster):
    """(The shared cluster, another TPULAUNCH_HOME's, stands for a parallel CI job's: --force leaves it.)"""
    shared_id = shared_cluster["record"]["cluster_id"]
    home = tmp_path / "home"
    env = cli_env(TPULAUNCH_HOME=str(home))
    up = run_cli("cluster", "up", "--topology", "2x2", "--prewarm", "none", "--json", env=env, timeout=180)
    assert up.returncode == 0, up.stderr
    doc = json.loads(up.stdout)
    record = json.loads((home / "cluster.json").read_text())
    cid, temp_dir = record["cluster_id"], record["temp_dir"]
    assert ownership.cluster_pids(cid), "the cluster is not running"
    try:
        # a token that is not the cluster's: said so in about a second, not a timeout
        wrong = tmp_path / "wrong-token"
        wrong.write_text("f" * 64)
        wrong.chmod(0o600)
        (tmp_path / "t.py").write_text("print('hi')\n")
        t0 = time.monotonic()
        proc = run_cli("run", "t.py", "--address", doc["address"], "--framework", "none", cwd=tmp_path,
                       env=cli_env(TPULAUNCH_HOME=str(tmp_path / "elsewhere"), RAY_AUTH_TOKEN_PATH=str(wrong)))
        assert proc.returncode == ExitCode.CLUSTER and time.monotonic() - t0 < 12, proc.stderr
        line = _one_error_line(proc)
        assert f"refused the token in {wrong}: it is not this cluster's token" in line

        # a copy of the record in another home stops nothing: one line, exit 6
        copy_home = tmp_path / "copy-home"
        copy_home.mkdir(mode=0o700)
        (copy_home / "cluster.json").write_text((home / "cluster.json").read_text())
        copied = run_cli("cluster", "down", env=cli_env(TPULAUNCH_HOME=str(copy_home)))
        assert copied.returncode == ExitCode.STATE, copied.stderr
        assert "is a copy: cluster" in _one_error_line(copied) and f"TPULAUNCH_HOME={home.resolve()}" in copied.stderr
        assert ownership.cluster_pids(cid), "a copied record stopped the cluster"
        # the user's own `tail -f` of a Ray log of the cluster is not the cluster's
        raylet_out = next(Path(temp_dir).glob("ray/session_latest/logs/raylet.out"))
        tail = subprocess.Popen(["tail", "-f", str(raylet_out)], stdout=subprocess.DEVNULL)

        # cut the record in half: every command says it is unreadable, none says "no cluster is up"
        (home / "cluster.json").write_text((home / "cluster.json").read_text()[:60])
        for args in (["cluster", "status"], ["cluster", "env"], ["cluster", "down"],
                     ["run", "t.py", "--address", "auto"]):
            proc = run_cli(*args, env=env, cwd=tmp_path)
            assert proc.returncode == ExitCode.STATE, (args, proc.stderr)
            line = _one_error_line(proc)
            assert "is corrupt" in line and "tpulaunch cluster down --force" in line, line
        assert ownership.cluster_pids(cid), "a refused command stopped the cluster"

        # --force finds it by its markers and stops it, and removes the broken record
        force = run_cli("cluster", "down", "--force", env=env)
        assert force.returncode == 0, force.stderr
        assert f"cluster {cid} ({temp_dir}) stopped" in force.stdout
        assert "is corrupt" in force.stderr and "removing it" in force.stderr
        assert not ownership.cluster_pids(cid) and not Path(temp_dir).exists()
        assert not (home / "cluster.json").exists()
        assert ownership.cluster_pids(shared_id), "--force stopped another TPULAUNCH_HOME's cluster"
        assert tail.poll() is None, "stopping the cluster killed a process that only had its log open"
        tail.kill()
        tail.wait()
    finally:
        run_cli("cluster", "down", "--force", env=env)
    assert not processes_mentioning([f"{ownership.ID_ENV}={cid}", temp_dir])


LEAVER = """
    import os, subprocess, sys, time, tpulaunch
    ctx = tpulaunch.context()
    if ctx.process_index == 1:
        # what a data-loading server or TensorBoard does: a detached process, and a double-forked daemon
        subprocess.Popen(["setsid", "sleep", "300"])
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                print("daemon up", flush=True)
                time.sleep(300)
            os._exit(0)
    print("script done", ctx.process_index, flush=True)
"""


@pytest.mark.cluster
def test_a_host_ends_when_its_script_ends_and_what_it_left_is_stopped(shared_cluster, tmp_path):
    work = write_scripts(tmp_path, {"leaver.py": LEAVER})
    t0 = time.monotonic()
    proc = run_cli("run", "leaver.py", *SHARED, "--address", "auto", "--framework", "none",
                   "--log-dir", str(tmp_path / "runs"), "--timeout", "120", cwd=work, env=shared_cluster["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60, "the run waited for what the script left"
    s = last_summary(tmp_path / "runs")
    log1 = Path(s["hosts"][1]["log"]).read_text()
    assert "script done 1" in log1 and "daemon up" in log1
    assert "tpulaunch: the script left 2 processes running (" in log1 and "); stopped" in log1
    assert "sleep, pid" in log1
    assert "[host 1] tpulaunch: the script left 2 processes running" in proc.stdout
    deadline = time.monotonic() + 60  # a wait for a state, not a speed: slow CI machines
    while processes_mentioning([f"TPULAUNCH_RUN_ID={s['run_id']}"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning([f"TPULAUNCH_RUN_ID={s['run_id']}"])


@pytest.mark.cluster
def test_keep_children_leaves_them_running_and_says_so(shared_cluster, tmp_path):
    work = write_scripts(tmp_path, {"leaver.py": LEAVER})
    proc = run_cli("run", "leaver.py", *SHARED, "--address", "auto", "--framework", "none",
                   "--keep-children", "--log-dir", str(tmp_path / "runs"), cwd=work, env=shared_cluster["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = last_summary(tmp_path / "runs")
    log1 = Path(s["hosts"][1]["log"]).read_text()
    assert "left running (--keep-children)" in log1
    kept = [int(pid) for pid in re.findall(r"pid (\d+)", log1.split("the script left", 1)[1].splitlines()[0])]
    try:
        assert len(kept) == 2 and all(Path(f"/proc/{pid}").exists() for pid in kept), "--keep-children stopped them"
    finally:
        for pid in kept:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.cluster
def test_exec_of_a_command_that_does_not_exist_says_so_in_every_host_log(shared_cluster, tmp_path):
    proc = run_cli("exec", *SHARED, "--address", "auto", "--log-dir", str(tmp_path), "--",
                   "/nonexistent/cmd", "--flag", cwd=tmp_path, env=shared_cluster["env"])
    assert proc.returncode == 127, proc.stderr
    s = last_summary(tmp_path)
    for h in s["hosts"]:
        assert "cannot start /nonexistent/cmd --flag: No such file or directory" in Path(h["log"]).read_text()
    assert "cannot start /nonexistent/cmd" in proc.stdout + proc.stderr

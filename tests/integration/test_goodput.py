"""Goodput of a real run on the side emulated slice (conftest.py `side_cluster`): a script that saves
every 20 steps, fails once at step 50 (host 0, the host goodput reads: had every host exited there,
the launcher could stop host 0 between the step's collective and its heartbeat, seen under load) and
resumes from step 40 (`--max-restarts 1`); in the foreground and detached. The script uses only
`tpulaunch.heartbeat` (no framework is booted: what is measured is the launcher's clock).
Its hosts step in lockstep, as SPMD hosts do (a file barrier stands for the step's collective):
goodput reads one host's steps for the run's, which holds only if no host runs ahead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import SHARED, SHARED_HOSTS, run_cli, write_scripts

STEP_S, SAVE_S, HOSTS = 0.05, 0.1, SHARED_HOSTS

SCRIPT = f"""
import json, os, sys, time
import tpulaunch

ctx = tpulaunch.context()
ck = os.environ["CKPT"]
start = json.load(open(ck))["step"] if os.path.exists(ck) else 0
sync = f"{{ck}}.{{ctx.restart_count}}.sync"
os.makedirs(sync, exist_ok=True)


def all_done(step):  # the step's collective: no host goes on before every host has done it
    mine = os.path.join(sync, str(ctx.process_index))
    with open(mine + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(mine + ".tmp", mine)
    while True:
        try:
            if all(int(open(os.path.join(sync, str(i))).read()) >= step for i in range({HOSTS})):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.002)


for step in range(start + 1, 71):
    time.sleep({STEP_S})
    all_done(step)
    tpulaunch.heartbeat(step=step)
    if step % 20 == 0:
        time.sleep({SAVE_S})
        if ctx.process_index == 0:
            json.dump({{"step": step}}, open(ck + ".tmp", "w"))
            os.replace(ck + ".tmp", ck)
        tpulaunch.heartbeat(step=step, checkpoint=True)
    if step == 50 and ctx.restart_count == 0 and ctx.process_index == 0:
        sys.exit(3)  # after its step-50 heartbeat; the others wait at step 51's collective until stopped
print("done", flush=True)
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("goodput"), {"train.py": SCRIPT})


def _check(doc: dict) -> None:
    assert doc["schema"] == "tpulaunch.goodput/v1"
    b = doc["buckets"]
    assert abs(sum(b.values()) - doc["wall_s"]) <= 0.02 * doc["wall_s"], (b, doc["wall_s"])
    # which steps count and which were redone: attempt 0 failed after step 50, attempt 1 resumed from
    # the save at 40, so steps 41..50 were done twice
    assert [(a["first_step"], a["resume_step"], a["last_step"]) for a in doc["attempts"]] == [(1, 40, 50), (41, None, 70)]
    assert sum(a["wasted_s"] for a in doc["attempts"]) == pytest.approx(b["wasted_progress"], abs=0.01), doc
    # seconds: each step took its sleep at least. The redone time also holds the launcher's noticing the
    # failure (the host's end, as it saw it), which a busy machine stretches by a second or more: so it is
    # bounded by the 70 steps that counted, not held to 10/70 of them (seen at 0.23 under load)
    assert b["wasted_progress"] >= 0.9 * 10 * STEP_S and b["productive"] >= 0.9 * 70 * STEP_S, b
    assert b["wasted_progress"] < b["productive"], b
    # saves at 20, 40 (kept) and 60: each its sleep, and what a busy machine adds to waking from it (0.419 s in
    # all seen at a load of 4, 0.712 s at 7 on 2 cores); a save that took in the 20 steps before it (1 s each
    # time) would be 1.3 s or more
    assert 0.9 * 3 * SAVE_S <= b["checkpoint"] <= 3 * SAVE_S + 0.9, b
    assert doc["goodput"] == pytest.approx(b["productive"] / doc["wall_s"], rel=0.01)


@pytest.mark.cluster
def test_goodput_of_a_run_that_fails_once_and_resumes(side_cluster, work, tmp_path):
    env = side_cluster["env"]
    proc = run_cli("run", "train.py", *SHARED, "--address", "auto", "--framework", "none",
                   "--max-restarts", "1", "--env", f"CKPT={tmp_path / 'ck.json'}", "--log-dir", str(tmp_path / "runs"),
                   cwd=work, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "goodput " in proc.stderr and "productive" in proc.stderr  # the end of the run says it in one line
    run_dir = next((tmp_path / "runs").iterdir())
    doc = json.loads(run_cli("goodput", str(run_dir), "--json", env=env).stdout)
    _check(doc)
    last = json.loads(run_cli("goodput", "last", "--log-dir", str(tmp_path / "runs"), "--json", env=env).stdout)
    assert last["run_id"] == doc["run_id"]
    out = tmp_path / "trace.json"
    traced = run_cli("trace", str(run_dir), "-o", str(out), env=env)
    assert traced.returncode == 0, traced.stderr
    trace = json.loads(out.read_text())
    assert {e["tid"] for e in trace["traceEvents"]} == set(range(HOSTS + 1))  # the launcher and each host


@pytest.mark.cluster
def test_goodput_of_a_detached_run(side_cluster, work, tmp_path):
    env = side_cluster["env"]
    sub = run_cli("run", "train.py", *SHARED, "--address", "auto", "--framework", "none", "--detach",
                  "--max-restarts", "1", "--env", f"CKPT={tmp_path / 'ck.json'}", cwd=work, env=env)
    assert sub.returncode == 0, sub.stderr
    run_id = sub.stdout.strip().splitlines()[-1]
    wait = run_cli("wait", run_id, env=env, timeout=300)
    assert wait.returncode == 0, wait.stderr
    doc = json.loads(run_cli("goodput", run_id, "--json", env=env).stdout)
    assert doc["run_id"] == run_id
    _check(doc)
    status = run_cli("status", run_id, env=env)
    assert "goodput " in status.stderr, status.stderr

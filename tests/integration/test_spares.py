"""Spare slices: joined, warm, never a run's capacity; one takes a lost slice's place at once, and the
lost one comes back as the spare.

On an emulated cluster (`cluster up --spare-slices 1`), and through the fake Cloud TPU API
(`cluster up --tpu A --tpu B --head local --spare-slices 1`: the spare made through a queued
resource, B preempted mid-run, the run going on on A and the spare from its checkpoint to the final
loss an undisturbed run reaches, B made again in the background as the new spare, and `cluster down`
deleting the slice it made). The scripts import only `tpulaunch.heartbeat`/`context` (framework none).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from fakes import closed_port, cli_env as fake_env, run_cli as fake_cli
from fakes.tpu_api_server import FakeTpuApi
from support import cli_env, run_cli, status_doc, write_scripts
from tpulaunch import procfs

pytestmark = pytest.mark.lifecycle

STEPS, LR = 60, 0.05  # 18 s of steps: the lost slice comes back (as the spare) while the run goes on
SCRIPT = f"""\
import json, os, time
import tpulaunch

ctx = tpulaunch.context()
ckpt = os.path.join(os.environ["CKPT_DIR"], f"host-{{ctx.process_index}}.json")
state = json.load(open(ckpt)) if os.path.exists(ckpt) else {{"step": 0, "w": 4.0}}
step, w = state["step"], state["w"]
print(f"attempt {{ctx.restart_count}} host {{ctx.process_index}} starts at step {{step}} on {{ctx.slice_name}}", flush=True)
while step < {STEPS}:
    time.sleep(0.3)
    w = w - {LR} * 2 * (w - 1.0)  # a step of gradient descent on (w - 1)^2
    step += 1
    tpulaunch.heartbeat(step=step)
    if step % 2 == 0:
        with open(ckpt + ".tmp", "w") as f:
            json.dump({{"step": step, "w": w}}, f)
        os.replace(ckpt + ".tmp", ckpt)
        tpulaunch.heartbeat(step=step, checkpoint=True)
print(f"host {{ctx.process_index}} final loss {{(w - 1.0) ** 2:.6e}}", flush=True)
"""


def undisturbed_loss() -> float:
    w = 4.0
    for _ in range(STEPS):
        w = w - LR * 2 * (w - 1.0)
    return (w - 1.0) ** 2


def _agent_pid_of(run_id: str, slice_name: str) -> int:
    """The host agent (the host process's parent) of a host of `slice_name` in run `run_id`."""
    for p in procfs.processes(skip_self=False):
        env = p.environ().split(b"\0")
        if f"TPULAUNCH_RUN_ID={run_id}".encode() in env and f"TPU_NAME={slice_name}".encode() in env:
            return p.ppid()
    raise AssertionError(f"no host process of run {run_id} on slice {slice_name}")


def test_an_emulated_spare_takes_a_lost_slices_place_and_the_lost_one_is_the_spare_after(tmp_path):
    env = cli_env(TPULAUNCH_HOME=str(tmp_path / "home"))
    up = run_cli("cluster", "up", "--topology", "2x2x1", "--accelerator", "v4", "--num-slices", "2",
                 "--spare-slices", "1", "--prewarm", "none", "--json", env=env, timeout=300)
    assert up.returncode == 0, up.stderr
    try:
        assert json.loads(up.stdout)["spares"] == ["emulated-2"]
        st = json.loads(run_cli("cluster", "status", "--json", env=env).stdout)
        assert st["spares"] == ["emulated-2"] and [s["spare"] for s in st["slices"]] == [False, False, True]
        work = tmp_path / "work"
        work.mkdir()
        write_scripts(work, {"train.py": SCRIPT})
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        run = subprocess.Popen(
            [sys.executable, "-m", "tpulaunch", "run", "train.py", "--address", "auto", "--topology", "2x2x1",
             "--accelerator", "v4", "--num-slices", "2", "--framework", "none", "--max-preemptions", "1",
             "--env", f"CKPT_DIR={ckpt}", "--json"],
            env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        end = time.monotonic() + 180
        while not (ckpt / "host-1.json").exists() or json.loads((ckpt / "host-1.json").read_text())["step"] < 4:
            assert time.monotonic() < end and run.poll() is None, run.communicate()[1][-3000:]
            time.sleep(0.3)
        run_id = next(p.name for p in (work / "runs").iterdir())
        os.kill(_agent_pid_of(run_id, "emulated-1"), signal.SIGTERM)  # its VM goes away: a preemption
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        s = json.loads(out)
        a0 = s["attempts"][0]
        assert a0["outcome"] == "preempted" and a0["replaced"][0]["slice"] == "emulated-1"
        assert a0["replaced"][0]["how"] == "spare emulated-2" and a0["replaced"][0]["seconds"] < 10
        assert s["attempts"][1]["slices"] == ["emulated-0", "emulated-2"]  # the spare in the lost one's place
        assert "spare emulated-2 takes emulated-1's place" in err
        assert f"final loss {undisturbed_loss():.6e}" in err  # from the checkpoint to the undisturbed end
        assert s["attempts"][1]["reason"] == "preemption"
        end = time.monotonic() + 120
        while True:  # the lost slice is the spare now (its host back in Ray)
            st = json.loads(run_cli("cluster", "status", "--json", env=env).stdout)
            if st["spares"] == ["emulated-1"] and all(h["alive"] for sl in st["slices"] for h in sl["hosts"]):
                break
            assert time.monotonic() < end, st
            time.sleep(1)
    finally:
        down = run_cli("cluster", "down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr


def test_a_spare_made_through_the_cloud_tpu_api_steps_in_for_a_preempted_slice(tmp_path):
    slices = tmp_path / "slices.json"
    temp_dir = f"/tmp/tplr-{uuid.uuid4().hex[:8]}"
    zone = "us-central2-b"
    with FakeTpuApi(wait_s=0.2, provision_s=0.3, suspend_s=0.5, gcloud_slices=str(slices)) as api:
        env = fake_env(tmp_path / "home", gcloud=True, TPULAUNCH_HOME=str(tmp_path / "tplhome"),
                       TPULAUNCH_TPU_API_ENDPOINT=api.url, FAKE_GCLOUD_SLICES=str(slices),
                       RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")

        def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
            return fake_cli(*args, env=env, cwd=tmp_path, timeout=timeout)

        for name in ("sa", "sb"):
            made = cli("slice", "create", name, "--accelerator", "v4-8", "--spot", "--wait", "--zone", zone,
                       "--project", "p")
            assert made.returncode == 0, made.stderr
        up = cli("cluster", "up", "--tpu", "sa", "--tpu", "sb", "--zone", zone, "--project", "p", "--head", "local",
                 "--head-ip", "127.0.0.2", "--port", str(closed_port()), "--ray-temp-dir", temp_dir,
                 "--spare-slices", "1", "--json")
        assert up.returncode == 0, up.stderr
        try:
            assert json.loads(up.stdout)["spares"] == ["sa-spare-0"]
            (tmp_path / "train.py").write_text(SCRIPT)
            (tmp_path / "ckpt").mkdir()
            sub = cli("run", "train.py", "--address", "auto", "--framework", "none", "--num-slices", "2", "--dcn",
                      "data=2", "--detach", "--recreate", "--max-preemptions", "1", "--preemption-wait", "300",
                      "--env", f"CKPT_DIR={tmp_path / 'ckpt'}")
            assert sub.returncode == 0, sub.stderr
            run_id = sub.stdout.strip()
            end = time.monotonic() + 180
            f = tmp_path / "ckpt" / "host-1.json"
            while not f.exists() or json.loads(f.read_text())["step"] < 4:
                assert time.monotonic() < end, cli("logs", run_id).stdout[-3000:]
                time.sleep(0.3)
            req = urllib.request.Request(api.url + "/_fake/preempt", data=json.dumps({"node": "sb"}).encode(),
                                         method="POST")
            urllib.request.urlopen(req, timeout=30).read()
            waited = cli("wait", run_id, timeout=400)
            assert waited.returncode == 0, waited.stderr + cli("logs", run_id).stdout[-3000:]
            st = status_doc(env, run_id)
            a0 = st["attempts"][0]
            assert a0["outcome"] == "preempted" and a0["replaced"][0]["how"] == "spare sa-spare-0", a0
            logs = cli("logs", run_id).stdout
            assert f"final loss {undisturbed_loss():.6e}" in logs
            end = time.monotonic() + 240
            while True:  # sb made again (its queued resource) and joined: the new spare
                cs = json.loads(cli("cluster", "status", "--json").stdout)
                if cs["spares"] == ["sb"] and all(h["alive"] for sl in cs["slices"] if sl["name"] == "sb"
                                                  for h in sl["hosts"]):
                    break
                assert time.monotonic() < end, cs
                time.sleep(1)
        finally:
            down = cli("cluster", "down", "--json", timeout=240)
        assert down.returncode == 0, down.stderr
        assert json.loads(down.stdout)["deleted_slices"] == ["sa-spare-0"]
        listed = json.loads(cli("slice", "list", "--zone", zone, "--project", "p", "--json").stdout)
        assert sorted(n["name"] for n in listed["nodes"]) == ["sa", "sb"]  # the slices the test made stay

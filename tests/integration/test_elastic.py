"""Elastic multislice (`--min-slices`) on emulated slices: lose one, train on, grow back.

Two emulated slices (`--topology 2x2 --num-slices 2 --dcn data=2`: one host of 4 devices each).
Slice 1's VM is killed mid-run (every process of it); the run goes on at once on slice 0 (the mesh's DCN axis shrunk to
1), tpulaunch starts the lost host again in the background, and at the first checkpoint after it is
back the run grows to both slices again. A JAX and a torch_xla script, each reading the mesh every
attempt and resuming from its checkpoint, finish with the right number of steps and the final loss
of the same training undisturbed (the data of a step is the same whatever the mesh, so the
trajectory is too: the test replays it in numpy).
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from support import cli_env, live_processes, write_scripts
from test_faults import Launch, _assert_logs, _assert_nothing_left, _run_id

D, ROWS, LR, STEPS, EVERY = 8, 32, 0.05, 100, 5

COMMON = f"""
import json, os, sys, time
import numpy as np
import tpulaunch

D, ROWS, LR, STEPS, EVERY = {D}, {ROWS}, {LR}, {STEPS}, {EVERY}
CKPT = sys.argv[1]
ctx = tpulaunch.context()


def batch(step):  # the global batch of a step: the same whatever the mesh
    rng = np.random.default_rng(step)
    x = rng.standard_normal((ROWS, D)).astype(np.float32)
    return x, (x @ np.arange(1, D + 1, dtype=np.float32) / D).astype(np.float32)


def resume():
    try:
        meta = json.load(open(os.path.join(CKPT, "latest.json")))
    except FileNotFoundError:
        return np.zeros(D, np.float32), 0
    return np.load(meta["file"]), meta["step"] + 1


def save(step, w):
    if ctx.process_index == 0:
        path = os.path.join(CKPT, f"w-{{step}}.npy")
        np.save(path, w)
        with open(os.path.join(CKPT, "latest.tmp"), "w") as f:
            json.dump({{"step": step, "file": path}}, f)
        os.replace(os.path.join(CKPT, "latest.tmp"), os.path.join(CKPT, "latest.json"))
    tpulaunch.heartbeat(step=step, checkpoint=True)
    # an attempt on fewer slices holds at its checkpoints past halfway until the run grows back (it is
    # stopped then): the lost slice's host may take longer to start again than the steps left last
    while ctx.attempt_reason == "shrink" and step >= STEPS // 2:
        time.sleep(0.2)
        tpulaunch.heartbeat(step=step, checkpoint=True)


def report(step, loss, start):
    tpulaunch.heartbeat(step=step)
    if ctx.process_index == 0 and (step == start or step % 10 == 0 or step == STEPS - 1):
        print(f"step {{step}} loss {{loss:.8f}} slices {{ctx.num_slices}}/{{ctx.full_num_slices}} {{ctx.attempt_reason}}",
              flush=True)
    time.sleep(0.1)
"""

SCRIPTS = {
    "elastic_jax.py": COMMON + """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = tpulaunch.get_mesh()  # this attempt's: 8 devices on two slices, 4 on one
rows = NamedSharding(mesh, P(mesh.axis_names))
whole = NamedSharding(mesh, P())


@jax.jit
def train(w, x, y):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - LR * g, loss


w0, start = resume()
w = jax.make_array_from_callback(w0.shape, whole, lambda i: w0[i])
for step in range(start, STEPS):
    x, y = batch(step)
    xs = jax.make_array_from_callback(x.shape, rows, lambda i: x[i])
    ys = jax.make_array_from_callback(y.shape, rows, lambda i: y[i])
    w, loss = train(w, xs, ys)
    report(step, float(loss), start)
    if (step + 1) % EVERY == 0:
        save(step, np.asarray(w.addressable_data(0)))
""",
    "elastic_xla.py": COMMON + """
import torch, torch_xla, torch_xla.distributed.spmd as xs

mesh = tpulaunch.get_mesh()
dev = torch_xla.device()
w0, start = resume()
w = torch.tensor(w0).to(dev)
for step in range(start, STEPS):
    x, y = batch(step)
    xt, yt = torch.tensor(x).to(dev), torch.tensor(y).to(dev)
    xs.mark_sharding(xt, mesh, (mesh.axis_names, None))
    xs.mark_sharding(yt, mesh, (mesh.axis_names,))
    w.requires_grad_(True)
    loss = ((xt @ w - yt) ** 2).mean()
    (g,) = torch.autograd.grad(loss, w)
    w = (w - LR * g).detach()
    torch_xla.sync()
    report(step, loss.item(), start)
    if (step + 1) % EVERY == 0:
        save(step, w.cpu().numpy())
""",
}


def undisturbed_loss() -> float:
    """The same training, undisturbed, in numpy (float64): the last step's loss."""
    w = np.zeros(D)
    for step in range(STEPS):
        rng = np.random.default_rng(step)
        x = rng.standard_normal((ROWS, D)).astype(np.float32).astype(np.float64)
        y = (x.astype(np.float32) @ np.arange(1, D + 1, dtype=np.float32) / D).astype(np.float32).astype(np.float64)
        r = x @ w - y
        loss = float(np.mean(r ** 2))
        w = w - LR * (2 / ROWS) * (x.T @ r)
    return loss


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("elastic"), SCRIPTS)


def _vm_of_slice(slice_name: str, home: str) -> list[int]:
    """Every process of the slice's emulated VM: its raylet, Ray's workers, the host agent and the
    host's process (they all carry its TPU_NAME, and this test's TPULAUNCH_HOME: other tests' clusters
    may have a slice of that name), as a preemption ends them all."""
    mine = (f"TPU_NAME={slice_name}\0".encode(), f"TPULAUNCH_HOME={home}\0".encode())
    return [pid for pid, info in live_processes().items() if all(m in info["environ"] for m in mine)]


@pytest.mark.lifecycle
@pytest.mark.parametrize("script", ["elastic_jax.py", "elastic_xla.py"])
def test_a_lost_slice_shrinks_the_run_which_grows_back_and_ends_with_the_undisturbed_loss(workdir, tmp_path, script):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    env = cli_env(TPULAUNCH_HOME=str(tmp_path / "home"))
    launch = Launch([script, "--topology", "2x2", "--num-slices", "2", "--dcn", "data=2", "--min-slices", "1",
                     "--max-preemptions", "2", "--preemption-wait", "120", "--log-dir", str(tmp_path / "runs"), "--json",
                     "--", str(ckpt)], workdir, env)
    launch.wait_for(r"step 10 loss", 1, timeout=300)
    run_id = _run_id(tmp_path / "runs")
    plan = json.loads((tmp_path / "runs" / run_id / "cluster.json").read_text())
    lost = plan["slices"][1]["name"]
    pids = _vm_of_slice(lost, env["TPULAUNCH_HOME"])
    assert len(pids) >= 3, pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rc, s = launch.finish(timeout=400)
    out = "".join(launch.err)
    assert rc == 0, out[-4000:]
    a = s["attempts"]
    assert [x["reason"] for x in a] == ["first", "shrink", "grow"], [(x["reason"], x["outcome"]) for x in a]
    assert [x["outcome"] for x in a] == ["lost", "grown", "ok"]
    assert len(a[0]["slices"]) == 2 and a[1]["slices"] == [a[0]["slices"][0]] and a[2]["slices"] == a[0]["slices"]
    assert s["preemptions"] == 1 and s["restarts"] == 0
    assert f"going on at once on 1 of 2 slices ({a[0]['slices'][0]})" in out
    assert "growing back after the checkpoint of step" in out
    # what the script saw each attempt
    assert re.search(r"slices 1/2 shrink", out) and re.search(r"slices 2/2 grow", out), out[-3000:]
    final = [float(m) for m in re.findall(rf"step {STEPS - 1} loss ([\d.]+) slices 2/2 grow", out)]
    assert len(final) == 1, out[-3000:]
    assert final[0] == pytest.approx(undisturbed_loss(), rel=1e-4, abs=1e-6)
    # the shrunk attempt ran on slice 0's host alone, with nothing of slice 1 in its environment
    events = [json.loads(line) for line in (tmp_path / "runs" / run_id / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert "shrink" in kinds and "grow" in kinds and kinds.index("shrink") < kinds.index("grow")
    assert len(a[1]["hosts"]) == 1 and len(a[2]["hosts"]) == 2
    _assert_logs(s, 3)
    _assert_nothing_left(run_id)

"""TorchTPU (`--framework torch_tpu`) on emulated slices: one process per device, real gloo, real FSDP2.
(The FSDP2 recipe trains on the shared emulated v5p-16 in test_run.)

* a held-out FSDP2 / DTensor / DCP script that imports nothing of ours runs on two slices of v5p-8
  (`--num-slices 2`: 2 hosts x 4 processes) and sees the contract the plan lists in `--dry-run`,
  in an environment of its own (`--python`: a venv with torch but no torch_xla, JAX, Ray or
  tpulaunch: the host's bootstrap and the torch_tpu adapter run there);
* on that cluster, kept warm, a process SIGKILLed on one host is blamed by host and rank, every
  log is kept and no process is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from support import cli_env, run_cli, write_scripts
from test_faults import Launch, _assert_logs, _assert_nothing_left, _run_id

SCRIPTS = {
    # device-agnostic, as written for the slice: nothing of tpulaunch's
    "held_out.py": """
        import importlib.util, json, os, sys
        import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        device = "tpu" if getattr(torch, "tpu", None) is not None and torch.tpu.is_available() else "cpu"
        dist.init_process_group("tpu_dist" if device == "tpu" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        slices = int(os.environ.get("MEGASCALE_NUM_SLICES", "1"))
        mesh = init_device_mesh(device, (slices, world // slices), mesh_dim_names=("dcn", "ici"))

        x = torch.arange(world * 3, dtype=torch.float32).reshape(world, 3)
        dx = distribute_tensor(x, mesh, [Replicate(), Shard(0)])
        dtensor_ok = tuple(dx.to_local().shape) == (slices, 3) and torch.equal(dx.full_tensor(), x)

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)  # HSDP: replicated over slices, sharded within one
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        losses = []
        for step in range(12):
            inp = torch.randn(16, 8, generator=g)
            loss = F.mse_loss(model(inp), inp.sum(dim=1, keepdim=True))
            opt.zero_grad(); loss.backward(); opt.step()
            avg = loss.detach().clone(); dist.all_reduce(avg)
            losses.append(avg.item() / world)
        dcp.save({"model": model.state_dict()}, checkpoint_id=sys.argv[1])
        fresh = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
        fully_shard(fresh[0], mesh=mesh); fully_shard(fresh, mesh=mesh)
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=sys.argv[1])
        restored = all(torch.equal(a.full_tensor(), b.full_tensor())
                       for a, b in zip(model.state_dict().values(), state["model"].values()))
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "NNODES", "MASTER_ADDR", "TORCH_TPU_TOPOLOGY",
                "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_DEVICES_PER_HOST", "MEGASCALE_SLICE_ID",
                "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_PORT")
        found = [m for m in ("torch_xla", "jax", "ray") if importlib.util.find_spec(m) is not None]
        print("RESULT " + json.dumps({"rank": rank, "world": world, "pid": os.getpid(), "dtensor": dtensor_ok,
                                      "prefix": sys.prefix, "found": found,
                                      "restored": restored, "first": losses[0], "last": losses[-1],
                                      "env": {k: os.environ.get(k) for k in keys}}), flush=True)
        dist.destroy_process_group()
    """,
    "wait.py": """
        import os, time, torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        print(f"READY {dist.get_rank()} {os.getpid()}", flush=True)
        time.sleep(600)
    """,
}

TWO_SLICES = ["--topology", "2x2x1", "--accelerator", "v5p", "--num-slices", "2", "--framework", "torch_tpu"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("torch-tpu"), SCRIPTS)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A venv holding this one's packages (links) except torch_xla, JAX, Ray and tpulaunch itself."""
    env = tmp_path_factory.mktemp("bare-env")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(env)], check=True)
    ours = Path(sysconfig.get_paths()["purelib"])
    (theirs,) = env.glob("lib/python*/site-packages")
    for entry in ours.iterdir():
        if not re.match(r"(torch_xla|jax|jaxlib|ray|libtpu|tpulaunch|__editable__|_tpulaunch|__pycache__)", entry.name):
            (theirs / entry.name).symlink_to(entry)
    return str(env / "bin" / "python")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A TPULAUNCH_HOME of the module's own: the two-slice cluster the held-out run keeps warm lives here."""
    env = cli_env(TPULAUNCH_HOME=str(tmp_path_factory.mktemp("tt-home")))
    yield env
    down = run_cli("cluster", "down", env=env, timeout=120)
    assert down.returncode in (0, 5), down.stderr  # 5: none was up (the module ran in part)


def test_a_held_out_fsdp2_script_runs_on_two_emulated_slices_in_an_environment_without_torch_xla(
        home, workdir, tmp_path, bare_python):
    args = ["held_out.py", *TWO_SLICES, "--log-dir", str(tmp_path), "--python", bare_python]
    dry = json.loads(run_cli("run", *args, "--dry-run", "--json", env=home, cwd=workdir).stdout)
    proc = run_cli("run", *args, "--keep-cluster", "--", str(tmp_path / "ckpt"), env=home, timeout=400, cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["rank"]: r for r in (json.loads(line.split("RESULT ", 1)[1])
                                      for line in proc.stdout.splitlines() if "RESULT " in line)}
    assert sorted(results) == list(range(8))
    planned = {p["rank"]: p["env"] for h in dry["hosts"] for p in h["processes"]}
    for rank, r in results.items():
        assert r["world"] == 8 and r["dtensor"] and r["restored"]
        assert r["found"] == [] and r["prefix"] == str(Path(bare_python).parent.parent)
        assert r["last"] < 0.5 * r["first"]
        node, local = divmod(rank, 4)
        env = r["env"]
        assert (env["NODE_RANK"], env["LOCAL_RANK"], env["NNODES"]) == (str(node), str(local), "2")
        assert env["MEGASCALE_SLICE_ID"] == str(node) and env["MEGASCALE_PORT"] == str(8080 + 2 * local)
        assert env["TORCH_TPU_TOPOLOGY"] == "2,2,1" and env["TORCH_TPU_DEVICES_PER_HOST"] == "4"
        for key in ("RANK", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "MEGASCALE_COORDINATOR_ADDRESS"):
            assert env[key] == planned[rank][key], key  # what --dry-run listed (run ids aside)
    assert len({r["pid"] for r in results.values()}) == 8


def test_a_process_killed_on_one_host_is_blamed_by_host_and_rank(home, workdir, tmp_path):
    """On the cluster the run before kept warm: SIGKILL rank 6 (host 1, local rank 2)."""
    launch = Launch(["wait.py", *TWO_SLICES, "--log-dir", str(tmp_path), "--json"], workdir, home)
    launch.wait_for(r"READY \d+ \d+", 8)
    pid = next(int(m.group(1)) for line in launch.lines + launch.err for m in [re.search(r"READY 6 (\d+)", line)] if m)
    run_id = _run_id(tmp_path)
    stacks = run_cli("stacks", run_id, "--log-dir", str(tmp_path), "--json", env=home, cwd=workdir, timeout=120)
    assert stacks.returncode == 0, stacks.stderr
    dump_dir = Path(json.loads(stacks.stdout)["dir"])
    for host in (0, 1):  # py-spy dumps every process of the host: its own and one per device
        text = (dump_dir / f"host-{host}.txt").read_text()
        assert text.count("wait.py") == 4 and "ranks.py" in text, text[:3000]
    os.kill(pid, signal.SIGKILL)
    rc, s = launch.finish()
    assert rc == 137
    f = s["first_failure"]
    assert (f["process_index"], f["rank"]) == (1, 6)
    assert f["reason"] == "rank 6 (local rank 2) killed by signal 9 (SIGKILL)"
    others = [h for h in s["hosts"] if h["process_index"] != 1]
    assert all(h["stopped_by_tpulaunch"] for h in others)
    _assert_logs(s, 1)
    attempt = Path(s["attempts"][0]["log_dir"])
    for host, ranks in ((0, range(4)), (1, range(4, 8))):
        for r in ranks:
            assert f"READY {r} " in (attempt / f"host-{host}" / f"rank-{r}.log").read_text()
    assert "tpulaunch: rank 6 (host 1, local rank 2) failed: killed by signal 9" in (attempt / "host-1.log").read_text()
    _assert_nothing_left(run_id)

"""Existing scripts, as users write them from the torch_xla and JAX docs, run unchanged.

Every script here imports nothing of tpulaunch: its own `dist.init_process_group` (xla://,
env://), its own `jax.distributed.initialize()`, per-host minibatch loading, distributed
checkpoints saved in one run and restored in the next. They run on the shared warm emulated v5p-16
(2 hosts x 4 devices; 8 devices in every torch_xla host process), and must see what they would
see on the slice.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support import REPO, SHARED, SHARED_HOSTS, last_summary, run_cli, write_scripts
from test_faults import Launch, _host_pid, _run_id
from tpulaunch.procfs import Process

HOSTS = SHARED_HOSTS

SCRIPTS = {
    # torch.distributed the way pytorch/xla's SPMD docs open it; then destroyed and made again
    "own_group.py": """
        import os, sys, torch, torch.distributed as dist
        import torch_xla, torch_xla.runtime as xr, torch_xla.core.xla_model as xm
        import torch_xla.distributed.xla_backend  # registers the xla:// init method
        xr.use_spmd()
        method = sys.argv[1]
        if method == "xla":
            dist.init_process_group("gloo", init_method="xla://")
        elif method == "env-explicit":
            dist.init_process_group(backend="gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        else:
            dist.init_process_group("gloo")
        t = torch.tensor([xr.process_index()])
        dist.all_reduce(t)
        print(f"GROUP rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item()}", flush=True)
        print(f"RUNTIME pi={xr.process_index()} pc={xr.process_count()} host={xr.host_index()} "
              f"global={xr.global_runtime_device_count()} addressable={xr.addressable_runtime_device_count()} "
              f"master={xm.is_master_ordinal(local=False)} ordinal={xr.global_ordinal()}", flush=True)
        xm.master_print(f"MASTER_PRINT from {xr.process_index()}")
        ray_vars = sorted(k for k in ("RAY_JOB_ID", "RAY_RAYLET_PID", "RAY_CLIENT_MODE") if k in os.environ)
        print(f"THREADS torch={torch.get_num_threads()} nice={os.nice(0)} omp={os.environ.get('OMP_NUM_THREADS')} ray={ray_vars}",
              flush=True)
        dist.destroy_process_group()
        print("DESTROYED", dist.is_initialized(), flush=True)
        if method != "env-explicit":
            # After tpulaunch's group (its store on a port of its own), a new env:// group on
            # MASTER_PORT works. The script's own env:// group made twice on the same MASTER_PORT
            # (--no-dist) races torch's closing store on a plain host too, so that case stops here.
            dist.init_process_group("gloo")  # env:// from MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
            t = torch.tensor([1])
            dist.all_reduce(t)
            print(f"AGAIN rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item()}", flush=True)
            dist.destroy_process_group()
    """,
    "jax_own.py": """
        import os, sys
        import jax, jax.numpy as jnp
        from jax.experimental import multihost_utils
        if sys.argv[1] == "explicit":
            jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                                       num_processes=int(os.environ["WORLD_SIZE"]), process_id=int(os.environ["RANK"]))
        else:
            jax.distributed.initialize()
        try:
            jax.distributed.initialize(num_processes=3)
        except RuntimeError as e:
            print("SECOND", e, flush=True)
        total = multihost_utils.process_allgather(jnp.array([jax.process_index()])).sum()
        print(f"JAX pi={jax.process_index()} pc={jax.process_count()} devices={jax.device_count()} "
              f"local={jax.local_device_count()} sum={int(total)}", flush=True)
        jax.distributed.shutdown()
        print("SHUTDOWN ok", flush=True)
    """,
    # per-host input (DistributedSampler over hosts, minibatch=True) and SPMD distributed checkpoints
    "minibatch_ckpt.py": """
        import os, sys
        import numpy as np, torch, torch.distributed as dist
        import torch_xla, torch_xla.runtime as xr, torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs, torch_xla.distributed.parallel_loader as pl
        import torch.distributed.checkpoint as dist_cp
        import torch_xla.experimental.distributed_checkpoint as xc
        import torch_xla.distributed.xla_backend
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        xr.use_spmd()
        dist.init_process_group("gloo", init_method="xla://")
        # torch_xla's checkpoint manager, as its docs make it: its preemption sync starts XLA's
        # coordination service in host 0, which every other host's runtime polls until it ends
        # hosts sharing a filesystem (NFS, Filestore, this emulated slice) race in the manager's own
        # exists-then-mkdir, so the directory is made first, as the fsdpv2_decoder recipe does
        os.makedirs(sys.argv[1] + "-managed", exist_ok=True)
        manager = xc.CheckpointManager(sys.argv[1] + "-managed", 10)
        device = torch_xla.device()
        n, hosts, me = xr.global_runtime_device_count(), xr.process_count(), xr.process_index()
        mesh = xs.Mesh(np.arange(n), (hosts, n // hosts), ("data", "model"))
        GLOBAL, F = 16, 8
        data = torch.arange(64 * F, dtype=torch.float32).reshape(64, F)
        ds = TensorDataset(data)
        loader = DataLoader(ds, batch_size=GLOBAL // hosts,
                            sampler=DistributedSampler(ds, num_replicas=hosts, rank=me, shuffle=False))
        batches = pl.MpDeviceLoader(loader, device, input_sharding=xs.ShardingSpec(mesh, ("data", None), minibatch=True))
        (batch,) = next(iter(batches))
        w = torch.arange(F, dtype=torch.float32).to(device)
        print(f"LOADER shape={tuple(batch.shape)} sum={batch.sum().item():.1f} loss={(batch @ w).sum().item():.1f}", flush=True)
        local = data[me * 4:(me + 1) * 4] * 2  # this host's own 4 rows
        x = xm.send_cpu_data_to_device(local, device, input_sharding=xs.ShardingSpec(mesh, ("data", None), minibatch=True))[0]
        xs.mark_sharding(x, mesh, ("data", None))
        print(f"SEND shape={tuple(x.shape)} sum={x.sum().item():.1f} sharding={torch_xla._XLAC._get_xla_sharding_spec(x)}", flush=True)
        try:
            xm.send_cpu_data_to_device(local[:3], device, input_sharding=xs.ShardingSpec(mesh, ("data", None), minibatch=True))
        except RuntimeError as e:
            print("UNEVEN", str(e).split(".")[0], flush=True)

        path = sys.argv[1]
        wt = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8).to(device)
        xs.mark_sharding(wt, mesh, ("data", None))  # replicated inside each host, as on the slice
        if not os.path.exists(os.path.join(path, ".metadata")):
            dist_cp.save(state_dict={"w": wt}, storage_writer=dist_cp.FileSystemWriter(path), planner=xc.SPMDSavePlanner())
            print("SAVED", flush=True)
        else:
            target = torch.zeros(16, 8).to(device)
            xs.mark_sharding(target, mesh, ("data", None))
            state = {"w": target}
            dist_cp.load(state_dict=state, storage_reader=dist_cp.FileSystemReader(path), planner=xc.SPMDLoadPlanner())
            print(f"LOADED equal={torch.equal(state['w'].cpu(), wt.cpu())}", flush=True)

        # on the way out, as from `python minibatch_ckpt.py`: the non-daemon thread is waited for,
        # then the atexit handler runs (where wandb, TensorBoard writers, async checkpointers finish);
        # host 1's takes longer, so host 0 would end first and host 1 abort, polling a service gone
        import atexit, threading, time
        def upload():
            time.sleep(0.5 if xr.process_index() == 0 else 2.5)
            print("EXIT thread done", flush=True)
        threading.Thread(target=upload).start()
        atexit.register(lambda: print(f"EXIT atexit {xr.process_index()}", flush=True))
    """,
    # torch_xla's preemption handling, as its docs show it: CheckpointManager saves at the step all
    # hosts agree on after a SIGTERM (XLA's preemption sync), and the script leaves after it
    "preempt_sync.py": """
        import os, sys, time
        import torch, torch.distributed as dist
        import torch_xla, torch_xla.runtime as xr
        import torch_xla.distributed.xla_backend
        import torch_xla.experimental.distributed_checkpoint as xc

        xr.use_spmd()
        dist.init_process_group("gloo", init_method="xla://")
        os.makedirs(sys.argv[1], exist_ok=True)  # the hosts share this filesystem (see minibatch_ckpt.py)
        ckpt = xc.CheckpointManager(sys.argv[1], 10_000)  # no step is on the interval: only a preemption saves
        me = xr.process_index()
        w = torch.zeros(8).to(torch_xla.device())
        start = max(ckpt.all_steps(), default=0)
        if start:
            state = {"w": w}
            ckpt.restore(start, state)
            w = state["w"]
            print(f"RESUMED {me} at step {start} w={w.sum().item():.0f}", flush=True)
        for step in range(start + 1, start + 10_000):
            w = w + 1
            torch_xla.sync()
            if step == start + 1:
                print(f"READY {me} attempt {1 if start else 0}", flush=True)
            if ckpt.save(step, {"w": w}):
                print(f"SAVED {me} at step {step} w={w.sum().item():.0f}", flush=True)
            if ckpt.reached_preemption(step):
                print(f"LEAVING {me} at step {step}", flush=True)
                sys.exit(0)
            if start and step == start + 3:
                print(f"DONE {me} w={w.sum().item():.0f}", flush=True)
                break
            time.sleep(0.2)
    """,
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("idioms"), SCRIPTS)


def _run(shared_cluster, workdir, tmp_path, script, *args, flags=()):
    proc = run_cli("run", script, *SHARED, "--address", "auto", "--log-dir", str(tmp_path), *flags,
                   "--", *args, cwd=workdir, env=shared_cluster["env"], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return proc


def _lines(proc, tag: str) -> dict[int, str]:
    found = dict(re.findall(rf"^\[host (\d)\] {tag} (.*)$", proc.stdout, re.M))
    assert sorted(found) == [str(i) for i in range(HOSTS)], proc.stdout[-3000:]
    return {int(k): v for k, v in found.items()}


@pytest.mark.cluster
@pytest.mark.parametrize("method, flags", [("xla", ()), ("plain", ()), ("env-explicit", ("--no-dist",))])
def test_a_scripts_own_process_group_is_the_slices(shared_cluster, workdir, tmp_path, method, flags):
    """With tpulaunch's group (adopted) or without it (--no-dist): rank i of 2, destroy, init again.

    The host's CPU threads and priority are what the script gets when run by hand, not the 1 thread
    (OMP_NUM_THREADS) and nice 15 that Ray gives its own worker processes, and no variable of the
    agent's Ray worker leaks in."""
    proc = _run(shared_cluster, workdir, tmp_path, "own_group.py", method, flags=flags)
    groups, runtime = _lines(proc, "GROUP"), _lines(proc, "RUNTIME")
    again = _lines(proc, "AGAIN") if method != "env-explicit" else {}
    printed, threads = _lines(proc, "MASTER_PRINT from"), _lines(proc, "THREADS")
    by_hand = subprocess.run([sys.executable, "-c", "import os, torch; print(f'torch={torch.get_num_threads()} nice={os.nice(0)}')"],
                             env=shared_cluster["env"], capture_output=True, text=True, check=True).stdout.strip()
    for i in range(HOSTS):
        assert threads[i] == f"{by_hand} omp=None ray=[]"
        assert groups[i] == f"rank={i} world=2 sum=1"
        # process i of 2, the slice's 8 devices, 4 of them this host's; in SPMD the global ordinal
        # is the virtual device's (0) on every host, so torch_xla's own master check says True on
        # every host of a real slice too (pytorch/xla#7855): use xr.process_index() == 0.
        assert runtime[i] == f"pi={i} pc=2 host={i} global=8 addressable=4 master=True ordinal=0"
        assert printed[i] == str(i)
        if method != "env-explicit":
            assert again[i] == f"rank={i} world=2 sum=2"
    assert "DESTROYED False" in proc.stdout
    assert "twice" not in proc.stdout + proc.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("how", ["auto", "explicit"])
def test_a_jax_scripts_own_initialize(shared_cluster, workdir, tmp_path, how):
    proc = _run(shared_cluster, workdir, tmp_path, "jax_own.py", how)
    seen = _lines(proc, "JAX")
    second = _lines(proc, "SECOND")
    for i in range(HOSTS):
        assert seen[i] == f"pi={i} pc=2 devices=8 local=4 sum=1"
        assert second[i] == "distributed.initialize should only be called once."
    assert proc.stdout.count("SHUTDOWN ok") == HOSTS


@pytest.mark.cluster
def test_minibatch_input_forms_the_global_batch_and_checkpoints_restore(shared_cluster, workdir, tmp_path):
    data = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    w = np.arange(8, dtype=np.float32)
    # step 0 of the samplers together is rows 0..15: the slice's global batch
    want_loader = f"shape=(16, 8) sum={data[:16].sum():.1f} loss={(data[:16] @ w).sum():.1f}"
    # each host sends its own 4 rows: rows 0..7 together
    want_send = f"shape=(8, 8) sum={2 * data[:8].sum():.1f}"
    ckpt = tmp_path / "ckpt"
    for run, verdict in enumerate(("SAVED", "LOADED equal=True")):
        proc = _run(shared_cluster, workdir, tmp_path / f"run{run}", "minibatch_ckpt.py", str(ckpt))
        loader, send, uneven = _lines(proc, "LOADER"), _lines(proc, "SEND"), _lines(proc, "UNEVEN")
        for i in range(HOSTS):
            assert loader[i] == want_loader
            assert send[i].startswith(want_send + " sharding={devices=[2,1,4]")
            assert uneven[i] == "When minibatch is configured, the per-host batch size must be divisible by local runtime device count"
        assert proc.stdout.count(f"] {verdict}") == HOSTS, proc.stdout[-2000:]
        for i in range(HOSTS):  # the script's thread, then its atexit handler
            mine = re.findall(rf"^\[host {i}\] EXIT (.*)$", proc.stdout, re.M)
            assert mine == ["thread done", f"atexit {i}"], proc.stdout[-2000:]
    assert (ckpt / ".metadata").exists()


@pytest.mark.cluster
def test_fsdpv2_recipe_resumes_from_its_checkpoint(shared_cluster, tmp_path):
    ckpt = tmp_path / "ckpt"

    def train(log: str):
        proc = run_cli("run", "recipes/fsdpv2_decoder.py", *SHARED, "--address", "auto",
                       "--log-dir", str(tmp_path / log), "--", "--steps", "4", "--ckpt-every", "2", "--layers", "1",
                       "--ckpt-dir", str(ckpt), cwd=REPO, env=shared_cluster["env"], timeout=500)
        assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
        summary = last_summary(tmp_path / log)
        logs = [Path(h["log"]).read_text() for h in summary["hosts"]]
        return proc, [{int(s): float(v) for s, v in re.findall(r"step (\d+) loss ([0-9.]+)", t)} for t in logs]

    _, first = train("first")
    assert all(sorted(h) == list(range(1, 5)) for h in first)
    assert all(h == first[0] for h in first), "every host computes the same global step"
    assert first[0][4] < first[0][1] * 0.9, first[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4"]
    shutil.rmtree(ckpt / "4")  # as if the run had died after step 3
    proc, resumed = train("resumed")
    assert "resumed from the checkpoint of step 2" in proc.stdout
    for host in resumed:
        assert sorted(host) == [3, 4]
        for step in (3, 4):  # the same loss curve after the restore
            assert host[step] == pytest.approx(first[0][step], rel=1e-4, abs=1e-5), (step, host, first[0])


@pytest.mark.cluster
def test_checkpoint_managers_preemption_sync_saves_on_every_host_and_the_run_resumes(shared_cluster, workdir,
                                                                                      tmp_path):
    """Host 1's VM goes away (SIGTERM to its agent, as in test_faults): tpulaunch gives every host's
    script SIGTERM and its grace, XLA's preemption sync picks one step for all, CheckpointManager
    saves there and the scripts leave; the next attempt restores that step and finishes."""
    launch = Launch(["preempt_sync.py", *SHARED, "--address", "auto", "--log-dir", str(tmp_path / "runs"), "--json",
                     "--max-preemptions", "1", "--", str(tmp_path / "ckpt")], workdir, shared_cluster["env"])
    launch.wait_for(r"\] READY \d attempt 0", HOSTS)
    run_id = _run_id(tmp_path / "runs")
    agent = Process(_host_pid(run_id, 1)).ppid()  # its parent: the HostAgent actor
    os.kill(agent, signal.SIGTERM)
    rc, s = launch.finish()
    out = "".join(launch.lines + launch.err)
    assert rc == 0 and s["preemptions"] == 1 and s["restarts"] == 0, out[-3000:]
    a0, a1 = s["attempts"]
    assert a0["outcome"] == "preempted" and a0["first_failure"]["process_index"] == 1 and a1["outcome"] == "ok"
    logs = [Path(h["log"]).read_text() for h in a0["hosts"]]
    saved = [re.findall(r"^SAVED (\d) at step (\d+) w=(\d+)$", text, re.M) for text in logs]
    assert [len(x) for x in saved] == [1, 1], logs  # once, on every host
    (i0, step, w), (i1, step1, w1) = saved[0][0], saved[1][0]
    assert (i0, i1) == ("0", "1") and step == step1 and w == w1 == str(8 * int(step))  # the same step on both
    for i, text in enumerate(logs):
        assert f"LEAVING {i} at step {step}" in text  # ...and each left there, with exit 0
    assert all(h["exit_code"] == 0 for h in a0["hosts"]), a0["hosts"]
    for i, h in enumerate(a1["hosts"]):
        text = Path(h["log"]).read_text()
        assert f"RESUMED {i} at step {step} w={w}" in text and f"DONE {i} w={8 * (int(step) + 3)}" in text


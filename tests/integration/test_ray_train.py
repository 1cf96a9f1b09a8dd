"""Ray Train on an emulated slice: `TorchTrainer` / `JaxTrainer` with tpulaunch's backends.

The planning from worker labels is tested as a pure function; the rest runs real Ray Train
drivers (`eval "$(tpulaunch cluster env)"; python driver.py`) on the side cluster (conftest.py
`side_cluster`: shaped as the shared one, 2 hosts of 4 chips, no spares), ranks in whatever order
Ray places them, so that `./scripts/test` runs these fits (about an eighth of the suite's CPU) beside
the tests on the shared cluster, not after them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import REPO, SHARED_HOSTS, run_cli


# -- real Ray Train runs on an emulated cluster -----------------------------------------------------

DRIVER = '''
import json, os, sys

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2.jax import JaxTrainer

from tpulaunch.ray_train import JaxSpmdConfig, XlaSpmdConfig

OUT = sys.argv[1]
# Ray starts a job's workers (Ray Train's controller and workers among them) at nice 15; the suite's
# other pytest processes run at 0 beside this driver and starved them (CI once ran these fits past
# 600 s). Ray's own job manager starts its supervisors at 0 the same way.
ray.init(runtime_env={"env_vars": {"RAY_worker_niceness": "0"}})
SCALING = dict(num_workers=2, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V5P", resources_per_worker={"TPU": 4})


def torch_loop(config):
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    import ray.train
    import tpulaunch

    ctx = tpulaunch.context()
    mesh = tpulaunch.get_mesh()
    if ctx.worker_id == config.get("fail_worker") and ctx.restart_count == 0:
        raise RuntimeError("this worker fails on its first attempt")
    total = torch.tensor([float(ctx.process_index)])
    dist.all_reduce(total)
    x = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    w = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    xd = x.to(torch_xla.device())
    xs.mark_sharding(xd, mesh, ("data", "model"))
    got = (xd @ w.to(torch_xla.device())).sum(dim=1).cpu()
    rec = dict(tag=config["tag"], rank=ray.train.get_context().get_world_rank(), process_index=ctx.process_index,
               tpu_worker_id=int(os.environ["TPU_WORKER_ID"]), allreduce=total.item(), restart=ctx.restart_count,
               mesh=[list(mesh.mesh_shape), list(mesh.axis_names)], exact=bool(torch.equal(got, (x @ w).sum(dim=1))),
               xr=[xr.process_index(), xr.process_count()], dist=[dist.get_rank(), dist.get_world_size()])
    with open(os.path.join(OUT, f"{config['tag']}-{ctx.restart_count}-{ctx.process_index}.json"), "w") as f:
        json.dump(rec, f)
    print(f"process {ctx.process_index} is Ray Train rank {rec['rank']}", flush=True)


def jax_loop(config):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import tpulaunch

    ctx = tpulaunch.context()
    mesh = tpulaunch.get_mesh()
    x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("data", "model")), lambda i: x[i])
    total = float(jax.jit(jnp.sum)(arr))
    tag = config.get("tag", "jax")
    rec = dict(tag=tag, process_index=ctx.process_index, jax=[jax.process_index(), jax.process_count()],
               tpu_worker_id=int(os.environ["TPU_WORKER_ID"]), mesh=[list(mesh.devices.shape), list(mesh.axis_names)],
               exact=total == float(x.sum()), local=jax.local_device_count(), devices=jax.device_count())
    with open(os.path.join(OUT, f"{tag}-0-{ctx.process_index}.json"), "w") as f:
        json.dump(rec, f)


def run(name, trainer):
    try:
        result = trainer.fit()
        outcome = {"error": None if result.error is None else str(result.error)}
    except Exception as e:
        outcome = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(OUT, f"outcome-{name}.json"), "w") as f:
        json.dump(outcome, f)


def rc(name, failures=0):
    return RunConfig(name=name, storage_path=os.path.join(OUT, "storage"), failure_config=FailureConfig(max_failures=failures))


for what in sys.argv[2:]:
    if what.startswith("torch"):
        run(what, TorchTrainer(torch_loop, train_loop_config={"tag": what}, torch_config=XlaSpmdConfig(),
                               scaling_config=ScalingConfig(**SCALING), run_config=rc(what)))
    elif what == "restart":
        run(what, TorchTrainer(torch_loop, train_loop_config={"tag": what, "fail_worker": 1},
                               torch_config=XlaSpmdConfig(), scaling_config=ScalingConfig(**SCALING),
                               run_config=rc(what, failures=1)))
    elif what == "wrong-slice":  # JAX sees 2 devices per host, 4 in all; the slice has 8
        run(what, JaxTrainer(jax_loop, train_loop_config={"tag": what}, scaling_config=ScalingConfig(**SCALING),
                             run_config=rc(what),
                             jax_config=JaxSpmdConfig(env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})))
    elif what == "jax":
        run(what, JaxTrainer(jax_loop, jax_config=JaxSpmdConfig(), scaling_config=ScalingConfig(**SCALING),
                             run_config=rc(what)))
    elif what == "recipe":  # the recipe as a user runs it (`python recipes/ray_train_xla.py ...`), in this driver
        import runpy
        recipe, *args = os.environ["RECIPE_ARGV"].split()
        sys.argv = [recipe, *args]
        runpy.run_path(recipe, run_name="__main__")
'''


# The four fits take two minutes alone, several beside two other pytest processes: the module gets a
# budget above its driver's, so a driver that runs over is reported with what it printed (which fits
# ended), not cut off by pytest-timeout
DRIVER_TIMEOUT_S = 1000
pytestmark = pytest.mark.timeout(DRIVER_TIMEOUT_S + 100)

RECIPE = [str(REPO / "recipes" / "ray_train_xla.py"), "--steps", "12", "--topology", "2x2x2",
          "--accelerator-type", "TPU-V5P", "--workers", str(SHARED_HOSTS)]


def _driver(cluster, tmp: Path, *runs: str) -> subprocess.CompletedProcess:
    """`eval "$(tpulaunch cluster env)"` then a plain `python driver.py`, as a user would."""
    (tmp / "driver.py").write_text(textwrap.dedent(DRIVER))
    cmd = f'eval "$({sys.executable} -m tpulaunch cluster env)" && exec {sys.executable} {tmp / "driver.py"} {tmp} {" ".join(runs)}'
    # Ray Train's own knob, as a deployment may set it (the driver hands it to the controller): the
    # controller looks at its workers every 0.5 s, not 2 s, so each run's end and failure is seen sooner
    env = {**cluster["env"], "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
           "RECIPE_ARGV": " ".join([*RECIPE, "--storage", str(tmp / "recipe-storage")])}
    try:
        return subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S,
                              cwd=REPO)
    except subprocess.TimeoutExpired as e:  # say which fits ended (their outcome files) and what it printed
        ended = sorted(p.name for p in tmp.glob("outcome-*.json"))
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        pytest.fail(f"the driver ran over {DRIVER_TIMEOUT_S} s; fits ended: {ended}; its output ends:\n{out[-4000:]}")


def _records(tmp: Path, tag: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{tag}-*.json"))]


@pytest.fixture(scope="module")
def train_runs(side_cluster, tmp_path_factory):
    """In one driver: a TorchTrainer run whose worker 1 fails once (its second attempt is the clean
    run the checks look at), a JaxTrainer run whose runtime sees another slice, a clean JaxTrainer
    run, then the recipe (`recipes/ray_train_xla.py`, run as `__main__` with its argv). Each places
    its workers anew (Ray's rank order changes)."""
    tmp = tmp_path_factory.mktemp("ray-train")
    proc = _driver(side_cluster, tmp, "restart", "wrong-slice", "jax", "recipe")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"dir": tmp, "proc": proc}


@pytest.mark.cluster
def test_cluster_env_prints_what_a_driver_needs(side_cluster):
    proc = run_cli("cluster", "env", env=side_cluster["env"])
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.removeprefix("export ").split("=", 1) for line in proc.stdout.splitlines())
    assert lines["RAY_ADDRESS"] == side_cluster["info"]["address"]
    assert lines["RAY_AUTH_MODE"] == "token" and lines["RAY_AUTH_TOKEN_PATH"] == side_cluster["info"]["token_path"]


@pytest.mark.cluster
def test_torch_trainer_workers_are_their_tpu_hosts(train_runs):
    recs = _records(train_runs["dir"], "restart-1")
    assert json.loads((train_runs["dir"] / "outcome-restart.json").read_text()) == {"error": None}
    assert sorted(r["process_index"] for r in recs) == list(range(SHARED_HOSTS))
    for r in recs:
        assert r["process_index"] == r["tpu_worker_id"]  # whatever Ray's rank was
        assert r["allreduce"] == 1.0
        assert r["mesh"] == [[2, 4], ["data", "model"]]
        assert r["exact"]
        assert r["xr"] == [r["process_index"], 2] and r["dist"] == [r["process_index"], 2]
    # the workers' output reached the driver's terminal (Ray's log monitor on `cluster up` clusters;
    # Ray folds lines that differ only in numbers, so one of them is enough)
    out = train_runs["proc"].stdout + train_runs["proc"].stderr
    assert any(f"process {r['process_index']} is Ray Train rank {r['rank']}" in out for r in recs), out[-3000:]


@pytest.mark.cluster
def test_failure_config_restarts_the_group_with_a_new_mesh(train_runs):
    assert json.loads((train_runs["dir"] / "outcome-restart.json").read_text()) == {"error": None}
    first, second = _records(train_runs["dir"], "restart-0"), _records(train_runs["dir"], "restart-1")
    assert len(first) < SHARED_HOSTS  # worker 1 failed before writing; the other may or may not have finished
    assert all(r["restart"] == 0 and r["process_index"] != 1 for r in first)
    assert sorted(r["process_index"] for r in second) == list(range(SHARED_HOSTS))
    for r in second:
        assert r["restart"] == 1 and r["allreduce"] == 1.0 and r["exact"]
        assert r["process_index"] == r["tpu_worker_id"] and r["mesh"] == [[2, 4], ["data", "model"]]


@pytest.mark.cluster
def test_a_worker_that_sees_another_slice_fails_with_one_line(train_runs):
    """...and releases the slice: the JaxTrainer after it, in the same driver, gets it (Ray 2.60
    alone would keep it reserved and the next fit() would wait forever)."""
    error = json.loads((train_runs["dir"] / "outcome-wrong-slice.json").read_text())["error"]
    assert "tpulaunch: host 0 (slice emulated worker 0, Ray Train rank " in error  # the first host, by index
    assert "JAX has 4 devices but the planned mesh {'data': 2, 'model': 4} needs 8" in error
    assert "(and 1 more host(s))" in error
    assert not _records(train_runs["dir"], "wrong-slice")  # no loop ran


@pytest.mark.cluster
def test_jax_trainer_gets_the_mesh_and_the_worker_ids(train_runs):
    assert json.loads((train_runs["dir"] / "outcome-jax.json").read_text()) == {"error": None}
    recs = _records(train_runs["dir"], "jax")
    assert sorted(r["process_index"] for r in recs) == list(range(SHARED_HOSTS))
    for r in recs:
        assert r["jax"] == [r["process_index"], 2] and r["process_index"] == r["tpu_worker_id"]
        assert r["mesh"] == [[2, 4], ["data", "model"]] and r["exact"]
        assert r["local"] == 4 and r["devices"] == 8


@pytest.mark.cluster
def test_the_recipe_trains_under_torch_trainer(train_runs):
    proc = train_runs["proc"]
    out = proc.stdout  # Ray Train 2.60 copies a worker's prints to stderr too
    assert re.search(r"host 0/2 \(TPU worker 0 of \S+\), mesh \{'data': 2, 'model': 4\}", out), out[-3000:]
    losses = [float(line.rsplit("loss ", 1)[1]) for line in out.splitlines() if " loss " in line and "step " in line]
    assert len(losses) == 4, out[-2000:]  # steps 0, 5, 10, 11 from the coordinator
    assert losses[-1] < losses[0] * 0.8
    assert "errors: None" in proc.stdout

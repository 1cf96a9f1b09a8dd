"""The per-host contract: `build_plan` -> `HostState` -> `host_env`, pure and golden.

The golden file holds the `--dry-run --json` document of seven plans (emulated and real, one and
two slices, torch_xla, JAX, exec, a restart). It is the document the code before the typed contract
(environment strings rewritten by name) produced for the same plans, with one intended difference:
a user's `--env MASTER_PORT` now survives a restart (that code overwrote it on attempt 1 and later).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from tpulaunch.host import frameworks
from tpulaunch.plan import topology as T
from tpulaunch.plan.env import PLAN_MULTISLICE_ENV, host_env, split_env
from tpulaunch.plan.launch import build_plan
from tpulaunch.plan.contract import Endpoints
from tpulaunch.plan.mesh import plan_mesh
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint

GOLDEN = Path(__file__).parent / "golden" / "launch_plans.json"


def _real_slices(topo, n):
    return [SliceSpec(name=f"tpu-{s}", accelerator_type=topo.accelerator_type, topology=topo.topology, source="tpu-api",
                      zone="us-central2-b", project="p", state="READY", health="HEALTHY",
                      workers=tuple(WorkerEndpoint(w, f"10.0.{s}.{w + 2}") for w in range(topo.num_hosts)),
                      slice_index=s) for s in range(n)]


def golden_plans() -> dict:
    cases = {}
    t = T.resolve(topology="2x8")
    for fw in ("torch_xla", "jax"):
        cases[f"emulated-2x8-{fw}"] = build_plan(
            slices=[SliceSpec.emulated_from(t, "emulated")], mesh=plan_mesh(t), script="train.py", args=["--steps", "3"],
            framework=fw, user_env={"FOO": "bar"}, run_id="20261123-000000-abcd", coordinator_port=40001,
            group_port=40002, jax_coordinator_port=40003 if fw == "jax" else None, emulated=True,
            emulation_env=frameworks.get(fw).emulation_env(t, 1), emulation_port=40004, log_dir="/runs/x", workdir="/w",
            compile_cache="~/.cache/x")
    t4 = T.resolve(accelerator="v4-32")
    for fw in ("torch_xla", "jax"):
        cases[f"real-2xv4-32-{fw}"] = build_plan(
            slices=_real_slices(t4, 2), mesh=plan_mesh(t4, None, "data=2", 2), script="train.py", framework=fw,
            run_id="20261123-000000-abcd", coordinator_port=8476, group_port=8478,
            jax_coordinator_port=8477 if fw == "jax" else None, emulated=False, metadata_server=True, log_dir="/runs/y",
            workdir="/w")
    t = T.resolve(accelerator="v5p-16")
    p = build_plan(slices=[SliceSpec.emulated_from(t, f"e-{i}", i) for i in range(2)], mesh=plan_mesh(t, None, None, 2),
                   script="t.py", framework="jax", run_id="r1", coordinator_port=1, group_port=2, jax_coordinator_port=3,
                   emulated=True, emulation_env=frameworks.get("jax").emulation_env(t, 2), emulation_port=4, log_dir="/l",
                   workdir="/w", user_env={"MASTER_PORT": "999"})
    cases["emulated-2xv5p-16-jax"] = p
    cases["emulated-2xv5p-16-jax-attempt2"] = p.for_attempt(2, p.endpoints.moved(master_port=11, group_port=12,
                                                                                jax_port=13, emulation_port=14))
    t = T.resolve(topology="2x2")
    cases["emulated-2x2-exec"] = build_plan(
        slices=[SliceSpec.emulated_from(t, "one")], mesh=plan_mesh(t), script="", framework="torch_xla", run_id="r2",
        coordinator_port=5, emulated=True, emulation_env=frameworks.get("torch_xla").emulation_env(t, 1), log_dir="/l",
        workdir="/w", command=("hostname",), distributed=False)
    return cases


def test_every_hosts_environment_is_the_golden_one():
    got = {name: plan.to_dict() for name, plan in golden_plans().items()}
    if not GOLDEN.exists():  # first run: record (commit the file)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    for name in want:
        for h_got, h_want in zip(got[name]["hosts"], want[name]["hosts"]):
            assert h_got["env"] == h_want["env"], f"{name} host {h_want['process_index']}"
        assert json.loads(json.dumps(got[name])) == want[name], (
            f"{name} differs from {GOLDEN}; if the change is meant, delete the file and rerun to record it")


def test_a_restart_changes_fields_and_the_environment_follows():
    p = golden_plans()["emulated-2x8-jax"]
    again = p.for_attempt(1, p.endpoints.moved(master_port=5, group_port=6, jax_port=7, emulation_port=8))
    before, after = p.env(2), again.env(2)
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"TPULAUNCH_RESTART_COUNT", "TPULAUNCH_COORDINATOR_ADDRESS", "TPULAUNCH_GROUP_ADDRESS",
                       "MASTER_PORT", "JAX_COORDINATOR_ADDRESS", "TPULAUNCH_EMULATION_PORT"}
    assert after["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:7" and after["TPULAUNCH_RESTART_COUNT"] == "1"
    assert again.state(2).endpoints.jax_address == "127.0.0.1:7"  # what the JAX adapter reads


def test_what_changes_between_runs_is_exactly_the_per_run_part():
    """A spare started with the static part can take any run of the same slice and framework."""
    plans = golden_plans()
    a = plans["emulated-2x8-torch_xla"]
    from dataclasses import replace

    b = replace(a, job=replace(a.job, run_id="other"), endpoints=Endpoints("127.0.0.1", 1, 2, None, 3))
    for i in range(4):
        static_a, run_a = split_env(a.state(i))
        static_b, run_b = split_env(b.state(i))
        assert static_a == static_b and run_a != run_b
        assert not set(static_a) & set(run_a)
        assert host_env(a.state(i)) == {**static_a, **run_a}


def test_user_env_wins_over_everything_on_every_attempt():
    p = golden_plans()["emulated-2xv5p-16-jax"]
    assert p.env(0)["MASTER_PORT"] == "999"
    assert p.for_attempt(3, p.endpoints.moved(master_port=77)).env(0)["MASTER_PORT"] == "999"
    static, per_run = split_env(p.state(0))
    assert per_run["MASTER_PORT"] == "999" and "MASTER_PORT" not in static  # read by the script, not at import


def test_a_host_process_has_the_nodes_tpu_grid_and_the_plans_slices(monkeypatch):
    """What the agent starts a host process with (`host.environment.start_env`) on a GKE pod
    of a multislice job. The TPU grid is the node's (the device plugin sets it beside
    TPU_SKIP_MDS_QUERY, and libtpu then reads nothing else), not Ray's sub-host rewrite of it in the
    agent's own worker. The slices are the plan's: after a shrink to one slice, nothing says two."""
    from tpulaunch.host import environment

    node = {"TPU_SKIP_MDS_QUERY": "true", "TPU_HOST_BOUNDS": "1,1,4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
            "MEGASCALE_COORDINATOR_ADDRESS": "10.9.9.9", "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
            "MEGASCALE_PORT": "8080", "MEGASCALE_GRPC_ENABLE_XOR_TRACER": "false"}
    for k, v in {**node, "TPU_HOST_BOUNDS": "1,1,1", "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1", "TPU_VISIBLE_CHIPS": "0"}.items():
        monkeypatch.setenv(k, v)  # the agent's worker: Ray's sub-host values over the node's
    monkeypatch.setattr(environment, "_raylet_env", lambda: node)
    full = golden_plans()["real-2xv4-32-torch_xla"]
    for plan in (full, full.on_fleet([full.slices[0].name], {})):
        for h in plan.hosts:
            base, per_run = environment.start_env(plan.state(h.process_index))
            env = {**base, **per_run}
            assert (env["TPU_HOST_BOUNDS"], env["TPU_CHIPS_PER_HOST_BOUNDS"]) == ("1,1,4", "2,2,1")
            assert "TPU_VISIBLE_CHIPS" not in env and env["TPU_SKIP_MDS_QUERY"] == "true"
            assert env["MEGASCALE_GRPC_ENABLE_XOR_TRACER"] == "false"  # a setting of the node's own: kept
            got = {k: env.get(k) for k in PLAN_MULTISLICE_ENV}
            if len(plan.slices) == 1:
                assert got == dict.fromkeys(PLAN_MULTISLICE_ENV), got
            else:
                assert got["MEGASCALE_NUM_SLICES"] == "2" and got["MEGASCALE_SLICE_ID"] == str(h.slice_index)
                assert got["MEGASCALE_COORDINATOR_ADDRESS"] == plan.endpoints.host


def test_only_a_users_variables_read_at_import_keep_a_spare_from_taking_the_run():
    """A spare is started with the static part: a user's run name or checkpoint path changes from run
    to run and must not cost a warm start; XLA_FLAGS, JAX_*, PYTHONPATH must (the import reads them)."""
    from dataclasses import replace

    p = golden_plans()["emulated-2x8-torch_xla"]

    def parts(user_env: dict) -> tuple[dict, dict]:
        return split_env(replace(p, job=replace(p.job, user_env=user_env)).state(1))

    base_static, _ = parts({})
    static, per_run = parts({"RUN_NAME": "a", "CKPT_DIR": "/c/a", "WANDB_API_KEY": "k", "TPULAUNCH_METADATA_HOST": "h"})
    assert static == base_static
    assert {k: per_run[k] for k in ("RUN_NAME", "CKPT_DIR", "WANDB_API_KEY", "TPULAUNCH_METADATA_HOST")} == {
        "RUN_NAME": "a", "CKPT_DIR": "/c/a", "WANDB_API_KEY": "k", "TPULAUNCH_METADATA_HOST": "h"}
    for name in ("XLA_FLAGS", "JAX_LOG_COMPILES", "PYTHONPATH", "LD_PRELOAD", "PJRT_DEVICE", "TORCH_LOGS",
                 "OMP_NUM_THREADS", "LIBTPU_INIT_ARGS", "tpu_extra"):
        static, per_run = parts({name: "x"})
        assert name not in per_run and static[name].endswith("x"), name
        assert static != base_static, name


def test_a_users_xla_flags_join_the_emulations_on_an_emulated_jax_host():
    t = T.resolve(topology="2x8")
    jax_env = frameworks.get("jax").emulation_env(t, 1)

    def xla_flags(user_env: dict, emulated: bool = True) -> str | None:
        p = build_plan(slices=[SliceSpec.emulated_from(t, "e")], mesh=plan_mesh(t), script="t.py", framework="jax",
                       user_env=user_env, run_id="r", coordinator_port=1, jax_coordinator_port=2, emulated=emulated,
                       emulation_env=jax_env if emulated else None, log_dir="/l", workdir="/w")
        return p.env(0).get("XLA_FLAGS")

    # without them a user's --env XLA_FLAGS=--xla_dump_to=... left JAX one CPU device per host
    assert xla_flags({"XLA_FLAGS": "--xla_dump_to=/tmp/d"}) == jax_env["XLA_FLAGS"] + " --xla_dump_to=/tmp/d"
    assert xla_flags({}) == jax_env["XLA_FLAGS"]
    assert xla_flags({"XLA_FLAGS": "--xla_dump_to=/tmp/d"}, emulated=False) == "--xla_dump_to=/tmp/d"


@pytest.mark.parametrize("framework", ["jax", "torch_xla"])
def test_the_nodes_xla_flags_stay_under_an_emulated_hosts(monkeypatch, framework):
    """A shell's XLA_FLAGS (an opt level, a dump dir) reaches a host process as on the real host: the
    emulation's CPU device count (JAX's) goes after it, not instead of it. A user's --env XLA_FLAGS
    sets them, as on a real host (after the emulation's device count)."""
    from tpulaunch.host import environment

    t = T.resolve(topology="2x8")
    fw = frameworks.get(framework)
    monkeypatch.setattr(environment, "_raylet_env", lambda: {})
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")

    def flags(user_env: dict, emulated: bool = True) -> str | None:
        p = build_plan(slices=[SliceSpec.emulated_from(t, "e")], mesh=plan_mesh(t), script="t.py", framework=framework,
                       user_env=user_env, run_id="r", coordinator_port=1, jax_coordinator_port=2, emulated=emulated,
                       emulation_env=fw.emulation_env(t, 1) if emulated else None, log_dir="/l", workdir="/w")
        base, per_run = environment.start_env(p.state(0))
        return {**base, **per_run}.get("XLA_FLAGS")

    own = fw.emulation_env(t, 1).get("XLA_FLAGS")
    shell = "--xla_backend_optimization_level=0"
    assert flags({}) == (f"{shell} {own}" if own else shell)
    assert flags({"XLA_FLAGS": "--xla_dump_to=/d"}) == (f"{own} --xla_dump_to=/d" if own else "--xla_dump_to=/d")
    assert flags({"XLA_FLAGS": "--xla_dump_to=/d"}, emulated=False) == "--xla_dump_to=/d"  # the user's --env sets it


def test_endpoints_move_only_the_ports_a_plan_has():
    e = Endpoints("10.0.0.2", master_port=8476, group_port=8478)
    moved = e.moved(master_port=1, group_port=2, jax_port=3, emulation_port=4)
    assert (moved.master_port, moved.group_port, moved.jax_port, moved.emulation_port) == (1, 2, None, None)
    assert Endpoints("h", 5).group_address == "h:5"  # no group port: the store shares MASTER_PORT


def test_a_host_state_pickles_small_even_on_a_pod():
    """Each host gets its own pickled state: the mesh is a recipe, not a table, so it stays small."""
    t = T.resolve(accelerator="tpu7x-18432")
    plan = build_plan(slices=_real_slices(t, 1), mesh=plan_mesh(t), script="t.py", run_id="r", coordinator_port=1,
                      emulated=False, log_dir="/l", workdir="/w")
    blob = pickle.dumps(plan.state(1234))
    assert len(plan.hosts) == 2304 and pickle.loads(blob).process_index == 1234
    assert len(blob) < 64 * 1024, len(blob)  # the slice's 2,304 worker IPs dominate (TPU_WORKER_HOSTNAMES)


@pytest.mark.parametrize("bad", ["FOO", "=x", "1A=b", "A B=c"])
def test_env_flags_must_be_key_value(bad):
    from tpulaunch.errors import LaunchError
    from tpulaunch.plan.launch import parse_env

    with pytest.raises(LaunchError, match="is not KEY=VALUE"):
        parse_env([bad])


@pytest.mark.parametrize("node,emulation,user,want", [
    (None, None, None, None),
    ("-n", None, None, "-n"),  # a real host: the node's own
    ("-n", "-e", None, "-n -e"),  # an emulated host: the device count after the shell's flags
    ("-n", "-e", "-u", "-e -u"),  # the user's replace the node's, after the device count
    (None, None, "-u", "-u"),
    ("-n", None, "", ""),  # `--env XLA_FLAGS=` clears them, as on a real host
])
def test_xla_flags_from_the_node_the_emulation_and_the_user(node, emulation, user, want):
    from tpulaunch.plan.env import xla_flags

    assert xla_flags(node, emulation, user) == want


def test_a_ray_train_configs_xla_flags_take_the_emulations_place_under_the_nodes():
    """Ray Train's workers lay the plan's variables and their config's `env` over the node's
    (`ray_train.backends._boot_worker`): a `JaxSpmdConfig(env={"XLA_FLAGS": ...})` replaces the
    emulation's device count, and the node's own flags stay before it."""
    from tpulaunch.host.environment import layered

    t = T.resolve(topology="2x8")
    jax_env = frameworks.get("jax").emulation_env(t, 1)
    p = build_plan(slices=[SliceSpec.emulated_from(t, "e")], mesh=plan_mesh(t), script="t.py", framework="jax",
                   user_env={}, run_id="r", coordinator_port=1, jax_coordinator_port=2, emulated=True,
                   emulation_env=jax_env, log_dir="/l", workdir="/w")
    mine = "--xla_force_host_platform_device_count=2"
    env = layered({"XLA_FLAGS": "--node"}, {**host_env(p.state(0)), "XLA_FLAGS": mine}, p.state(0))
    assert env["XLA_FLAGS"] == f"--node {mine}"
    assert layered({}, {**host_env(p.state(0)), "XLA_FLAGS": mine}, p.state(0))["XLA_FLAGS"] == mine

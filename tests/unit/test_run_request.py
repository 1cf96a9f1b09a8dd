"""`tpulaunch run` / `exec` up to the plan, in this process: dry runs, bad input, refusals.

Nothing here starts Ray or a host: every request either prints its plan or is refused first.
"""

from __future__ import annotations

import json

import pytest

from fakes import invoke
from support import cli_env, write_scripts

SCRIPTS = {
    "allreduce.py": "import torch, torch.distributed as dist, torch_xla, tpulaunch\n",
    "args.py": "import sys, os, tpulaunch\n",
    "jax_checks.py": "import jax\n",
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return write_scripts(tmp_path_factory.mktemp("work"), SCRIPTS)


def test_dry_run_json_lists_every_host_env(workdir):
    proc = invoke("run", "allreduce.py", "--topology", "2x8", "--dry-run", "--json", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["emulated"] is True
    assert plan["framework"] == "torch_xla"
    assert plan["mesh"]["axis_names"] == ["data", "model"] and plan["mesh"]["shape"] == [4, 4]
    hosts = plan["hosts"]
    assert [h["process_index"] for h in hosts] == [0, 1, 2, 3]
    port = plan["coordinator_address"].rsplit(":", 1)[1]
    assert plan["coordinator_address"] == f"127.0.0.1:{port}"
    for i, h in enumerate(hosts):
        env = h["env"]
        assert h["worker_id"] == i and h["slice_index"] == 0
        assert env["TPU_WORKER_ID"] == str(i)
        assert env["TPULAUNCH_PROCESS_INDEX"] == str(i) and env["RANK"] == str(i)
        assert env["WORLD_SIZE"] == "4" and env["TPULAUNCH_NUM_PROCESSES"] == "4"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == port
        assert env["TPULAUNCH_COORDINATOR_ADDRESS"] == plan["coordinator_address"]
        assert env["TPU_WORKER_HOSTNAMES"] == "127.0.0.1,127.0.0.1,127.0.0.1,127.0.0.1"
        assert env["TPU_ACCELERATOR_TYPE"] == "v6e-16"
        assert env["TPU_TOPOLOGY"] == "2x8"
        assert env["TPU_HOST_BOUNDS"] == "1,4,1" and env["TPU_CHIPS_PER_HOST_BOUNDS"] == "2,2,1"
        assert env["TPU_SKIP_MDS_QUERY"] == "1"
        assert env["PJRT_DEVICE"] == "CPU" and env["CPU_NUM_DEVICES"] == "16"
        assert env["TPULAUNCH_EMULATED"] == "1"
        assert not any(k.startswith("MEGASCALE_") for k in env), "single slice must not get MEGASCALE_*"


def test_dry_run_multislice_megascale(workdir):
    proc = invoke("run", "allreduce.py", "--topology", "2x2x2", "--accelerator", "v4", "--num-slices", "2",
                   "--dry-run", "--json", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    hosts = plan["hosts"]
    assert [h["process_index"] for h in hosts] == [0, 1, 2, 3]
    assert [h["slice_index"] for h in hosts] == [0, 0, 1, 1]
    assert [h["env"]["MEGASCALE_SLICE_ID"] for h in hosts] == ["0", "0", "1", "1"]
    assert {h["env"]["MEGASCALE_NUM_SLICES"] for h in hosts} == {"2"}
    assert {h["env"]["MEGASCALE_COORDINATOR_ADDRESS"] for h in hosts} == {"127.0.0.1"}
    assert {h["env"]["MEGASCALE_PORT"] for h in hosts} == {"8081"}
    assert [h["env"]["TPU_WORKER_ID"] for h in hosts] == ["0", "1", "0", "1"]
    assert plan["mesh"]["dcn_shape"] == [2, 1] and plan["mesh"]["shape"] == [4, 4]


def test_dry_run_env_and_args(workdir):
    proc = invoke("run", "args.py", "--topology", "2x8", "--env", "MY_FLAG=on", "--dry-run", "--json",
                   "--", "--lr", "0.1", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["args"] == ["--lr", "0.1"]
    # a user's values are masked in what tpulaunch prints, unless asked for
    assert all(h["env"]["MY_FLAG"] == "<hidden: from --env; --show-env prints it>" for h in plan["hosts"])
    shown = invoke("run", "args.py", "--topology", "2x8", "--env", "MY_FLAG=on", "--dry-run", "--json", "--show-env",
                   cwd=workdir)
    assert all(h["env"]["MY_FLAG"] == "on" for h in json.loads(shown.stdout)["hosts"])
    text = invoke("run", "args.py", "--topology", "2x8", "--env", "MY_FLAG=on", "--dry-run", cwd=workdir)
    assert "MY_FLAG=<hidden" in text.stdout and "=on" not in text.stdout


def test_env_from_the_shell_and_from_a_file(workdir, tmp_path):
    f = tmp_path / "secrets.env"
    f.write_text("# a comment\nexport FROM_FILE='a b'\nBOTH=file\n\n")
    proc = invoke("run", "args.py", "--topology", "2x8", "--env-file", str(f), "--env", "FROM_SHELL", "--env",
                  "BOTH=flag", "--dry-run", "--json", "--show-env", cwd=workdir, env=cli_env(FROM_SHELL="s3cr3t"))
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)["hosts"][0]["env"]
    assert (env["FROM_FILE"], env["FROM_SHELL"], env["BOTH"]) == ("a b", "s3cr3t", "flag")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["missing.py", "--topology", "2x8"], "script missing.py not found"),
        (["allreduce.py", "--topology", "2x3"], "2x3 is not a valid v6e slice"),
        (["allreduce.py", "--topology", "2x8", "--env", "NOT_SET_HERE"], "--env NOT_SET_HERE takes its value from this"
                                                                            " environment, where NOT_SET_HERE is not set"),
        (["allreduce.py", "--topology", "2x8", "--env", "1BAD"], "--env '1BAD' is not KEY=VALUE or NAME"),
        (["allreduce.py", "--topology", "2x8", "--env-file", "/nonexistent.env"], "--env-file /nonexistent.env: No such"),
        (["allreduce.py", "--topology", "2x8", "--env-file", "/"], "--env-file / is not a regular file"),
        (["allreduce.py", "--topology", "2x8", "--mesh", "data=3,model=4"], "has 12 positions"),
        (["allreduce.py", "--topology", "2x8", "--framework", "tensorflow"], "unknown framework 'tensorflow'"),
    ],
)
def test_bad_input_is_one_line_exit_2(workdir, args, needle):
    proc = invoke("run", *args, "--dry-run", cwd=workdir)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_address_auto_without_cluster_fails_clearly(workdir, tmp_path, monkeypatch):
    from tpulaunch.cluster import connect

    # a VM's Ray that another test (run beside this tier) started under /tmp is not this machine's state
    monkeypatch.setattr(connect, "LOCAL_RAY_ROOT", tmp_path)
    env = cli_env(TPULAUNCH_HOME=str(tmp_path))
    proc = invoke("run", "allreduce.py", "--topology", "2x8", "--address", "auto", cwd=workdir, env=env)
    assert proc.returncode == 5
    assert "found no running cluster" in proc.stderr and "tpulaunch cluster up" in proc.stderr


def test_get_mesh_outside_a_launch_is_a_clear_error():
    import tpulaunch
    from tpulaunch.errors import LaunchError

    for ask in (tpulaunch.get_mesh, tpulaunch.context):
        with pytest.raises(LaunchError, match="not running under tpulaunch"):
            ask()


def test_oversized_working_directory_is_refused_before_anything_starts(workdir, tmp_path):
    big = tmp_path / "big"
    big.mkdir()
    (big / "allreduce.py").write_text((workdir / "allreduce.py").read_text())
    (big / "data.bin").write_bytes(b"\0" * (3 * 1024 * 1024))
    (big / ".git").mkdir()
    (big / ".git" / "pack").write_bytes(b"\0" * (8 * 1024 * 1024))  # excluded: does not count
    ok = invoke("run", "allreduce.py", "--topology", "2x8", "--max-upload-mb", "4", "--dry-run", cwd=big)
    assert ok.returncode == 0, ok.stderr
    proc = invoke("run", "allreduce.py", "--topology", "2x8", "--max-upload-mb", "2", cwd=big)
    assert proc.returncode == 2
    assert "is 3.0 MiB, over the 2 MiB limit" in proc.stderr and "--max-upload-mb" in proc.stderr
    assert "starting an emulated Ray cluster" not in proc.stderr


def test_dry_run_plans_the_jax_coordinator(workdir):
    proc = invoke("run", "jax_checks.py", "--topology", "2x8", "--dry-run", "--json", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["framework"] == "jax"
    addrs = {h["env"]["JAX_COORDINATOR_ADDRESS"] for h in plan["hosts"]}
    assert len(addrs) == 1 and addrs.pop().startswith("127.0.0.1:")
    for i, h in enumerate(plan["hosts"]):
        env = h["env"]
        assert env["JAX_PROCESS_ID"] == str(i) and env["JAX_NUM_PROCESSES"] == "4"
        assert env["JAX_PLATFORMS"] == "cpu"
        assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
        assert "CPU_NUM_DEVICES" not in env, "JAX hosts hold their own devices, not the whole slice"


def test_context_is_a_view_of_the_host_state_with_torch_names_too():
    import pickle

    from tpulaunch.host.context import RunContext
    from tpulaunch.plan.launch import build_plan
    from tpulaunch.plan.mesh import plan_mesh
    from tpulaunch.plan.slicespec import SliceSpec
    from tpulaunch.plan.topology import resolve

    topo = resolve("v6e-16")
    plan = build_plan(slices=[SliceSpec.emulated_from(topo, "s")], mesh=plan_mesh(topo), script="t.py", run_id="r",
                      coordinator_port=7, emulated=True, log_dir="/tmp/r", workdir="/w")
    ctx = RunContext(plan.for_attempt(2).state(2))
    assert (ctx.rank, ctx.world_size, ctx.process_index, ctx.num_processes, ctx.worker_id) == (2, 4, 2, 4, 2)
    assert (ctx.slice_name, ctx.accelerator_type, ctx.topology, ctx.restart_count) == ("s", "v6e-16", "4x4", 2)
    assert (ctx.coordinator_address, ctx.emulated, ctx.is_coordinator, ctx.log_dir) == ("127.0.0.1:7", True, False, "/tmp/r")
    assert pickle.loads(pickle.dumps(ctx)).process_index == 2
    with pytest.raises(AttributeError):
        ctx.process_index = 0


@pytest.mark.parametrize("args, needle", [
    (["--num-slices", "0"], "--num-slices 0 is not a number of slices"),
    (["--num-slices", "-1"], "--num-slices -1 is not a number of slices"),
    (["--schedule-timeout", "-5"], "--schedule-timeout -5 is not a positive number"),
    (["--schedule-timeout", "soon"], "Invalid value for '--schedule-timeout'"),
    (["--max-upload-mb", "0"], "--max-upload-mb 0 is not a positive number"),
    (["--no-such-flag"], "No such option: --no-such-flag"),
])
def test_bad_numbers_are_one_line_and_exit_2(workdir, args, needle):
    proc = invoke("run", "allreduce.py", "--topology", "2x8", "--dry-run", *args, cwd=workdir)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_recreate_on_an_emulated_slice_is_refused_before_anything_starts(workdir):
    proc = invoke("run", "args.py", "--topology", "2x8", "--recreate", "--max-preemptions", "1", "--dry-run",
                  cwd=workdir)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--recreate makes real slices again (Cloud TPU, GKE)" in " ".join(proc.stderr.split())

"""`tpulaunch run` end to end on emulated slices: real Ray, real torch_xla, real gloo.

Most tests share one warm emulated 2x8 cluster (`tpulaunch cluster up`), as users do with
`--address auto`. Tests about lifecycle (cold start, Ctrl-C) start and stop their own.
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

from conftest import REPO, cli_env, last_summary, processes_mentioning, run_cli, write_scripts

SCRIPTS = {
    "allreduce.py": """
        import torch, torch.distributed as dist, torch_xla, tpulaunch
        ctx = tpulaunch.context()
        mesh = tpulaunch.get_mesh()
        x = torch.tensor([ctx.process_index])
        dist.all_reduce(x)
        print(f"allreduce {x.item()} rank {dist.get_rank()} world {dist.get_world_size()} mesh {tuple(mesh.mesh_shape)} emulated {ctx.emulated}")
    """,
    "sleepy.py": """
        import time, tpulaunch
        print("ready", tpulaunch.context().process_index, flush=True)
        time.sleep(600)
    """,
    "args.py": """
        import sys, os, tpulaunch
        print("ARGV", sys.argv[1:], "ENV", os.environ.get("MY_FLAG"), "CWD_HAS_SCRIPT", os.path.exists("args.py"))
    """,
}


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("work"), SCRIPTS)


def test_dry_run_json_lists_every_host_env(workdir):
    proc = run_cli("run", "allreduce.py", "--topology", "2x8", "--dry-run", "--json", cwd=workdir)
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
    proc = run_cli("run", "allreduce.py", "--topology", "2x2x2", "--accelerator", "v4", "--num-slices", "2",
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
    proc = run_cli("run", "args.py", "--topology", "2x8", "--env", "MY_FLAG=on", "--dry-run", "--json",
                   "--", "--lr", "0.1", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["args"] == ["--lr", "0.1"]
    assert all(h["env"]["MY_FLAG"] == "on" for h in plan["hosts"])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["missing.py", "--topology", "2x8"], "script missing.py not found"),
        (["allreduce.py", "--topology", "2x3"], "2x3 is not a valid v6e slice"),
        (["allreduce.py", "--topology", "2x8", "--env", "NOEQUALS"], "--env 'NOEQUALS' is not KEY=VALUE"),
        (["allreduce.py", "--topology", "2x8", "--mesh", "data=3,model=4"], "has 12 positions"),
        (["allreduce.py", "--topology", "2x8", "--framework", "tensorflow"], "unknown framework 'tensorflow'"),
    ],
)
def test_bad_input_is_one_line_exit_2(workdir, args, needle):
    proc = run_cli("run", *args, "--dry-run", cwd=workdir)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_address_auto_without_cluster_fails_clearly(workdir, tmp_path):
    env = cli_env(TPULAUNCH_HOME=str(tmp_path))
    proc = run_cli("run", "allreduce.py", "--topology", "2x8", "--address", "auto", cwd=workdir, env=env)
    assert proc.returncode == 5
    assert "found no running cluster" in proc.stderr and "tpulaunch cluster up" in proc.stderr


def test_get_mesh_outside_a_launch_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-c", "import tpulaunch; tpulaunch.get_mesh()"],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "not running under tpulaunch" in proc.stderr


# -- on the shared warm cluster -----------------------------------------------------------------


def test_cluster_status_lists_the_slice(shared_cluster):
    proc = run_cli("cluster", "status", "--json", env=shared_cluster["env"])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["emulated"] is True
    (s,) = doc["slices"]
    assert s["name"] == "emulated" and s["pod_type"] == "v6e-16" and s["topology"] == "2x8"
    assert [h["worker_id"] for h in s["hosts"]] == [0, 1, 2, 3]
    assert all(h["alive"] and not h["busy"] for h in s["hosts"])


def test_allreduce_over_gloo_sums_process_indices(shared_cluster, workdir, tmp_path):
    proc = run_cli("run", "allreduce.py", "--topology", "2x8", "--address", "auto", "--log-dir", str(tmp_path),
                   cwd=workdir, env=shared_cluster["env"])
    assert proc.returncode == 0, proc.stderr + proc.stdout
    for i in range(4):
        assert f"[host {i}] allreduce 6 rank {i} world 4 mesh (4, 4) emulated True" in proc.stdout, proc.stdout
    assert "EMULATED slice" in proc.stderr
    summary = last_summary(tmp_path)
    assert summary["exit_code"] == 0 and [h["exit_code"] for h in summary["hosts"]] == [0, 0, 0, 0]
    for i in range(4):
        log = Path(summary["hosts"][i]["log"]).read_text()
        assert f"allreduce 6 rank {i} world 4" in log


def test_script_args_env_and_workdir_reach_hosts(shared_cluster, workdir, tmp_path):
    proc = run_cli("run", "args.py", "--topology", "2x8", "--address", "auto", "--env", "MY_FLAG=on",
                   "--hosts", "0", "--no-dist", "--log-dir", str(tmp_path), "--", "--lr", "0.1", "a b",
                   cwd=workdir, env=shared_cluster["env"])
    assert proc.returncode == 0, proc.stderr
    assert "[host 0] ARGV ['--lr', '0.1', 'a b'] ENV on CWD_HAS_SCRIPT True" in proc.stdout
    assert "[host 1]" not in proc.stdout, "--hosts 0 must hide other hosts on the terminal"
    summary = last_summary(tmp_path)
    assert "ARGV" in Path(summary["hosts"][3]["log"]).read_text(), "hidden hosts are still logged"


def test_recipe_transformer_loss_falls(shared_cluster, tmp_path):
    proc = run_cli("run", "recipes/transformer_2d.py", "--topology", "2x8", "--address", "auto",
                   "--log-dir", str(tmp_path), "--", "--steps", "12", cwd=REPO, env=shared_cluster["env"], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i in range(4):
        losses = [float(m) for m in re.findall(rf"\[host {i}\] host {i} step \d+ loss ([0-9.]+)", proc.stdout)]
        assert len(losses) >= 3, proc.stdout
        assert losses[-1] < losses[0] * 0.5, losses


# -- lifecycle: own cluster ---------------------------------------------------------------------


@pytest.mark.cluster
def test_sigint_stops_everything_and_exits_130(shared_cluster, workdir, tmp_path):
    """Ctrl-C during a run (test_faults covers it while a cluster starts, and SIGTERM)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpulaunch", "run", "sleepy.py", "--topology", "2x8", "--no-dist", "--address", "auto",
         "--log-dir", str(tmp_path / "runs")],
        cwd=workdir, env=shared_cluster["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    ready = 0
    deadline = time.monotonic() + 240
    assert proc.stdout is not None
    while ready < 4 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        ready += "ready" in line
    assert ready == 4, "hosts never got ready"
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    summary = last_summary(tmp_path / "runs")
    # no host process of the run is left
    assert processes_mentioning([f"TPULAUNCH_RUN_ID={summary['run_id']}", f"tpulaunch-run-{summary['run_id']}-"]) == []
    assert summary["interrupted"] == "SIGINT" and summary["exit_code"] == 130
    assert all("ready" in Path(h["log"]).read_text() for h in summary["hosts"])


def test_exec_runs_a_command_on_every_host(shared_cluster, tmp_path):
    proc = run_cli("exec", "--topology", "2x8", "--address", "auto", "--log-dir", str(tmp_path), "--",
                   sys.executable, "-c", "import os, socket; print('HOST', socket.gethostname(), os.environ['TPU_WORKER_ID'])",
                   cwd=tmp_path, env=shared_cluster["env"])
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if " HOST " in line]
    assert sorted(line.split()[:2] for line in lines) == [["[host", f"{i}]"] for i in range(4)], proc.stdout
    assert all(line.endswith(f" {line[6]}") for line in lines), lines  # worker id matches the host number


def test_exec_failure_gives_that_hosts_exit_code(shared_cluster, tmp_path):
    proc = run_cli("exec", "--topology", "2x8", "--address", "auto", "--log-dir", str(tmp_path), "--json", "--",
                   sys.executable, "-c", "import os, sys; sys.exit(4 if os.environ['TPU_WORKER_ID'] == '1' else 0)",
                   cwd=tmp_path, env=shared_cluster["env"])
    assert proc.returncode == 4, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["first_failure"]["process_index"] == 1


def test_emulated_multislice_trains(tmp_path):
    """Two emulated v4 2x2x2 slices (2 hosts each) gang-scheduled together; the MLP recipe trains."""
    env = cli_env(TPULAUNCH_HOME=str(tmp_path / "home"))
    proc = run_cli("run", "recipes/mlp_dp.py", "--topology", "2x2x2", "--accelerator", "v4", "--num-slices", "2",
                   "--log-dir", str(tmp_path / "runs"), "--json", "--", "--steps", "12", cwd=REPO, env=env, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert [(h["slice_index"], h["worker_id"]) for h in summary["hosts"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s["name"] for s in summary["slices"]] == ["emulated-0", "emulated-1"]
    assert summary["mesh"]["dcn_shape"] == [2, 1]
    for h in summary["hosts"]:
        log = Path(h["log"]).read_text()
        losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", log)]
        assert len(losses) >= 3 and losses[-1] < losses[0], (h["process_index"], losses)


def test_oversized_working_directory_is_refused_before_anything_starts(workdir, tmp_path):
    big = tmp_path / "big"
    big.mkdir()
    (big / "allreduce.py").write_text((workdir / "allreduce.py").read_text())
    (big / "data.bin").write_bytes(b"\0" * (3 * 1024 * 1024))
    (big / ".git").mkdir()
    (big / ".git" / "pack").write_bytes(b"\0" * (8 * 1024 * 1024))  # excluded: does not count
    ok = run_cli("run", "allreduce.py", "--topology", "2x8", "--max-upload-mb", "4", "--dry-run", cwd=big)
    assert ok.returncode == 0, ok.stderr
    proc = run_cli("run", "allreduce.py", "--topology", "2x8", "--max-upload-mb", "2", cwd=big)
    assert proc.returncode == 2
    assert "is 3.0 MiB, over the 2 MiB limit" in proc.stderr and "--max-upload-mb" in proc.stderr
    assert "starting an emulated Ray cluster" not in proc.stderr

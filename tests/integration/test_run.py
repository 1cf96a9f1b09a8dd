"""`tpulaunch run` end to end on emulated slices: real Ray, real torch_xla, real gloo.

Most tests share one warm emulated v5p-16 (`tpulaunch cluster up`), as users do with
`--address auto`. Tests about lifecycle (cold start, Ctrl-C) start and stop their own.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, SHARED, SHARED_HOSTS, last_summary, processes_mentioning, run_cli, write_scripts

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


# -- on the shared warm cluster -----------------------------------------------------------------


def test_cluster_status_lists_the_slice(shared_cluster):
    proc = run_cli("cluster", "status", "--json", env=shared_cluster["env"])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["emulated"] is True
    (s,) = doc["slices"]
    assert s["name"] == "emulated" and s["pod_type"] == "v5p-16" and s["topology"] == "2x2x2"
    assert [h["worker_id"] for h in s["hosts"]] == list(range(SHARED_HOSTS))
    assert all(h["alive"] and not h["busy"] for h in s["hosts"])


def test_allreduce_over_gloo_sums_process_indices(shared_cluster, workdir, tmp_path):
    proc = run_cli("run", "allreduce.py", *SHARED, "--address", "auto", "--log-dir", str(tmp_path),
                   cwd=workdir, env=shared_cluster["env"])
    assert proc.returncode == 0, proc.stderr + proc.stdout
    for i in range(SHARED_HOSTS):
        assert f"[host {i}] allreduce 1 rank {i} world 2 mesh (2, 4) emulated True" in proc.stdout, proc.stdout
    assert "EMULATED slice" in proc.stderr
    summary = last_summary(tmp_path)
    assert summary["exit_code"] == 0 and [h["exit_code"] for h in summary["hosts"]] == [0] * SHARED_HOSTS
    for i in range(SHARED_HOSTS):
        log = Path(summary["hosts"][i]["log"]).read_text()
        assert f"allreduce 1 rank {i} world 2" in log


def test_script_args_env_and_workdir_reach_hosts(shared_cluster, workdir, tmp_path):
    proc = run_cli("run", "args.py", *SHARED, "--address", "auto", "--env", "MY_FLAG=on",
                   "--hosts", "0", "--framework", "none", "--log-dir", str(tmp_path), "--", "--lr", "0.1", "a b",
                   cwd=workdir, env=shared_cluster["env"])
    assert proc.returncode == 0, proc.stderr
    assert "[host 0] ARGV ['--lr', '0.1', 'a b'] ENV on CWD_HAS_SCRIPT True" in proc.stdout
    assert "[host 1]" not in proc.stdout, "--hosts 0 must hide other hosts on the terminal"
    summary = last_summary(tmp_path)
    assert "ARGV" in Path(summary["hosts"][1]["log"]).read_text(), "hidden hosts are still logged"


def test_recipe_transformer_loss_falls(shared_cluster, tmp_path):
    proc = run_cli("run", "recipes/transformer_2d.py", *SHARED, "--address", "auto",
                   "--log-dir", str(tmp_path), "--", "--steps", "12", cwd=REPO, env=shared_cluster["env"], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i in range(SHARED_HOSTS):
        losses = [float(m) for m in re.findall(rf"\[host {i}\] host {i} step \d+ loss ([0-9.]+)", proc.stdout)]
        assert len(losses) >= 3, proc.stdout
        assert losses[-1] < losses[0] * 0.5, losses


def test_the_torch_tpu_fsdp2_recipe_trains_with_a_process_per_device(shared_cluster, tmp_path):
    """TorchTPU (`--framework torch_tpu`) on the same cluster: 2 hosts x 4 processes, real gloo and
    FSDP2 (test_torch_tpu runs it on two slices, in an environment without torch_xla)."""
    proc = run_cli("run", "recipes/torch_tpu_fsdp2.py", "--framework", "torch_tpu", *SHARED, "--address", "auto",
                   "--log-dir", str(tmp_path), "--", "--steps", "15", "--ckpt-dir", str(tmp_path / "ckpt"),
                   "--ckpt-every", "15", cwd=REPO, env=shared_cluster["env"], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh {'data': 2, 'model': 4} on 8 processes (4 per host), device cpu" in proc.stdout
    losses = [float(m) for m in re.findall(r"step \d+ loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], proc.stdout[-2000:]
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != "ckpt"]
    for host, ranks in ((0, range(4)), (1, range(4, 8))):  # a log per process, under its host
        assert sorted(p.name for p in (run / "attempt-0" / f"host-{host}").iterdir()) == [f"rank-{r}.log" for r in ranks]
    assert "step 14 loss" in (run / "attempt-0" / "host-0" / "rank-0.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["attempts"][0]["hosts"][0]["step"] == 14  # the processes' heartbeats reach their host's


# -- lifecycle: own cluster ---------------------------------------------------------------------


@pytest.mark.cluster
def test_sigint_stops_everything_and_exits_130(shared_cluster, workdir, tmp_path):
    """Ctrl-C during a run (test_faults covers it while a cluster starts, and SIGTERM)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpulaunch", "run", "sleepy.py", *SHARED, "--framework", "none", "--address", "auto",
         "--log-dir", str(tmp_path / "runs")],
        cwd=workdir, env=shared_cluster["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    ready = 0
    deadline = time.monotonic() + 240
    assert proc.stdout is not None
    while ready < SHARED_HOSTS and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        ready += "ready" in line
    assert ready == SHARED_HOSTS, "hosts never got ready"
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
    proc = run_cli("exec", *SHARED, "--address", "auto", "--log-dir", str(tmp_path), "--",
                   sys.executable, "-c", "import os, socket; print('HOST', socket.gethostname(), os.environ['TPU_WORKER_ID'])",
                   cwd=tmp_path, env=shared_cluster["env"])
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if " HOST " in line]
    assert sorted(line.split()[:2] for line in lines) == [["[host", f"{i}]"] for i in range(SHARED_HOSTS)], proc.stdout
    assert all(line.endswith(f" {line[6]}") for line in lines), lines  # worker id matches the host number


def test_exec_failure_gives_that_hosts_exit_code(shared_cluster, tmp_path):
    proc = run_cli("exec", *SHARED, "--address", "auto", "--log-dir", str(tmp_path), "--json", "--",
                   sys.executable, "-c", "import os, sys; sys.exit(4 if os.environ['TPU_WORKER_ID'] == '1' else 0)",
                   cwd=tmp_path, env=shared_cluster["env"])
    assert proc.returncode == 4, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["first_failure"]["process_index"] == 1


"""Warm hosts and kept clusters, end to end on an emulated v4 2x2x2 (2 hosts) of its own.

`tpulaunch run --keep-cluster` leaves the cluster it started up; the next `tpulaunch run` (no
--address) takes it, and every host's spare forks the run's host process. A run whose environment
differs from the spare's gets a fresh process and --debug says why; after it the spares carry its
environment, and they stay: the runs after it are all forks of the same spares (no import again).
The reaper stops the kept cluster once it is idle, never while a run longer than the idle time is
still using it.

The runs boot no framework (`--framework none`): spares are taken or not by the same rule whatever
they imported, and torch_xla spares (`cluster up --prewarm torch_xla`) serve every torch_xla test
on the shared cluster.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from support import cli_env, last_summary, live_processes, processes_mentioning, run_cli, write_scripts

HELLO = """
    import argparse
    import os
    import time

    import tpulaunch

    p = argparse.ArgumentParser()
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    ctx = tpulaunch.context()
    print(f"host {ctx.process_index} of {ctx.num_processes} worker {os.environ['TPU_WORKER_ID']}"
          f" extra {os.environ.get('EXTRA', '-')}", flush=True)
    time.sleep(args.sleep)
"""

# shorter than the first run (the reaper, checking every few seconds here, must wait for it), longer
# than the next run takes to start and take the cluster on a busy machine (the suite's other stream)
IDLE_S = 6


def _run(work, home, log, *flags: str, script_args: tuple[str, ...] = (), debug: bool = False):
    return run_cli(*(["--debug"] if debug else []), "run", "hello.py", "--topology", "2x2x2", "--accelerator", "v4",
                   "--framework", "none", "--log-dir", str(log), *flags, "--", *script_args, cwd=work,
                   env=cli_env(TPULAUNCH_HOME=str(home)), timeout=300)


def _spares(home) -> set[int]:
    """The spare processes of this test's cluster (they carry its TPULAUNCH_HOME, as all its processes do)."""
    mine = f"TPULAUNCH_HOME={home}\0".encode()
    return {pid for pid, p in live_processes().items()
            if b"tpulaunch.host.bootstrap\0--spare\0" in p["cmdline"] and mine in p["environ"]}


def _hosts_said(out: str) -> list[tuple[int, int, int, str]]:
    return sorted((int(a), int(b), int(c), d) for a, b, c, d in
                  re.findall(r"\] host (\d+) of (\d+) worker (\d+) extra (\S+)", out))


@pytest.mark.cluster
def test_kept_cluster_is_warm_for_the_next_run_and_reaped_once_idle(tmp_path):
    from tpulaunch.cluster.processes import dir_pids as cluster_pids

    work = write_scripts(tmp_path, {"hello.py": HELLO})
    home = tmp_path / "home"
    logs = tmp_path / "runs"

    # 1. starts its own cluster, keeps it; runs longer than the idle time (the reaper must wait)
    first = _run(work, home, logs / "1", "--keep-cluster", "--idle-timeout", str(IDLE_S),
                 script_args=("--sleep", str(IDLE_S + 2)))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "kept the emulated cluster" in first.stderr and "tpulaunch cluster down" in first.stderr
    assert "cluster_start_s" in last_summary(logs / "1")["timings"]
    record = json.loads((home / "cluster.json").read_text())
    temp_dir = record["temp_dir"]
    assert cluster_pids(temp_dir), "the kept cluster is not running"

    try:
        # 2. no --address: takes the kept cluster; every host's spare takes the run
        second = _run(work, home, logs / "2", debug=True)
        assert second.returncode == 0, second.stderr[-3000:]
        assert "running on the emulated cluster already up" in second.stderr
        summary = last_summary(logs / "2")
        assert "cluster_start_s" not in summary["timings"]
        assert summary["attempts"][0]["timings"]["prewarmed_hosts"] == 2
        assert _hosts_said(second.stdout) == [(0, 2, 0, "-"), (1, 2, 1, "-")]

        # 3. a variable of the run's own (read by the script, not by an import): still the spares
        third = _run(work, home, logs / "3", "--env", "EXTRA=1")
        assert third.returncode == 0, third.stderr[-3000:]
        assert last_summary(logs / "3")["attempts"][0]["timings"]["prewarmed_hosts"] == 2
        assert _hosts_said(third.stdout) == [(0, 2, 0, "1"), (1, 2, 1, "1")]

        # 4. a variable an import may read: fresh processes, and --debug says which one differed
        libtpu = "LIBTPU_INIT_ARGS=--xla_tpu_enable_latency_hiding_scheduler=true"
        fourth = _run(work, home, logs / "4", "--env", "EXTRA=2", "--env", libtpu, debug=True)
        assert fourth.returncode == 0, fourth.stderr[-3000:]
        assert last_summary(logs / "4")["attempts"][0]["timings"]["prewarmed_hosts"] == 0
        assert "started a fresh process: the environment differs from the spare's in LIBTPU_INIT_ARGS" in fourth.stderr
        assert _hosts_said(fourth.stdout) == [(0, 2, 0, "2"), (1, 2, 1, "2")]
        deadline = time.monotonic() + 120  # run 4's spares are let go and the new ones started as it ends
        while len(spares := _spares(home)) != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(spares) == 2, spares

        # 5. the same again: the spares left after run 4 carry it and fork this run's hosts (none
        # was replaced, nothing imported)
        fifth = _run(work, home, logs / "5", "--env", "EXTRA=3", "--env", libtpu, script_args=("--sleep", "0.1"))
        assert fifth.returncode == 0, fifth.stderr[-3000:]
        assert last_summary(logs / "5")["attempts"][0]["timings"]["prewarmed_hosts"] == 2
        assert _hosts_said(fifth.stdout) == [(0, 2, 0, "3"), (1, 2, 1, "3")]
        assert _spares(home) == spares

        # 6. idle now: the reaper stops the cluster and forgets it
        # (the spares too: they carry this test's TPULAUNCH_HOME, as does the reaper until it ends)
        deadline = time.monotonic() + IDLE_S + 40
        while processes_mentioning([temp_dir, str(home)]) and time.monotonic() < deadline:
            time.sleep(1.0)
        assert not cluster_pids(temp_dir), "the reaper left the idle cluster up"
        assert not processes_mentioning([temp_dir, str(home)])
        assert not (home / "cluster.json").exists()
    finally:
        run_cli("cluster", "down", env=cli_env(TPULAUNCH_HOME=str(home)), timeout=120)

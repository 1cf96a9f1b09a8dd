"""`tpulaunch run SCRIPT ... --rehearse`: every program the script compiles, compiled for the target TPU.

The rehearsal is a step of its own, in place of the emulated launch: one process on this machine
(`rehearse.child`) holds every device of the plan's slices as CPU devices and runs the script; each
XLA program it compiles is first compiled by libtpu for the target TPU, with the same mesh and
shardings, the plan's devices mapped to libtpu's by (slice, chip coordinates, core)
(`jax_compile`). What libtpu says of each program (HBM per device by use, collectives) is the
`Report`: a table, `--json`, and `rehearsal.json` in the run's directory. A program that would
not fit the chip's HBM, or that libtpu refuses, stops the script before the CPU compiles it
(exit 88, `ExitCode.REHEARSAL`).

libtpu is an extra (`tpulaunch[rehearse]`): nothing here imports it; the rehearsal process does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from tpulaunch.errors import LaunchError
from tpulaunch.plan.launch import LaunchPlan
from tpulaunch.rehearse.report import Report, read_programs
from tpulaunch.rehearse.target import DEVICE_KINDS, INSTALL_HINT, hbm_bytes_per_device, libtpu_env, topology_args

# Frameworks a rehearsal cannot compile for the TPU, and exactly why (measured, README "Rehearsal").
CANNOT = {
    "torch_xla": "torch_xla 2.9 compiles each graph inside its C++ runtime at a sync (torch_xla.sync(), mark_step,"
                 " .item(), print), with no Python step before the CPU compile where the graph could be compiled for"
                 " the TPU first (its HLO, shardings included, does compile with libtpu)",
    "torch_tpu": "TorchTPU 0.2 compiles on the TPU device it runs on, and its emulation runs plain torch on the CPU:"
                 " no XLA program exists on this machine to compile for the target",
    "none": "--framework none boots no framework, so there is no XLA program to compile",
}

FILES = ("rehearsal.json", "rehearsal.log", "rehearsal-programs.jsonl")
# XLA's CPU client runs a program over at most 2048 devices of one process: over 2049 it says "Multiprocess
# computations aren't implemented on the CPU backend" (measured with JAX 0.10.2: 2048 runs, 2049 does not).
MAX_CPU_DEVICES = 2048


def libtpu_version() -> str | None:
    """libtpu's version, read from its metadata (never imported here); None when not installed."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return "unknown"


def check(plan: LaunchPlan, version: str | None) -> str:
    """What a rehearsal needs, checked before anything starts (`version`: libtpu's, None when it
    is not installed); libtpu's version."""
    fw = plan.framework
    if plan.job.command:
        raise LaunchError("--rehearse runs a script (`tpulaunch run`), not a command", "drop --rehearse")
    if fw in CANNOT:
        raise LaunchError(f"--rehearse cannot rehearse {fw}: {CANNOT[fw]}", "run without --rehearse")
    if plan.mesh.num_devices > MAX_CPU_DEVICES:
        raise LaunchError(f"--rehearse holds the slice's {plan.mesh.num_devices} devices in one process as CPU devices,"
                          f" and XLA's CPU client runs a program over at most {MAX_CPU_DEVICES} (beyond, it says"
                          " multiprocess computations are not implemented on the CPU backend)",
                          f"rehearse a slice of at most {MAX_CPU_DEVICES} devices")
    if plan.topology.generation.hbm_gib <= 0:
        raise LaunchError(f"--rehearse has no HBM figure for {plan.topology.generation.name}", "report it")
    if version is None:
        raise LaunchError("--rehearse needs libtpu, which is not installed", INSTALL_HINT)
    return version


def child_env(plan: LaunchPlan) -> dict[str, str]:
    """The rehearsal process's environment: this one, the run's --env, one CPU device per planned
    device (JAX on CPU only: libtpu compiles, it never runs), and libtpu's quiet offline settings."""
    env = {**os.environ, **plan.job.user_env}
    count = f"--xla_force_host_platform_device_count={plan.mesh.num_devices}"  # last: it wins over any other
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {count}".strip()
    env.update({"JAX_PLATFORMS": "cpu", "PJRT_DEVICE": "CPU", "PYTHONUNBUFFERED": "1"})
    env.update(libtpu_env(plan.topology))
    env.setdefault("TPU_LOG_DIR", "disabled")  # libtpu writes /tmp/tpu_logs otherwise
    return env


def rehearse(plan: LaunchPlan, line: Callable[[str], None]) -> Report:
    """Run the script once in the rehearsal process; `line` gets each line it prints. The report is
    saved as `rehearsal.json` in the run's directory (its output as `rehearsal.log`)."""
    version = check(plan, libtpu_version())
    from tpulaunch.rehearse import child

    run_dir = Path(plan.job.log_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    records, log_path, job_path = (run_dir / FILES[2], run_dir / FILES[1], run_dir / "rehearsal-job.pkl")
    topo, gen = plan.topology, plan.topology.generation
    hbm = hbm_bytes_per_device(gen)
    with open(job_path, "wb") as f:
        pickle.dump(child.Job(plan.state(0), topology_args(topo, plan.mesh.num_slices), str(records), hbm), f)
    report = Report(topo.accelerator_type, topo.topology, plan.mesh.num_slices, plan.mesh.num_devices,
                    DEVICE_KINDS[gen.name], hbm, version, log=str(log_path))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tpulaunch.rehearse.child", str(job_path)], cwd=plan.job.workdir,
                            env=child_env(plan), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="backslashreplace")
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            assert proc.stdout is not None
            for text in proc.stdout:
                log.write(text)
                line(text.rstrip("\n"))
        _, status, usage = os.wait4(proc.pid, 0)  # its rusage too: the CPU side's peak memory
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        report.peak_rss_bytes = usage.ru_maxrss * 1024
    except BaseException:  # Ctrl-C, SIGTERM: the rehearsal process goes with the launcher
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    finally:
        job_path.unlink(missing_ok=True)
    report.wall_s = time.monotonic() - t0
    report.programs, report.stopped = read_programs(str(records))
    report.exit_code = rc if rc >= 0 else 128 - rc
    if not report.stopped:  # the script's own code (88 too, when no program stopped it)
        report.script_exit = report.exit_code
    with open(run_dir / FILES[0], "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=1)
    return report

"""The rehearsal process: `python -m tpulaunch.rehearse.child JOB.pkl`.

One process stands in for every host of the slice: it holds all of the plan's devices as CPU
devices (the launcher sets `--xla_force_host_platform_device_count` to the slice's count and
`JAX_PLATFORMS=cpu`), so every program the script compiles is the whole slice's SPMD program.
`tpulaunch.context()` answers as host 0 of the plan does and `tpulaunch.get_mesh()` is the plan's
mesh over those devices; JAX itself sees one process (`jax.process_count() == 1`) holding every
device, so input fed per process is the whole global batch here.

Each program is compiled for the target TPU first (`jax_compile`), recorded as one JSON line,
and only then compiled and run on the CPU; a program that would fail on the TPU ends the process
with exit 88 before that. The exit code is otherwise the script's.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import runpy
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpulaunch.plan.contract import HostState

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from tpulaunch.rehearse.report import Program


@dataclass(frozen=True)
class Job:
    """What the launcher hands the rehearsal process."""

    state: HostState  # host 0's contract: what `tpulaunch.context()` answers
    topology_args: dict  # get_topology_desc's arguments for the target (`target.topology_args`)
    programs_path: str  # one JSON line per program, appended as they come
    hbm_bytes: int  # per device


def _mesh(state: HostState) -> Mesh:
    """The plan's mesh over this process's CPU devices: CPU device `i` is plan device `i`."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from tpulaunch.errors import MeshMismatchError

    plan = state.mesh
    devices = sorted(jax.devices(), key=lambda d: d.id)
    if len(devices) != plan.num_devices:
        raise MeshMismatchError(f"the rehearsal process has {len(devices)} CPU devices, the plan {plan.num_devices}",
                                "XLA_FLAGS in --env must not set --xla_force_host_platform_device_count")
    grid = np.array([devices[i] for i in plan.device_ids()], dtype=object).reshape(plan.shape)
    return Mesh(grid, plan.axis_names)


def main(argv: list[str]) -> int:
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    with open(argv[0], "rb") as f:
        job: Job = pickle.load(f)
    from tpulaunch.errors import TpulaunchError
    from tpulaunch.host import context as ctx_mod
    from tpulaunch.host.bootstrap import exit_code_of
    from tpulaunch.rehearse import jax_compile
    from tpulaunch.rehearse.report import verdict

    records = open(job.programs_path, "a", encoding="utf-8")  # open for the process's life: no `with`
    try:
        import jax

        target = jax_compile.TpuTarget(job.state.mesh, job.topology_args)
        ctx_mod._install(ctx_mod.RunContext(job.state), _mesh(job.state))
    except TpulaunchError as e:
        print(f"tpulaunch: rehearsal: {e.line()}", file=sys.stderr)
        return 86
    except Exception:  # libtpu or JAX could not start: say what
        print("tpulaunch: rehearsal: could not describe the target TPU or build the mesh", file=sys.stderr)
        traceback.print_exc()
        return 86

    def record(program: Program) -> str | None:
        stop = verdict(program, job.hbm_bytes, target.device_kind)
        records.write(json.dumps({"program": program.to_dict(), "stop": stop}) + "\n")
        records.flush()
        return stop

    jax_compile.install(target, record)
    # As on a launched host, the script's own `jax.distributed.initialize()` finds the processes joined:
    # here there is one, holding every device
    jax.distributed.initialize = lambda *args, **kwargs: None
    jax.distributed.shutdown = lambda *args, **kwargs: None
    script = os.path.abspath(job.state.job.script)
    sys.argv = [script, *job.state.job.args]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = exit_code_of(e.code)
    except BaseException:  # the script's traceback, as a host shows it
        traceback.print_exc()
        code = 1
    records.close()
    return code


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)  # as a host does: no interpreter teardown (PJRT threads can hang in it)

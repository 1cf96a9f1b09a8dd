"""The process that trains, on one host: `python -m tpulaunch.host.bootstrap STATE.pkl`.

The host agent starts it with the host's environment already applied. It unpickles the
HostState, boots the framework (SPMD mode first, then the mesh from the plan, then the gloo
process group), installs `tpulaunch.context()` / `get_mesh()`, and runs the user's script as
`__main__` with its own argv. The exit code is the script's.
"""

from __future__ import annotations

import os
import pickle
import runpy
import sys
import traceback

from tpulaunch.host import context as ctx_mod
from tpulaunch.host import frameworks
from tpulaunch.errors import ExitCode, TpulaunchError
from tpulaunch.host.agent import PY_STDIO_ENV
from tpulaunch.plan.launch import HostState

EXIT_BOOT_FAILED = ExitCode.BOOT_FAILED  # the host could not start the framework or build the mesh


def _context(state: HostState) -> ctx_mod.RunContext:
    return ctx_mod.RunContext(
        run_id=state.run_id,
        process_index=state.process_index,
        num_processes=state.num_processes,
        worker_id=state.worker_id,
        slice_index=state.slice_index,
        num_slices=state.num_slices,
        slice_name=state.slice_name,
        accelerator_type=state.accelerator_type,
        topology=state.topology,
        coordinator_address=state.coordinator_address,
        framework=state.framework,
        emulated=state.emulated,
        log_dir=state.log_dir,
        mesh_plan=state.mesh,
        restart_count=state.restart_count,
    )


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _own_stdio() -> None:
    """Python's prints get pipes of their own, in whole lines; fds 1 and 2 stay for native code.

    Native libraries (gloo, XLA, absl) write to fds 1/2 in pieces; sharing a pipe with them, a
    printed line could be split by one of their messages. The agent passes two extra pipes
    (`TPULAUNCH_PY_STDIO_FDS`) and reads all four; without them, stdio is only line-buffered.
    """
    fds = os.environ.pop(PY_STDIO_ENV, "")
    if fds:
        out_fd, err_fd = (int(f) for f in fds.split(","))
        sys.stdout = open(out_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=True)
        sys.stderr = open(err_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=True)
        sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # type: ignore[misc]
    else:
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=False)


def main(argv: list[str]) -> int:
    _own_stdio()
    with open(argv[0], "rb") as f:
        state: HostState = pickle.load(f)
    fw = frameworks.get(state.framework)
    try:
        fw.boot(state)
        mesh = fw.build_mesh(state.mesh, state)
    except TpulaunchError as e:
        print(f"tpulaunch: host {state.process_index}: {e.line()}", file=sys.stderr)
        return EXIT_BOOT_FAILED
    except Exception:  # noqa: BLE001 - report and fail this host
        print(f"tpulaunch: host {state.process_index}: framework boot failed", file=sys.stderr)
        traceback.print_exc()
        return EXIT_BOOT_FAILED
    ctx_mod._install(_context(state), mesh)
    ctx_mod.heartbeat()  # booted: a sign of life for --stall-timeout before the script prints
    script = os.path.abspath(state.script)
    sys.argv = [script, *state.args]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # noqa: BLE001 - the user's traceback goes to the host log
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if code == 0:
            # A clean leave can be a barrier with the other hosts (jax.distributed.shutdown);
            # a failed host must leave at once so the launch fails fast.
            fw.shutdown()
    return code


if __name__ == "__main__":
    # os._exit: skip interpreter teardown, where PJRT/gloo threads can hang after a clean run.
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)

"""The process that trains, on one host: `python -m tpulaunch.host.bootstrap STATE.pkl`.

The host agent starts it with the host's environment already applied (or a warm host's spare,
`--spare FRAMEWORK`, forks it: `host/spare.py`). It unpickles the
HostState, boots the framework (SPMD mode first, then the mesh from the plan, then the gloo
process group), installs `tpulaunch.context()` / `get_mesh()`, and runs the user's script as
`__main__` with its own argv. The exit code is the script's.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import pickle
import runpy
import sys
import threading
import time
import traceback

_T0 = time.time()  # this interpreter's start, near enough: taken before tpulaunch's imports below

from tpulaunch import settings  # noqa: E402 - after _T0: boot()'s "started_s" counts these imports
from tpulaunch.errors import ExitCode, TpulaunchError  # noqa: E402 - after _T0
from tpulaunch.host import context as ctx_mod  # noqa: E402 - after _T0
from tpulaunch.host import frameworks, leave  # noqa: E402 - after _T0
from tpulaunch.host.context import PY_STDIO_ENV, TIMINGS_ENV  # noqa: E402 - after _T0
from tpulaunch.plan.contract import HostState  # noqa: E402 - after _T0

_SPARE = [False]  # this process was forked by a spare, its framework imported before the run
_MARKER: list[int] = []  # the fd of the run's heartbeat file, held open (see _hold_run_marker)

EXIT_BOOT_FAILED = ExitCode.BOOT_FAILED  # the host could not start the framework or build the mesh


def exit_code_of(code: object) -> int:
    """A `SystemExit`'s code as a process exit code, as Python itself does it: None is 0, a
    number itself, anything else printed to stderr and 1."""
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
        sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # type: ignore[misc]  # Final to typeshed, on purpose
    else:
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):  # the interpreter's own (not a replacement)
                stream.reconfigure(line_buffering=True, write_through=False)


def _hold_run_marker() -> None:
    """Keep the run's heartbeat file open for life: /proc/<pid>/fd names the run this process serves."""
    path = os.environ.get(ctx_mod.HEARTBEAT_ENV)
    if path:
        try:
            _MARKER.append(os.open(path, os.O_RDONLY))
        except OSError:
            pass


def _record_phases(phases: dict[str, float]) -> None:
    """How long this host took to import, boot and build the mesh (the run's summary shows it)."""
    path = os.environ.get(TIMINGS_ENV)
    if path:
        try:
            with open(path, "w") as f:
                json.dump(phases, f)
        except OSError:
            pass


def boot(state: HostState, local_rank: int | None = None) -> dict[str, float]:
    """Import and boot the framework, build the mesh, install `context()`/`get_mesh()`.

    What every host process does before user code, under `tpulaunch run` and in a Ray Train
    worker alike. Raises what the adapter raises; returns how long each phase took.
    """
    from tpulaunch.plan.env import LIBTPU_OURS_ENV, libtpu_args

    merged = libtpu_args(os.environ.pop(LIBTPU_OURS_ENV, None), os.environ.get("LIBTPU_INIT_ARGS"))
    if merged:  # before the framework brings libtpu up: tpulaunch's hang flags, then the host's own
        os.environ["LIBTPU_INIT_ARGS"] = merged
    fw = frameworks.get(state.framework)
    t0 = time.time()
    fw.preload()
    t1 = time.time()
    fw.boot(state)
    t2 = time.time()
    mesh = fw.build_mesh(state.mesh, state)
    ctx_mod._install(ctx_mod.RunContext(state, local_rank), mesh)
    return {"started_s": t0 - _T0, "import_s": t1 - t0, "boot_s": t2 - t1, "mesh_s": time.time() - t2}


def main(argv: list[str]) -> int:
    _own_stdio()
    _hold_run_marker()
    with open(argv[0], "rb") as f:
        state: HostState = pickle.load(f)
    local_rank = int(argv[2]) if argv[1:2] == ["--rank"] else None
    if frameworks.facts(state.framework).per_device and local_rank is None:
        from tpulaunch.host import ranks  # this host's process starts one process per device

        return ranks.run(state, argv[0], _rank_main)
    fw = frameworks.get(state.framework)
    try:
        phases = boot(state, local_rank)
        started = phases.pop("started_s")
        if not _SPARE[0]:  # a spare imported before its run came: the run paid nothing of it
            phases["import_s"] += started
        _record_phases({**phases, "spare": float(_SPARE[0])})
    except TpulaunchError as e:
        print(f"tpulaunch: host {state.process_index}{_of_rank(local_rank)}: {e.line()}", file=sys.stderr)
        return EXIT_BOOT_FAILED
    except Exception:  # report and fail this host
        print(f"tpulaunch: host {state.process_index}{_of_rank(local_rank)}: framework boot failed", file=sys.stderr)
        traceback.print_exc()
        return EXIT_BOOT_FAILED
    ctx_mod.heartbeat()  # booted: a sign of life for --stall-timeout before the script prints
    script = os.path.abspath(state.job.script)
    sys.argv = [script, *state.job.args]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = exit_code_of(e.code)
    except BaseException:  # the user's traceback goes to the host log
        traceback.print_exc()
        code = 1
    finally:
        _flush()
        _exit_steps(code, fw, state.process_index, local_rank)
        if code == 0:
            # A clean leave can be a barrier with the other hosts (jax.distributed.shutdown, or
            # host/leave.py's for torch_xla); a failed host must leave at once so the launch fails fast.
            fw.shutdown()
            leave.in_order(state)
    return code


def _exit_steps(code: int, fw: frameworks.Framework, host: int, local_rank: int | None) -> None:
    """What `python script.py` does on its way out before the interpreter's teardown (which this
    process skips: `os._exit` below): wait for the script's non-daemon threads, then run its
    atexit handlers (wandb, TensorBoard writers and async checkpointers finish there), in
    Python's order. A failed host gives them TPULAUNCH_EXIT_HANDLERS_TIMEOUT and then leaves anyway,
    so that the launch fails fast (and its framework's own barriers with the other hosts, such as
    JAX's, are let go first); after a clean script they take as long as they take, as they
    would on a plain host (`--stall-timeout` or `--timeout` bound a host that never ends)."""
    if code != 0:
        name = "TPULAUNCH_EXIT_HANDLERS_TIMEOUT"
        bound = settings.host_seconds(name)

        def leave_anyway() -> None:
            print(f"tpulaunch: host {host}{_of_rank(local_rank)}: the script's exit handlers and threads were"
                  f" still running {bound:g} s after it failed ({name}); leaving", file=sys.stderr)
            _flush()
            os._exit(code)

        timer = threading.Timer(bound, leave_anyway)
        timer.daemon = True
        timer.start()
        let_go = getattr(fw, "leaving_after_failure", None)
        if let_go is not None:
            let_go()
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # Python's own first exit step
    except Exception:  # as Python's exit does: say so and go on
        traceback.print_exc()
    atexit._run_exitfuncs()  # prints what a handler raises, as at a plain exit


def _rank_main(argv: list[str]) -> int:
    """What one device's process (forked by `ranks.run`) runs: `main`, then its output flushed."""
    code = main(argv)
    _flush()
    return code


def _of_rank(local_rank: int | None) -> str:
    return "" if local_rank is None else f" local rank {local_rank}"


def _flush() -> None:
    """Flush what the script left open: a script may close its stdout (or have it closed under it)
    and still end well; its exit code is its own, never a flush's complaint."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (ValueError, OSError):  # closed, or the reader gone
            pass


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--spare"]:
        from tpulaunch.host import spare

        forked = spare.serve(argv[1])  # in the spare: None when it is let go; in a host it forked: a run's
        if forked is None:
            os._exit(0)
        argv = forked
        _SPARE[0] = True
    # os._exit: skip interpreter teardown, where PJRT/gloo threads can hang after a clean run (what a
    # plain exit does before it, the script's threads and atexit handlers, `main` has done).
    rc = main(argv)
    _flush()
    os._exit(rc)

"""The `tpulaunch` command. Thin: each command parses, calls the library, renders.

Errors: library code raises `TpulaunchError` subclasses; `main()` prints their one line on
stderr and exits with their documented code. Anything else is a bug: exit 70 with a one-line
message, and the traceback only with `--debug` (or `TPULAUNCH_DEBUG=1`).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, TypeAlias

import typer

from tpulaunch.errors import ExitCode, TpulaunchError

if TYPE_CHECKING:
    import click
    from typer._click import exceptions as typer_click

    # What a usage error can be: click's, or the copy Typer vendors (another class, the same interface).
    ClickError: TypeAlias = click.ClickException | typer_click.ClickException

app = typer.Typer(
    name="tpulaunch",
    help=(
        "Launch SPMD training (torch_xla, JAX, TorchTPU) on every host of a Cloud TPU slice, through Ray.\n\n"
        "With no TPU in sight, slices are emulated on this machine (CPU devices, one Ray node per host)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_DEBUG = {"on": os.environ.get("TPULAUNCH_DEBUG", "") not in ("", "0")}


def debug_enabled() -> bool:
    return _DEBUG["on"]


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logs."),
) -> None:
    if debug:
        _DEBUG["on"] = True


# One module per command (or command group), in the order `tpulaunch --help` lists them.
COMMAND_MODULES = {
    "topology": "cmd_topology", "mesh": "cmd_mesh", "run": "cmd_run", "exec": "cmd_exec",
    "runs": "cmd_runs", "status": "cmd_runs", "logs": "cmd_runs", "stop": "cmd_runs", "wait": "cmd_runs",
    "slice": "cmd_slice", "cluster": "cmd_cluster", "supervise": "cmd_run",
    "goodput": "cmd_goodput", "trace": "cmd_goodput",
}


def _register(argv: list[str]) -> None:
    """Import the command the user typed, or every command (for `--help` and unknown names).

    Importing only the one that runs keeps `tpulaunch topology` from loading the launch machinery.
    """
    import importlib

    first = next((a for a in argv if not a.startswith("-")), None)
    wanted = [COMMAND_MODULES[first]] if first in COMMAND_MODULES else list(dict.fromkeys(COMMAND_MODULES.values()))
    for name in wanted:
        importlib.import_module(f"tpulaunch.cli.{name}")


def _click_exception_types() -> tuple[tuple[type[ClickError], ...], tuple[type[BaseException], ...]]:
    """Typer >= 0.29 vendors its own click (`typer._click`); accept both copies."""
    import click

    usage: list[type[ClickError]] = [click.exceptions.ClickException]
    abort: list[type[BaseException]] = [click.exceptions.Abort]
    try:
        from typer._click import exceptions as vendored

        usage.append(vendored.ClickException)
        if hasattr(vendored, "Abort"):
            abort.append(vendored.Abort)
    except ImportError:
        pass
    return tuple(usage), tuple(abort)


def invoke(argv: list[str]) -> int:
    """Run one `tpulaunch` command line in this process; returns its exit code (never raises for
    a user's mistake: one line on stderr instead). `main()` and the in-process tests both use it."""
    from tpulaunch.cli.output import Output

    _register(argv)
    _DEBUG["on"] = os.environ.get("TPULAUNCH_DEBUG", "") not in ("", "0") or "--debug" in argv
    try:
        from tpulaunch import settings

        settings.check_environment()
        rc = app(args=argv, prog_name="tpulaunch", standalone_mode=False)
    except TpulaunchError as e:
        if debug_enabled():
            import traceback

            traceback.print_exc()
        Output().error(e.line())
        return e.exit_code
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        Output().error("interrupted")
        return ExitCode.INTERRUPTED
    except Exception as e:  # the last-resort handler
        click_exc, abort_exc = _click_exception_types()
        if isinstance(e, click_exc):
            # One line, like every other bad input: what was wrong, and where the help is.
            ctx = getattr(e, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            Output().error(f"{e.format_message()}{where}")
            return e.exit_code
        if isinstance(e, abort_exc):
            return ExitCode.INTERRUPTED
        if debug_enabled():
            import traceback

            traceback.print_exc()
        Output().error(
            f"internal error: {type(e).__name__}: {e}. This is a tpulaunch bug; rerun with --debug"
            " for the traceback and report it"
        )
        return ExitCode.INTERNAL
    return rc if isinstance(rc, int) else 0


def main() -> None:
    """Console-script entry point."""
    os.umask(0o077)  # what tpulaunch and the processes it starts write is this user's alone
    _native_stderr_to_log(sys.argv[1:])
    _leave(invoke(sys.argv[1:]))


def _native_stderr_to_log(argv: list[str]) -> None:
    """What native code writes to fd 2 (Ray's C++ core: retries, warnings, also from its threads
    as the process exits) goes to `ray-driver.log` in the state dir; tpulaunch's own lines and
    Python's tracebacks go to the real stderr. A terminal or a CI log then shows tpulaunch's one
    line, not Ray's chatter. Off with --debug."""
    if "--debug" in argv or os.environ.get("TPULAUNCH_DEBUG", "") not in ("", "0"):
        return
    try:
        from tpulaunch.cluster.record import driver_log_path

        log = os.open(driver_log_path(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except Exception:  # a bad state dir is reported by the command itself
        return
    sys.stderr.flush()
    real = os.dup(2)
    os.dup2(log, 2)
    os.close(log)
    sys.stderr = os.fdopen(real, "w", buffering=1, encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                           errors="replace")


def _leave(code: int) -> None:
    """Exit; without Ray's exit hooks when Ray cannot be left cleanly (they would wait for a dead head)."""
    from tpulaunch.cluster import connect

    if "ray" in sys.modules and connect.abandoned():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

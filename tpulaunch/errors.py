"""Typed errors. The library raises these; the CLI turns each into one line and an exit code.

Exit codes are part of the public contract (README table). Keep them stable.
"""

from __future__ import annotations


class ExitCode:
    """Documented process exit codes of the `tpulaunch` command."""

    OK = 0
    USAGE = 2  # bad flag, bad topology, bad mesh (also what Typer uses for parse errors)
    DISCOVERY = 3  # slice could not be found or read (API, metadata server)
    NOT_READY = 4  # slice found but not READY / unhealthy
    CLUSTER = 5  # Ray could not be started, joined, or could not give us the slice in time
    STATE = 6  # tpulaunch's own state here cannot be used: a corrupt or foreign record, an exposed token
    INTERNAL = 70  # a bug in tpulaunch (EX_SOFTWARE)
    HOST_LOST = 75  # a host was lost (node or agent died) or preempted, beyond --max-preemptions (EX_TEMPFAIL)
    PREFLIGHT = 78  # the checks before any script (versions, ports, chips, ids) found a problem (EX_CONFIG)
    BOOT_FAILED = 86  # a host could not boot its framework or build the mesh
    TPU_BUSY = 87  # a leftover process holds a host's TPU
    REHEARSAL = 88  # `run --rehearse`: a program does not fit the target TPU's memory, or its compiler refuses it
    TIMEOUT = 124  # --timeout or --stall-timeout ran out (as timeout(1) exits)
    CANNOT_START = 127  # a host's command could not be started (not found, not executable: as a shell says)
    INTERRUPTED = 130  # SIGINT
    TERMINATED = 143  # SIGTERM


class TpulaunchError(Exception):
    """Base class: a problem the user can act on. `hint` says what to do next."""

    exit_code: int = ExitCode.USAGE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def line(self) -> str:
        """The one line shown to the user."""
        return f"{self.message}. {self.hint}" if self.hint else self.message


class TopologyError(TpulaunchError):
    """Unknown generation, malformed shape, or a shape that is no valid slice."""


class MeshError(TpulaunchError):
    """A mesh or sharding request that does not fit the slice."""


class LaunchError(TpulaunchError):
    """A launch request that cannot be planned (bad script, bad --env, ...)."""


class DiscoveryError(TpulaunchError):
    """The slice could not be found or described."""

    exit_code = ExitCode.DISCOVERY


class SliceNotReadyError(TpulaunchError):
    """The slice exists but is not in a state to run on."""

    exit_code = ExitCode.NOT_READY


class ClusterError(TpulaunchError):
    """Ray could not be started or joined, or could not schedule the slice."""

    exit_code = ExitCode.CLUSTER


class StateError(TpulaunchError):
    """tpulaunch's own files on this machine cannot be used as they are: a corrupt or foreign cluster
    record, a token file others can read, a state directory that is not one. Nothing is touched."""

    exit_code = ExitCode.STATE


class RehearsalError(TpulaunchError):
    """`run --rehearse`: a program of the script would fail on the target TPU (it does not fit the
    chip's HBM, or libtpu's compiler refuses it), found before the CPU ran it."""

    exit_code = ExitCode.REHEARSAL


class WaitTimeout(TpulaunchError):
    """`Run.wait(timeout=...)` ran out before the run ended (the CLI's `wait` exits 124)."""

    exit_code = ExitCode.TIMEOUT


class MeshMismatchError(MeshError):
    """The runtime's devices do not match the planned mesh (raised inside a host)."""


# -- discovery (tpulaunch/discover/) --------------------------------------------------------------


class CredentialsError(DiscoveryError):
    """No usable Google credentials (Application Default Credentials missing or rejected)."""


class ApiPermissionError(DiscoveryError):
    """The Cloud TPU API said 403: a missing IAM permission, or the API is not enabled."""


class CapacityError(DiscoveryError):
    """The Cloud TPU API would not create (or delete) a slice: quota, stockout, a bad request, a name taken."""


class NameTakenError(CapacityError):
    """The name is in use (409): asking again cannot help, unlike quota or stockout."""


class NodeNotFoundError(DiscoveryError):
    """The named TPU node (or queued resource) does not exist where we looked."""


class ApiUnreachableError(DiscoveryError):
    """The Cloud TPU API could not be reached, or did not answer in time."""


class MetadataError(DiscoveryError):
    """The GCE metadata server was unreachable or returned something we cannot read."""


class SliceMismatchError(TpulaunchError):
    """Flags (--topology / --accelerator) contradict the slice that was found (usage, exit 2)."""

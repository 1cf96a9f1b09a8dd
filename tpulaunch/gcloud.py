"""gcloud: the one module that runs the `gcloud` command (one module per external system).

* `config_get`: the active gcloud configuration (`gcloud config get-value KEY`), for project/zone
  defaults. Only used when a value is not given by flag or env, only when `gcloud` is on PATH,
  and bounded by a short timeout (gcloud itself takes ~1 s to start).
* `tpu_vm_ssh`: run a shell command on one worker of a TPU VM slice
  (`gcloud compute tpus tpu-vm ssh NAME --zone Z --project P --worker=N --command CMD`).

Shell safety: gcloud hands CMD to the remote login shell as one string, so every word that is
not a fixed fragment of ours is quoted with `shlex.quote` (`shell_words`, `env_assignments`).
Secrets never go into argv (visible in `ps` on both ends and in gcloud's logs): pass them as
`stdin`, which gcloud forwards to the remote command.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tpulaunch import settings
from tpulaunch.errors import ClusterError

GCLOUD_TIMEOUT_ENV = "TPULAUNCH_GCLOUD_TIMEOUT"
DEFAULT_TIMEOUT = 5.0
SSH_TIMEOUT = 300.0

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def config_get(key: str, timeout: float | None = None) -> str | None:
    """The value of `gcloud config get-value KEY`, or None (unset, no gcloud, error, too slow)."""
    exe = shutil.which("gcloud")
    if not exe:
        return None
    if timeout is None:
        timeout = settings.seconds(GCLOUD_TIMEOUT_ENV, DEFAULT_TIMEOUT)
    try:
        proc = subprocess.run(
            [exe, "config", "get-value", key],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    value = lines[-1] if lines else ""
    return value if value and value != "(unset)" else None


# -- building remote shell commands ------------------------------------------------------------


def shell_words(words: Sequence[str]) -> str:
    """argv -> one shell line where every word stays exactly one word (`shlex.quote` each)."""
    return " ".join(shlex.quote(str(w)) for w in words)


def env_assignments(env: Mapping[str, str]) -> str:
    """`K=V ...` prefix for a shell command; values quoted, names checked (they cannot be quoted)."""
    parts = []
    for k, v in env.items():
        if not _ENV_NAME.match(k):
            raise ValueError(f"not an environment variable name: {k!r}")
        parts.append(f"{k}={shlex.quote(str(v))}")
    return " ".join(parts)


# -- ssh -----------------------------------------------------------------------------------------


def _exe() -> str:
    exe = shutil.which("gcloud")
    if not exe:
        raise ClusterError("gcloud is not on PATH",
                           "install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install) and log in")
    return exe


def tpu_vm_ssh_argv(name: str, *, zone: str, project: str, worker: int, command: str) -> list[str]:
    """The exact argv of `gcloud compute tpus tpu-vm ssh` for one worker (no shell involved locally)."""
    if name.startswith("-"):  # would be read as a flag by gcloud
        raise ClusterError(f"not a TPU name: {name!r}", "TPU names start with a letter")
    return [_exe(), "compute", "tpus", "tpu-vm", "ssh", name, "--zone", zone, "--project", project,
            f"--worker={int(worker)}", "--command", command]


@dataclass(frozen=True)
class SshResult:
    """What `gcloud compute tpus tpu-vm ssh` gave, read here (the one module that reads gcloud's words)."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def vm_gone(self) -> bool:
        """The TPU VM is gone: deleted or never made (gcloud's NOT_FOUND), or still listed in a state it
        never leaves, PREEMPTED or TERMINATED (gcloud refuses it before any ssh: `This TPU has terminal
        state "PREEMPTED", so it cannot be used anymore.`, `tpu_vm/exceptions.py`)."""
        return self.returncode != 0 and ("NOT_FOUND" in self.stderr or "This TPU has terminal state" in self.stderr)


def tpu_vm_ssh(
    name: str, *, zone: str, project: str, worker: int, command: str, stdin: str | None = None,
    timeout: float = SSH_TIMEOUT,
) -> SshResult:
    """Run `command` (a shell line built with `shell_words`) on one worker; stdin is forwarded.

    Returns what it gave (stdout/stderr as text); raises ClusterError only when gcloud cannot be
    run at all or takes longer than `timeout`.
    """
    argv = tpu_vm_ssh_argv(name, zone=zone, project=project, worker=worker, command=command)
    try:
        proc = subprocess.run(argv, input=stdin if stdin is not None else "", capture_output=True, text=True,
                              timeout=timeout, check=False)
        return SshResult(proc.returncode, proc.stdout, proc.stderr)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"gcloud ssh to {name} worker {worker} took longer than {timeout:g}s",
                           "check that the TPU VMs are reachable: gcloud compute tpus tpu-vm ssh "
                           f"{shlex.quote(name)} --zone {shlex.quote(zone)} --worker={worker}") from e
    except OSError as e:
        raise ClusterError(f"could not run gcloud: {e}", "check the Google Cloud CLI installation") from e

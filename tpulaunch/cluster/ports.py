"""Ports for processes this machine starts later (Ray nodes, coordinators), chosen so none is taken
before its owner binds it.

A port found free by `bind(0)` comes from the kernel's ephemeral range, the range every outgoing
TCP connection also takes its source port from. Between choosing such a port and binding it, any
connection on the machine (Ray's many gRPC clients, a test suite) can take it: "address already
in use" (seen: a gloo coordinator port, and raylets started in parallel). Ports below the
ephemeral range are never handed out that way, so a port free there now stays free until bound,
unless someone else asks for that very number, or this process itself does: a cold run chooses
its MASTER_PORT before it starts its cluster's nodes, 9 ports each (seen: a 16-host cluster took
the run's port, and the preflight refused the run). So a port handed out here is not handed out
again by this process.

Nor by another launcher of this user for a while: two launchers choosing at once (two runs, two
CI jobs, a test suite's streams) each find a port free that neither has bound yet, and the one
that binds second fails (an emulated cluster's raylet that cannot bind never registers: "The
current node timed out during startup"). With 36 ports per 4-node cluster drawn from about 22,000,
two clusters starting at once share one about once in 18. So each port handed out is claimed, a
file `<tmp>/tpulaunch-<uid>-ports/<port>` made with O_EXCL; a claim younger than CLAIM_TTL_S
(more than a cluster under load takes to bind what it chose) keeps the port from every other
launcher of this user, an older one is taken over. Claims are per user: a directory every user
could write to would let one keep the others from every port; a directory that is not this
user's own is not used (the choice is then by this process alone, as before).
"""

from __future__ import annotations

import os
import random
import socket
import stat
import tempfile
import time

# defined in worker_start, which runs on TPU VMs as its own source, without tpulaunch
from tpulaunch.cluster.worker_start import LOWEST_PORT as LOWEST
from tpulaunch.cluster.worker_start import ephemeral_low as _ephemeral_low
from tpulaunch.cluster.worker_start import port_is_free as _is_free

# Ports a host process binds at fixed numbers, never to hand out: torch_tpu's MASTER_PORT and its
# compiled-collective handshake (plan/torch_tpu.py; its 8070+ and 8080+ are below LOWEST)
_handed_out: set[int] = {29500, 36423}  # ports this process promised already (their owners may not have bound them yet)


CLAIM_TTL_S = 600.0


def _claims_dir() -> str | None:
    """This user's claims directory (made 0700), or None when that path is not a directory of its own."""
    path = os.path.join(tempfile.gettempdir(), f"tpulaunch-{os.getuid()}-ports")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return None
    return path


def _claim(claims: str | None, port: int) -> bool:
    """Claim `port` for this process: False if another launcher claimed it less than CLAIM_TTL_S ago."""
    if claims is None:
        return True
    path = os.path.join(claims, str(port))
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            return True
        except FileExistsError:
            try:
                if time.time() - os.stat(path).st_mtime < CLAIM_TTL_S:
                    return False
                os.unlink(path)  # a stale claim: its owner bound the port long ago, or never will
            except OSError:
                pass
        except OSError:
            return True  # claims cannot be written (a full disk): choose as before
    return False


def _unclaim(claims: str | None, port: int) -> None:
    if claims is not None:
        try:
            os.unlink(os.path.join(claims, str(port)))
        except OSError:
            pass


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now, not handed out before by this process nor claimed lately by
    another launcher of this user, outside the ephemeral range (falling back to bind(0))."""
    top = _ephemeral_low()
    out: list[int] = []
    if top - LOWEST > 10 * n:
        claims = _claims_dir()
        for port in random.sample(range(LOWEST, top), min(top - LOWEST, 50 * n)):
            if port in _handed_out or not _claim(claims, port):
                continue
            if not _is_free(port):
                _unclaim(claims, port)
                continue
            out.append(port)
            if len(out) == n:
                break
    socks = []
    try:
        while len(out) < n:
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
            if s.getsockname()[1] not in out and s.getsockname()[1] not in _handed_out:
                out.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    _handed_out.update(out)
    return out


def free_port() -> int:
    return free_ports(1)[0]

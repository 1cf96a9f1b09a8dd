"""The hosts of a multi-host torch_xla run leave in order after a clean end: process 0 last.

Why: torch_xla starts XLA's coordination service in process 0 (`CheckpointManager` does, for its
preemption sync, on a slice and in emulation alike) and never shuts it down: its client is leaked,
so no shutdown barrier runs at exit. Every other host's runtime polls that service; when process 0
is gone first, a host still on its way out aborts ("Terminating process because the JAX distributed
service detected fatal errors": SIGABRT, exit 134), and a run that trained well fails. JAX's own
`jax.distributed.shutdown()` is such a barrier; this is one for torch_xla.

How: process 0 listens on `Endpoints.exit_port`; every other host, once its script ended well,
connects, says which host of which attempt it is, hears that process 0 is the one it means, and
keeps the connection open until its process ends. Process 0 leaves once every other host's
connection has closed (the kernel closes it when that process is gone), so none is left polling.
A failed host never comes (the launcher stops the run instead); both sides give up after
`TPULAUNCH_DIST_TIMEOUT` and say so in the host log.
"""

from __future__ import annotations

import resource
import selectors
import socket
import sys
import time
from typing import TYPE_CHECKING

from tpulaunch import settings

if TYPE_CHECKING:
    from tpulaunch.plan.contract import HostState

_HELD: list[socket.socket] = []  # a host's connection, open until its process ends (os._exit)
_RETRY_S = (0.05, 1.0)  # first and longest pause between connects: quick at the usual end, in lockstep,
# and no flood of a pod's 1,535 hosts at process 0 while it does more work at its end than they did
_TIMEOUT = "TPULAUNCH_DIST_TIMEOUT"


def in_order(state: HostState) -> None:
    """Leave after every other host (process 0) or tell process 0 this host is leaving (the others)."""
    port = state.endpoints.exit_port
    if port is None or state.num_processes == 1:
        return
    timeout_s = settings.host_seconds(_TIMEOUT)
    token = f"tpulaunch-leave {state.run_id} {state.attempt}"
    if state.process_index == 0:
        _last(state.endpoints.host, port, token, state.num_processes - 1, timeout_s)
    else:
        _announce(state.endpoints.host, port, token, state.process_index, timeout_s)


def _last(host: str, port: int, token: str, others: int, timeout_s: float) -> None:
    """Process 0: listen where the others reach it (its own address on the slice; loopback on an
    emulated one: nothing of a run listens beyond where its hosts are), and return once every other
    host has said it is leaving and its connection has closed (or `timeout_s` passes)."""
    end = time.monotonic() + timeout_s
    _room_for(others + 64)  # a pod's process 0 holds a connection per other host (v5p-12288: 1,535)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(min(others, 4096))
    except OSError as e:  # the script ended well: that stays its outcome, in order or not
        listener.close()
        _say(f"host 0: cannot wait for the other hosts to leave first: port {port}: {e.strerror}")
        return
    sel = selectors.DefaultSelector()  # epoll: no FD_SETSIZE bound, as select() has
    sel.register(listener, selectors.EVENT_READ)
    said: dict[socket.socket, bytes] = {}  # connections that have not said who they are yet
    staying: dict[socket.socket, int] = {}  # host index, for each other host still alive
    gone: set[int] = set()

    def drop(s: socket.socket) -> None:
        sel.unregister(s)
        s.close()

    try:
        while len(gone) < others:
            left = end - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, others + 1)) - gone)
                _say(f"host 0: host(s) {_brief(missing)} had not left {timeout_s:g} s after this one ended"
                     f" ({_TIMEOUT}); leaving")
                return
            for key, _ in sel.select(left):
                s = key.fileobj
                assert isinstance(s, socket.socket)  # only sockets are registered
                if s is listener:
                    try:
                        conn, _ = listener.accept()
                    except OSError as e:  # out of descriptors: leave as before, unordered
                        _say(f"host 0: cannot wait for the other hosts to leave first: {e.strerror}")
                        return
                    said[conn] = b""
                    sel.register(conn, selectors.EVENT_READ)
                elif s in said:
                    data = _recv(s, 256)
                    said[s] += data
                    if not data or len(said[s]) > 200:
                        del said[s]
                        drop(s)  # not one of ours
                    elif said[s].endswith(b"\n"):
                        words = said.pop(s).decode(errors="replace").split()
                        if " ".join(words[:-1]) == token and words[-1].isdigit():
                            s.sendall(b"ok\n")
                            staying[s] = int(words[-1])
                        else:
                            drop(s)
                elif not _recv(s, 1):  # the kernel closed it: that host's process has ended
                    gone.add(staying.pop(s))
                    drop(s)
    finally:
        for s in (*said, *staying):
            s.close()
        sel.close()
        listener.close()


def _room_for(fds: int) -> None:
    """Raise this process's soft limit on open files towards its hard one, if it is below `fds`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < fds:
        try:
            want = fds if hard == resource.RLIM_INFINITY else min(fds, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass  # accept() says so if it runs out


def _brief(hosts: list[int]) -> str:
    return ", ".join(map(str, hosts[:8])) + (f" and {len(hosts) - 8} more" if len(hosts) > 8 else "")


def _say(line: str) -> None:
    print(f"tpulaunch: {line}", file=sys.stderr, flush=True)


def _recv(s: socket.socket, n: int) -> bytes:
    try:
        return s.recv(n)
    except OSError:  # reset: gone as well
        return b""


def _announce(host: str, port: int, token: str, index: int, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    pause, longest = _RETRY_S
    while time.monotonic() < end:
        s = None
        try:
            s = socket.create_connection((host, port), timeout=max(0.1, min(5.0, end - time.monotonic())))
            s.sendall(f"{token} {index}\n".encode())
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < 3 and (part := s.recv(3 - len(reply))):
                reply += part
            if reply == b"ok\n":
                _HELD.append(s)  # closed by the kernel when this process ends, which process 0 waits for
                return
            s.close()  # another listener on that port (a finished attempt's, or not ours)
        except OSError:  # process 0 is not leaving yet
            if s is not None:
                s.close()
        time.sleep(pause)
        pause = min(2 * pause, longest)
    _say(f"host {index}: host 0 was not leaving {timeout_s:g} s after this one ended ({_TIMEOUT}); leaving")

"""Find the Ray cluster a run asks for (`--address`), and connect to it.

The only module that calls `ray.init`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tpulaunch import settings
from tpulaunch.cluster.processes import dir_pids
from tpulaunch.cluster.record import (
    EMULATED_TOKEN,
    LOOPBACK_RAY,
    ClusterInfo,
    check_token_file,
    driver_log_path,
    load_record,
)
from tpulaunch.errors import ClusterError, TpulaunchError


def check_address(value: str, source: str) -> str:
    """`auto`, `HOST:PORT` or `ray://HOST:PORT`, else a usage error naming where it came from."""
    if value == "auto":
        return value
    host, sep, port = value.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in value):
        raise TpulaunchError(f"{source} '{value}' is not HOST:PORT",
                             "write it as 10.0.0.2:6379, ray://HOST:PORT or auto" + (
                                 " (or unset RAY_ADDRESS)" if source == "RAY_ADDRESS" else ""))
    return value


def resolve_address(address: str | None) -> ClusterInfo | None:
    """`--address`: None (nothing asked), `auto`, `HOST:PORT`, `ray://...`.

    With no `--address`, `RAY_ADDRESS` is used if set. `auto` means: `RAY_ADDRESS`, else the
    cluster `tpulaunch cluster up` left running. A malformed value is a usage error naming the
    flag or the variable it came from.
    """
    if address is not None and not address.strip():
        raise TpulaunchError("--address is empty",
                             "give auto, HOST:PORT or ray://HOST:PORT, or leave it out to emulate")
    env_address = os.environ.get("RAY_ADDRESS", "").strip() or None
    if address is None:
        if env_address is None:
            return None
        address = check_address(env_address, "RAY_ADDRESS")
    else:
        address = check_address(address.strip(), "--address")
    if address == "auto":
        if env_address:
            return on_gke_head(ClusterInfo(address=check_address(env_address, "RAY_ADDRESS"), temp_dir=None,
                                           token_path=os.environ.get("RAY_AUTH_TOKEN_PATH"), emulated=False))
        rec = load_record()
        if rec is not None and rec.running_here:
            return rec
        if rec is not None and not rec.temp_dir and not rec.emulated:
            return rec
        local = _local_ray_address()
        if local is not None:
            return local
        raise ClusterError("--address auto found no running cluster",
                           "start one with `tpulaunch cluster up --topology 2x8` or pass --address HOST:PORT")
    rec = load_record()
    if rec is not None and rec.address == address:
        return rec
    return on_gke_head(ClusterInfo(address=address, temp_dir=None, token_path=os.environ.get("RAY_AUTH_TOKEN_PATH"),
                                   emulated=False))


def on_gke_head(info: ClusterInfo) -> ClusterInfo:
    """A detached run's supervisor on a GKE head: its cluster's name and namespace, from the job's
    environment (`GKE_ENV`), so its provider reads the slices' pods through the in-cluster API."""
    import json

    from tpulaunch.cluster.record import GKE_ENV, GkeSpec

    raw = os.environ.get(GKE_ENV, "").strip()
    if not raw:
        return info
    try:
        doc = json.loads(raw)
        info.gke = GkeSpec(str(doc["name"]), str(doc["namespace"]), owned=False, group=str(doc.get("group", "tpu")))
    except (ValueError, KeyError, TypeError):
        raise TpulaunchError(f"{GKE_ENV} is not a cluster ({raw[:80]!r})",
                             "unset it; `tpulaunch run --detach` sets it") from None
    return info


LOCAL_RAY_ROOT = Path("/tmp")  # where `cluster join` keeps a VM's Ray temp dir (tpl-*)


def _local_ray_address() -> ClusterInfo | None:
    """On a TPU VM where Ray runs (e.g. after `tpulaunch cluster join`): the address Ray wrote."""
    # tpulaunch's (`cluster join`), not a plain `ray start`
    candidates = sorted(LOCAL_RAY_ROOT.glob("tpl-*/ray_current_cluster"))
    # Emulated clusters (they keep their token inside their temp dir) belong to whoever started them.
    live = [p for p in candidates
            if p.exists() and p.stat().st_uid == os.getuid()  # another user's Ray is not ours to pick
            and not (p.parent / EMULATED_TOKEN).exists() and dir_pids(str(p.parent))]
    if len(live) != 1:
        return None
    token = Path.home() / ".tpulaunch" / "ray_token"
    return ClusterInfo(address=live[0].read_text().strip(), temp_dir=None,
                       token_path=str(token) if token.exists() else os.environ.get("RAY_AUTH_TOKEN_PATH"),
                       emulated=False)


CONNECT_TIMEOUT_ENV = "TPULAUNCH_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT = 15.0
_HINT = "check --address, and that the cluster is up (`tpulaunch cluster status`)"
_ABANDONED: list[threading.Thread] = []  # ray.init calls that did not finish in time


def connect_timeout() -> float:
    return settings.seconds(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT)


def probe(address: str, timeout: float) -> None:
    """A TCP connect to the Ray head (GCS, or the Ray Client server for ray://) before ray.init.

    Ray retries a dead address for many minutes, inside calls no signal interrupts; a refused or
    silent port is known here in at most `timeout` seconds.
    """
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except ValueError:
        raise TpulaunchError(f"'{address}' is not HOST:PORT",
                             "write it as 10.0.0.2:6379, ray://HOST:PORT or auto") from None
    except OSError as e:
        if isinstance(e, (socket.timeout, TimeoutError)):
            why = f"no answer within {timeout:g} s"
        else:
            why = (e.strerror or type(e).__name__).lower()
        raise ClusterError(f"cannot reach Ray at {address}: {why}", _HINT) from None


def is_auth_error(e: BaseException) -> bool:
    """Ray's own word that the token was refused (its `AuthenticationError` and kin), read here."""
    return "Authentication" in type(e).__name__


def token_refused(info: ClusterInfo) -> ClusterError:
    """The one line for a cluster that refused our token (or our lack of one)."""
    which = f"the token in {info.token_path}" if info.token_path else "no token (RAY_AUTH_TOKEN_PATH is not set)"
    return ClusterError(f"the Ray cluster at {info.address} refused {which}: it is not this cluster's token",
                        "use the token the cluster was started with (`eval \"$(tpulaunch cluster env)\"` on its"
                        " machine shows where it is)")


def connect(info: ClusterInfo, runtime_env: dict | None = None, timeout: float | None = None) -> None:
    """`ray.init` against the cluster, quietly and bounded in time (`TPULAUNCH_CONNECT_TIMEOUT`, 15 s).

    Ray's own log forwarding is off (we stream). `runtime_env` (the working directory shipped to
    real hosts) is job-level: Ray uploads it once per run. ray.init runs on a helper thread, so
    this thread stays free to take SIGINT/SIGTERM and to give up at the deadline.
    """
    timeout = connect_timeout() if timeout is None else timeout
    if "ray" in sys.modules and info.token_path and os.environ.get("RAY_AUTH_TOKEN_PATH") != info.token_path:
        raise ClusterError("internal: Ray was imported before its auth token was set", "report this bug")
    deadline = time.monotonic() + timeout
    if info.token_path:
        check_token_file(info.token_path, "the cluster's token file")
    probe(info.address, min(timeout, 5.0))
    if "ray" in sys.modules and any(os.environ.get(k) != v for k, v in info.ray_env().items() if k in LOOPBACK_RAY):
        # Ray would rewrite the cluster's 127.0.0.1 to this machine's outward address, where it does not listen
        raise ClusterError("internal: Ray was imported before the loopback setting of a cluster at 127.0.0.1 was set",
                           "report this bug")
    for k, v in info.ray_env().items():
        os.environ[k] = v
    import ray

    _relay_to_file()
    outcome: dict[str, BaseException | None] = {}

    def init() -> None:
        try:
            ray.init(address=info.address, logging_level=logging.ERROR, log_to_driver=False,
                     configure_logging=True, runtime_env=runtime_env)
            outcome["error"] = None
        except BaseException as e:  # Ray raises many types for "cannot connect"
            outcome["error"] = e

    t = threading.Thread(target=init, name="tpulaunch-ray-init", daemon=True)
    with RaysStderr() as said:
        t.start()
        while t.is_alive() and time.monotonic() < deadline and not said.rejected():
            t.join(0.2)
            said.pump()
    if said.rejected():
        _ABANDONED.append(t)
        raise token_refused(info)
    if t.is_alive():
        _ABANDONED.append(t)
        raise ClusterError(f"Ray at {info.address} did not accept the connection within {timeout:g} s",
                           f"{_HINT}; {CONNECT_TIMEOUT_ENV} sets the limit")
    e = outcome.get("error")
    if e is not None:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ClusterError(f"cannot connect to Ray at {info.address}: {type(e).__name__}: {first}", _HINT) from e
    take_back_sigterm()


def take_back_sigterm() -> None:
    """SIGTERM goes back to the handler Python has on record (ours while a run is supervised, else
    the default), away from the one ray.init installs.

    Ray's core worker handles SIGTERM with absl's failure signal handler: it logs "*** SIGTERM
    received ***", calls the handler that was there before, and arms a 3 s alarm that aborts the
    process (absl's `alarm_on_failure_secs`, which Ray leaves at its default). A launcher or a
    detached run's supervisor that took longer than that to stop its hosts (a script saving its
    checkpoint in its grace) died by SIGABRT, without its summary. Ray keeps its handler for the
    signals of a crash (SIGSEGV, SIGABRT, ...). Only the main thread can set a handler: elsewhere
    (the Python client called from a thread) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    ours = signal.getsignal(signal.SIGTERM)
    if ours is not None:  # None: a handler not set from Python, which there is nothing to put back over
        signal.signal(signal.SIGTERM, ours)


class RaysStderr:
    """While Ray connects: what its C++ core writes to fd 2 passes through a pipe we read, so a
    refused token (`InvalidAuthToken`, which Ray retries for as long as it is let, a warning a
    second) ends the wait at once with a line that says so. What was read goes on to the real
    fd 2 if that is a file (a run's `ray.log`), else to `ray-driver.log` in the state dir: Ray's
    chatter never reaches a terminal or a CI log, where tpulaunch says one line."""

    REFUSED = b"InvalidAuthToken"

    def __enter__(self) -> RaysStderr:
        sys.stderr.flush()
        self.saved = os.dup(2)
        if not stat.S_ISREG(os.fstat(self.saved).st_mode):
            self.sink = os.open(driver_log_path(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        else:
            self.sink = os.dup(self.saved)
        self.r, w = os.pipe()
        os.dup2(w, 2)
        os.close(w)
        os.set_blocking(self.r, False)
        self.tail = b""
        self.refused = False
        return self

    def pump(self) -> None:
        while True:
            try:
                chunk = os.read(self.r, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            os.write(self.sink, chunk)
            self.refused = self.refused or self.REFUSED in self.tail + chunk
            self.tail = chunk[-len(self.REFUSED):]

    def rejected(self) -> bool:
        return self.refused

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)  # Ray's threads write to fd 2: from now on the real one again
        self.pump()
        for fd in (self.r, self.saved, self.sink):
            os.close(fd)


def logs_dir() -> str:
    """The Ray log directory of the session this process is connected to (on this node): where a
    detached run's supervisor, on the head, keeps the run's files for Ray's log API to serve."""
    import ray._private.worker as worker

    node = worker._global_node  # Ray has no public accessor for the session's log dir
    if node is None:
        raise ClusterError("internal: not connected to Ray", "report this bug")
    return node.get_logs_dir_path()


def abandoned() -> bool:
    """True when Ray cannot be left cleanly (a ray.init never returned): the process must not wait
    for Ray on its way out (`os._exit` after the last output)."""
    return any(t.is_alive() for t in _ABANDONED)


def disconnect(timeout: float = 10.0) -> None:
    """ray.shutdown(), bounded: a cluster whose head is gone must not hold the launcher."""
    import ray

    if abandoned() or not ray.is_initialized():
        return
    t = threading.Thread(target=ray.shutdown, name="tpulaunch-ray-shutdown", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        _ABANDONED.append(t)


@contextlib.contextmanager
def ray_output_to(path: Path, enabled: bool) -> Iterator[None]:
    """Ray's own output goes to `path`, not to the terminal (nor into a --json document).

    Everything written to fd 2 (Ray's C++ and Python logs: GCS retries, node deaths) lands in
    the file, and tpulaunch keeps writing to the terminal through a copy of the old stderr. The
    messages Ray's driver relays from raylets ("A worker died or was killed ...") are printed to
    `sys.stdout` by `ray._private.worker.print_to_stdstream`; that function is pointed at the
    file too while this is active (left alone if a Ray version lacks it).
    """
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    log = open(path, "ab", buffering=0)
    os.dup2(log.fileno(), 2)
    old = sys.stderr
    if _fileno(old) == 2:  # Python's stderr was fd 2: it keeps the terminal through a copy
        sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(saved), "wb", buffering=0), write_through=True,
                                      encoding=getattr(old, "encoding", None) or "utf-8", errors="replace")
    _RELAY["log"] = log
    _relay_to_file()  # now if Ray is imported, else when connect() imports it
    try:
        yield
    finally:
        ray_worker = sys.modules.get("ray._private.worker")
        if ray_worker is not None and _RELAY.get("original") is not None:
            ray_worker.print_to_stdstream = _RELAY["original"]  # type: ignore[attr-defined]  # Ray's, if imported
        _RELAY.clear()
        sys.stderr.flush()
        sys.stderr = old
        os.dup2(saved, 2)
        os.close(saved)
        log.close()


_RELAY: dict = {}


def _fileno(stream: object) -> int | None:
    try:
        return stream.fileno()  # type: ignore[attr-defined]  # any stream, or None: AttributeError
    except (AttributeError, OSError, ValueError):
        return None


def _relay_to_file() -> None:
    """Point Ray's `print_to_stdstream` (raylet messages to sys.stdout) at the active log file."""
    log = _RELAY.get("log")
    ray_worker = sys.modules.get("ray._private.worker")
    if log is None or ray_worker is None or "original" in _RELAY:
        return
    _RELAY["original"] = getattr(ray_worker, "print_to_stdstream", None)
    if _RELAY["original"] is None:
        return

    def to_file(data: dict, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", []):
            log.write(f"({data.get('pid', 'ray')}) {line}\n".encode("utf-8", "replace"))

    ray_worker.print_to_stdstream = to_file  # type: ignore[attr-defined]  # Ray's module, from sys.modules

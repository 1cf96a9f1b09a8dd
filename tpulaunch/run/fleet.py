"""The hosts of one attempt as the supervision loop sees them: the seam between it and Ray.

`Fleet` is what supervision needs of the hosts: start them, hear from them (`events`), stop them,
dump their stacks, release them. `RayFleet` does it with the host agents
(one Ray actor per TPU host); a simulated fleet (the scale harness) does it with fakes that answer
with the same typed replies, so the loop cannot tell the difference.

`RayFleet` keeps one long poll in flight per running host. Each poll's completion is queued by a
callback (`ObjectRef.future()`), so hearing from one of thousands of hosts costs no scan of the
others. A dead agent or node is known as that host's loss (`node lost`, `agent died`), never
mistaken for its peers'.

A host whose node dies with its agent (a preempted VM, a killed raylet) leaves its poll unanswered
until Ray's head declares the node dead, after its health checks (3 s x 5 by default; the suite's
1 s x 3). A poll overdue past its renewal therefore gets its node probed: a raylet that refuses
connections is gone, and so is the host, seconds before Ray says so. Only a refusal counts (the
machine is there and nothing listens): a timeout or an unreachable network proves nothing, and Ray's
own verdict still comes for those; and only from a raylet that accepted a connection when the
attempt started (a firewall that rejects, or another machine at that address, refuses from the
start). The probes of one call go out at once, within one timeout, and no name is looked up, so
the loop is held up at most PROBE_TIMEOUT_S. A reply that comes in meanwhile wins over the probe (it
says how the host ended). When the head (GCS) refuses too, the head is what was lost: the
supervision loop's own probe of the head says so (`head node lost`), not this one.
"""

from __future__ import annotations

import errno
import ipaddress
import queue
import re
import selectors
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from tpulaunch.host.protocol import HostOptions, PollReply, PreflightReport, PreflightRequest, Started
from tpulaunch.plan.contract import HostState
from tpulaunch.run.summary import Cause

LOST_AFTER_S = 30.0  # an agent that answers no poll for this long is lost
OVERDUE_S = 0.5  # a poll this late past its renewal gets its node probed (`overdue`)
PROBES_PER_CALL = 8  # at most this many probes per `events` call, the longest silent first
PROBE_TIMEOUT_S = 0.2  # for all of one call's probes together
LISTEN_TIMEOUT_S = 0.5  # for the raylets' first probe, when the attempt's hosts start
MAX_LINES = 5000  # per poll reply
FEW_HOSTS = 16


def cadence(hosts: int) -> tuple[float, float]:
    """(wait_s, batch_s) of each host's long poll for a run of `hosts` hosts.

    A quiet host's poll is renewed every `wait_s`; a chatty host's reply gathers what it prints
    for `batch_s` (its end still answers at once). Few hosts: every line at once, a renewal a
    second. Many: the driver's calls per second stay about constant (~250 quiet, ~500 chatty),
    whatever the number of hosts, at the price of lines reaching the terminal up to a few
    seconds late (never the logs' content, never the failure's notice)."""
    if hosts <= FEW_HOSTS:
        return 1.0, 0.0
    return min(10.0, max(1.0, hosts / 250)), min(5.0, hosts / 500)


@dataclass(frozen=True)
class Reply:
    host: int  # index into the attempt's hosts (= process index)
    reply: PollReply
    # when the reply arrived (time.time(), and time.monotonic() for the watch's own clock), not when
    # the loop got to it: the ages in it (a step's, a save's) count back from here, and a loop busy
    # with other hosts' lines would place them late
    at: float = field(default_factory=time.time)
    at_monotonic: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Gone:
    host: int
    cause: Cause
    why: str


Event = Reply | Gone


class Fleet(Protocol):
    def start(self, states: list[HostState], options: HostOptions, timeout_s: float) -> list[Started]:
        """Hand every host its state; returns when all answered (or raises on the timeout)."""

    def preflight(self, states: list[HostState], options: HostOptions, requests: list[PreflightRequest],
                  timeout_s: float) -> list[PreflightReport]:
        """Every host checked at once, before any script starts (`run.preflight`)."""

    def events(self, timeout_s: float) -> list[Event]:
        """What the hosts said since the last call, waiting up to `timeout_s` for the first word."""

    def stop(self, hosts: Iterable[int], grace_s: float) -> None:
        """SIGTERM these hosts' processes (SIGKILL after `grace_s`); does not wait: their ends
        (exit codes, last lines) arrive as events like any other."""

    def dump_stacks(self, hosts: Iterable[int], timeout_s: float) -> dict[int, str]:
        """py-spy dump of each host's process, without stopping it."""

    def release(self, prewarm: list[HostState] | None) -> None:
        """The attempt is over: each host forgets it; with `prewarm`, starts a spare for the next run."""


_NODE_DIED = re.compile(r"node was terminated unexpectedly: ([^\n]+)")


def why_agent_died(err: Exception) -> tuple[Cause, str]:
    """(cause, words) for Ray's error of an agent that died: its node's loss or its own. Pure."""
    if getattr(err, "preempted", False):
        return Cause.NODE_LOST, "node preempted"
    if "node has died" in str(err).lower():
        return Cause.NODE_LOST, "node lost"
    return Cause.AGENT_DIED, "agent died"


def overdue(silent_since: dict[int, float], polling: Iterable[int], now: float, wait_s: float,
            probed: dict[int, float], limit: int = PROBES_PER_CALL) -> list[int]:
    """The hosts whose node to probe now: a poll in flight unanswered for `wait_s` (its renewal)
    plus OVERDUE_S, not probed in the last second; the longest silent first, at most `limit`. Pure."""
    late = [i for i in polling if now - silent_since.get(i, now) > wait_s + OVERDUE_S
            and now - probed.get(i, float("-inf")) >= 1.0]
    return sorted(late, key=lambda i: silent_since[i])[:limit]


def node_death(err: Exception) -> str | None:
    """What the head recorded of the node's end, if Ray's error says ("Raylet could not connect to
    Runtime Env Agent"). Pure."""
    m = _NODE_DIED.search(str(err))
    return m.group(1).strip().rstrip(".") if m else None


class RayFleet:
    """A Fleet of host agents (Ray actor handles, in process-index order)."""

    def __init__(self, agents: list, raylets: list[str] | None = None, head: str = "") -> None:
        self.agents = agents
        self.raylets = raylets or [""] * len(agents)
        self.head = head  # the GCS address: a probe that finds it gone too leaves the verdict to the head's probe
        self.poll_wait_s, self.batch_s = cadence(len(agents))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: set[int] = set()
        self._done: set[int] = set()  # ended or gone: no more polls
        self._unanswered_since: dict[int, float] = {}
        self._probed: dict[int, float] = {}  # host -> when its node was last probed (`overdue`)
        self._gone: set[int] = set()  # declared lost by a probe: Ray's late word on them is dropped
        self._listening: set[int] = set()  # hosts whose raylet accepted a connection at the start: probed later

    def start(self, states: list[HostState], options: HostOptions, timeout_s: float) -> list[Started]:
        import ray

        refs = [a.start.remote(s, options) for a, s in zip(self.agents, states, strict=True)]
        started = ray.get(refs, timeout=timeout_s)
        self._listening = {i for i, ok in enumerate(probe(self.raylets, LISTEN_TIMEOUT_S)) if ok}
        now = time.monotonic()
        for i in range(len(self.agents)):
            self._unanswered_since[i] = now
            self._arm(i)
        return started

    def preflight(self, states: list[HostState], options: HostOptions, requests: list[PreflightRequest],
                  timeout_s: float) -> list[PreflightReport]:
        import ray

        refs = [a.preflight.remote(s, options, r) for a, s, r in zip(self.agents, states, requests, strict=True)]
        return ray.get(refs, timeout=timeout_s)

    def _arm(self, i: int) -> None:
        if i in self._in_flight or i in self._done:
            return
        self._in_flight.add(i)
        ref = self.agents[i].poll.remote(MAX_LINES, self.poll_wait_s, self.batch_s)
        ref.future().add_done_callback(lambda fut, i=i: self._queue.put((i, fut, time.time(), time.monotonic())))

    def events(self, timeout_s: float) -> list[Event]:
        import ray

        out: list[Event] = []
        items = self._drain(timeout_s)
        now = time.monotonic()
        lost = self._probe_overdue(now, answered={item[0] for item in items})
        if lost:  # a reply that came in meanwhile says how that host ended: it wins over the probe
            items += self._drain(0.0)
            lost -= {item[0] for item in items}
            self._done.update(lost)
            self._gone.update(lost)
        for i, fut, at, at_monotonic in items:
            self._in_flight.discard(i)
            if i in self._gone:
                continue
            try:
                reply: PollReply = fut.result()
            except ray.exceptions.ActorUnavailableError:
                if now - self._unanswered_since[i] > LOST_AFTER_S:
                    self._done.add(i)
                    out.append(Gone(i, Cause.UNREACHABLE, f"agent unreachable for {LOST_AFTER_S:.0f} s"))
                else:
                    self._arm(i)
                continue
            except ray.exceptions.RayActorError as e:
                self._done.add(i)
                cause, why = self._why_dead(i, e)
                out.append(Gone(i, cause, why))
                continue
            except Exception as e:  # anything else from the call: this host's, not its peers'
                self._done.add(i)
                first = str(e).splitlines()[0] if str(e) else ""
                out.append(Gone(i, Cause.AGENT_DIED, f"agent failed: {type(e).__name__}: {first}"))
                continue
            self._unanswered_since[i] = now
            if reply.code is not None:
                self._done.add(i)
            else:
                self._arm(i)
            out.append(Reply(i, reply, at, at_monotonic))
        return out + [Gone(i, Cause.NODE_LOST, "node lost") for i in sorted(lost)]

    def _drain(self, timeout_s: float) -> list:
        """The queued poll completions, waiting up to `timeout_s` for the first."""
        items = []
        try:
            items.append(self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait())
            while True:
                items.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return items

    def _probe_overdue(self, now: float, answered: Iterable[int] = ()) -> set[int]:
        """Hosts whose overdue poll's node refuses connections (not those that just `answered`): lost
        now, not when Ray says so."""
        polling = (self._in_flight - self._done - set(answered)) & self._listening
        due = overdue(self._unanswered_since, polling, now, self.poll_wait_s, self._probed)
        for i in due:
            self._probed[i] = now
        gone = {i for i, ok in zip(due, probe([self.raylets[i] for i in due]), strict=True) if ok is False}
        if not gone or (self.head and refused(self.head)):  # the head itself is gone: not these hosts' loss
            return set()
        return gone

    def _why_dead(self, i: int, err: Exception) -> tuple[Cause, str]:
        """`node lost` when the agent's Ray node is gone (its raylet no longer answers), else
        `agent died`. Ray's own error may not say yet: a killed raylet takes its workers with it
        before the head has marked the node dead."""
        cause, why = why_agent_died(err)
        if cause is Cause.AGENT_DIED and self.node_gone(i):
            return Cause.NODE_LOST, "node lost"
        return cause, why

    def node_gone(self, i: int) -> bool:
        """Host `i`'s Ray node no longer answers (its raylet refuses connections); False when unknown."""
        raylet = self.raylets[i]
        return bool(raylet) and not reachable(raylet)

    def stop(self, hosts: Iterable[int], grace_s: float) -> None:
        for i in hosts:
            self.agents[i].terminate.remote(grace_s)

    def dump_stacks(self, hosts: Iterable[int], timeout_s: float) -> dict[int, str]:
        import ray

        refs = {i: self.agents[i].dump_stacks.remote() for i in hosts}
        out = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref, timeout=timeout_s)
            except Exception as e:
                out[i] = f"(no dump: {e})"
        return out

    def release(self, prewarm: list[HostState] | None) -> None:
        import ray

        # not the agents of hosts a probe found gone: Ray answers for them only once its health
        # checks have declared their nodes dead (seconds to tens of seconds), and the attempt would wait
        refs = [a.release.remote(prewarm[i] if prewarm else None) for i, a in enumerate(self.agents)
                if i not in self._gone]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=15)
        except Exception:  # an agent lost with its node
            pass


def _host_port(address: str) -> tuple[str, int]:
    """(host, port) of `host:port` (a `ray://` prefix allowed); ValueError when the port is no number."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return host, int(port)


def _numeric(address: str) -> tuple[str, int] | None:
    """(IP, port) of `host:port` when the host is an IP address (IPv6 in brackets or not), else None."""
    try:
        host, port = _host_port(address)
        return str(ipaddress.ip_address(host.strip("[]"))), port
    except ValueError:
        return None


def probe(addresses: list[str], timeout: float = PROBE_TIMEOUT_S) -> list[bool | None]:
    """TCP connects to every `IP:port` at once, within one `timeout`: True where one was accepted,
    False where it was refused (the machine answers and nothing listens there), None where nothing
    was proved (a timeout, an unreachable network, a name: none is looked up, which no timeout bounds)."""
    out: list[bool | None] = [None] * len(addresses)
    if not addresses:  # the supervise loop's every pass with no poll overdue: no selector to make
        return out
    pending: dict[int, tuple[socket.socket, int]] = {}  # fd -> (its socket, its address's index)
    with selectors.DefaultSelector() as sel:
        try:
            for k, address in enumerate(addresses):
                target = _numeric(address)
                if target is None:
                    continue
                sock = socket.socket(socket.AF_INET6 if ":" in target[0] else socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                err = sock.connect_ex(target)
                if err in (errno.EINPROGRESS, errno.EAGAIN):
                    pending[sock.fileno()] = (sock, k)
                    sel.register(sock, selectors.EVENT_WRITE)
                else:
                    out[k] = _verdict(err)
                    sock.close()
            end = time.monotonic() + timeout
            while pending and (left := end - time.monotonic()) > 0:
                for key, _ in sel.select(left):
                    sock, k = pending.pop(key.fd)
                    out[k] = _verdict(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
                    sel.unregister(sock)
                    sock.close()
        finally:
            for sock, _ in pending.values():
                sock.close()
    return out


def _verdict(err: int) -> bool | None:
    return True if err == 0 else False if err == errno.ECONNREFUSED else None


def _connect(address: str, timeout: float) -> None:
    """A TCP connection to `host:port` (a `ray://` prefix allowed), opened and closed; raises why not."""
    socket.create_connection(_host_port(address), timeout=timeout).close()


def refused(address: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """A TCP connect to `host:port` is refused: the machine answers and nothing listens there.
    False when it connects, times out or fails otherwise (those prove nothing)."""
    try:
        _connect(address, timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return False


def reachable(address: str, timeout: float = 1.0) -> bool:
    """A TCP connect to `host:port` succeeds within `timeout`."""
    try:
        _connect(address, timeout)
    except (OSError, ValueError):
        return False
    return True

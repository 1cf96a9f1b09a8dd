"""torch_xla's hosts leave in order after a clean end, process 0 last (`host/leave.py`).

Each host here is a thread; a host's process ending is its held connection closed, as the kernel
closes it at `os._exit`. The run that needs it (host 1 polling XLA's coordination service in host 0,
which aborted it when host 0 ended first) is `test_script_idioms.py`'s minibatch/checkpoint test.
"""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from support import write_scripts
from tpulaunch.run.prepare import prepare
from tpulaunch import run
from tpulaunch.discover import SliceRequest
from tpulaunch.cluster.ports import free_port
from tpulaunch.host import leave
from tpulaunch.plan.contract import Endpoints
from tpulaunch.run.preflight import ports

pytestmark = pytest.mark.unit


def _state(index: int, hosts: int, port: int | None, attempt: int = 0):
    ends = Endpoints("127.0.0.1", master_port=1, exit_port=port)
    return SimpleNamespace(endpoints=ends, num_processes=hosts, process_index=index, run_id="r1", attempt=attempt)


def _leave(state, done: dict) -> threading.Thread:
    def go():
        leave.in_order(state)
        done[state.process_index] = time.monotonic()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _process_ends(held_before: int) -> None:
    """What the kernel does to a host's connection at os._exit (here: the threads share _HELD)."""
    leave._HELD.pop(held_before).close()


def _until(cond) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_process_0_leaves_only_once_every_other_hosts_process_has_ended(monkeypatch):
    monkeypatch.setattr(leave, "_HELD", [])
    monkeypatch.setattr(leave, "_RETRY_S", (0.02, 0.05))
    port, done = free_port(), {}
    _leave(_state(1, 3, port), done)  # host 1 ends first: it waits until process 0 is leaving too
    time.sleep(0.3)
    assert not done
    leader = _leave(_state(0, 3, port), done)
    _until(lambda: 1 in done)
    _leave(_state(2, 3, port), done)
    _until(lambda: 2 in done)
    assert len(leave._HELD) == 2 and 0 not in done  # both through, each connection held open
    _process_ends(0)  # host 1's process ends; host 2's is still on its way out
    leader.join(0.3)
    assert leader.is_alive(), "process 0 left while host 2 still polled its coordination service"
    _process_ends(0)
    leader.join(10)
    assert 0 in done


def test_process_0_of_a_pod_waits_for_more_hosts_than_select_can_watch(monkeypatch):
    """v5p-12288 has 1,536 hosts: process 0 holds a connection per other host, past select()'s 1,024."""
    others = 1100
    port, done = free_port(), {}
    leader = _leave(_state(0, others + 1, port), done)
    held = []
    for i in range(1, others + 1):
        for _ in range(100):  # until the leader listens
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except ConnectionRefusedError:
                time.sleep(0.02)
        s.sendall(f"tpulaunch-leave r1 0 {i}\n".encode())
        assert s.recv(3) == b"ok\n"
        held.append(s)
    assert max(s.fileno() for s in held) > 1024 and leader.is_alive()
    for s in held[:-1]:
        s.close()
    leader.join(0.3)
    assert leader.is_alive(), "process 0 left while one host was still leaving"
    held[-1].close()
    leader.join(10)
    assert 0 in done


def test_a_listener_of_another_run_or_attempt_is_not_taken_for_process_0(monkeypatch):
    monkeypatch.setattr(leave, "_HELD", [])
    monkeypatch.setattr(leave, "_RETRY_S", (0.02, 0.05))
    monkeypatch.setenv("TPULAUNCH_DIST_TIMEOUT", "1")
    port, done = free_port(), {}
    leader = _leave(_state(0, 2, port, attempt=0), done)  # attempt 0's process 0, still leaving
    host1 = _leave(_state(1, 2, port, attempt=1), done)   # attempt 1's host 1
    host1.join(5)
    leader.join(5)
    assert not leave._HELD  # host 1 heard no "ok": attempt 0's process 0 is not its own
    assert set(done) == {0, 1}  # each gave up after TPULAUNCH_DIST_TIMEOUT and left


def test_process_0_whose_exit_port_is_taken_says_so_and_leaves(capsys):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen(1)
        leave.in_order(_state(0, 2, taken.getsockname()[1]))
    assert "cannot wait for the other hosts to leave first: port" in capsys.readouterr().err


def test_one_host_or_no_exit_port_leaves_at_once():
    leave.in_order(_state(0, 1, free_port()))
    leave.in_order(_state(0, 2, None))
    leave.in_order(_state(1, 2, None))


def test_only_a_torch_xla_scripts_hosts_get_an_exit_port_and_preflight_checks_it(monkeypatch, tmp_path):
    write_scripts(tmp_path, {"t.py": "print(1)\n"})
    monkeypatch.chdir(tmp_path)

    def plan(framework: str, *command: str):
        req = run.LaunchRequest(script="" if command else "t.py", command=command, framework=framework,
                                slices=SliceRequest(topology="2x2x2", accelerator="v5p"), workdir=str(tmp_path))
        return prepare(req, run.Target(None), None, None).plan

    torch_xla = plan("torch_xla")
    e = torch_xla.endpoints
    assert e.exit_port and e.exit_port not in (e.master_port, e.group_port, e.emulation_port)
    assert (e.exit_port, "the hosts' ordered exit") in ports(torch_xla)
    assert plan("jax").endpoints.exit_port is None  # jax.distributed.shutdown() is JAX's own
    assert plan("torch_xla", "python", "t.py").endpoints.exit_port is None  # a command's exit is its own
    moved = e.moved(exit_port=5)
    assert moved.exit_port == 5 and Endpoints("h", 1).moved(exit_port=5).exit_port is None

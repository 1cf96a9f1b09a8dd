"""Hang triage (`run.hang`) over `py-spy dump` texts, and what the attempt watch does with a hang and
with a lost slice: pure, no processes."""

from __future__ import annotations

import pytest

from tpulaunch.host.protocol import PollReply
from tpulaunch.run.hang import COLLECTIVE, INPUT, PYTHON, UNKNOWN, HostRef, place_of, triage
from tpulaunch.run.summary import Cause, HostResult, Outcome
from tpulaunch.run.watch import AttemptWatch, StopAll, StopRules


def dump(*frames: str, thread: str = "MainThread") -> str:
    return f'Thread 0x7f01 (idle): "{thread}"\n' + "".join(f"    {f}\n" for f in frames)


ALL_REDUCE = dump("all_reduce (/venv/lib/torch/distributed/distributed_c10d.py:2942)",
                  "wrapper (/venv/lib/torch/distributed/c10d_logger.py:81)", "step (/w/train.py:30)",
                  "<module> (/w/train.py:40)")
LOAD = dump("load_batch (/w/train.py:23)", "step (/w/train.py:28)", "<module> (/w/train.py:40)")
DATALOADER = dump("wait (/usr/lib/python3.11/threading.py:331)", "get (/usr/lib/python3.11/queue.py:180)",
                  "_try_get_data (/venv/lib/torch/utils/data/dataloader.py:1133)",
                  "_next_data (/venv/lib/torch/utils/data/dataloader.py:1295)", "<module> (/w/train.py:40)")
XLA_STEP = dump("_xla_sync_multi (/venv/lib/torch_xla/core/xla_model.py:1000)", "mark_step (/venv/lib/torch_xla/core/xla_model.py:1050)",
                "<module> (/w/train.py:40)")
JAX_STEP = dump("block_until_ready (/venv/lib/jax/_src/array.py:600)", "train (/w/jt.py:90)")
EVAL = dump("sleep_a_while (/w/train.py:50)", "evaluate (/w/train.py:60)")


@pytest.mark.parametrize("text,kind,frame", [
    (ALL_REDUCE, COLLECTIVE, "all_reduce (distributed_c10d.py:2942)"),
    (XLA_STEP, COLLECTIVE, "_xla_sync_multi (xla_model.py:1000)"),
    (JAX_STEP, COLLECTIVE, "block_until_ready (array.py:600)"),
    (LOAD, INPUT, "load_batch (train.py:23)"),
    (DATALOADER, INPUT, "_try_get_data (dataloader.py:1133)"),  # the queue wait says nothing; its caller does
    (EVAL, PYTHON, "sleep_a_while (train.py:50)"),
    # a name that sounds like input counts only where the host is, not further out in its stack
    (dump("save_checkpoint (/w/train.py:70)", "on_batch_end (/w/train.py:80)", "<module> (/w/train.py:90)"), PYTHON,
     "save_checkpoint (train.py:70)"),
    ("(py-spy dump exited 1: Permission denied)", UNKNOWN, "no stack: (py-spy dump exited 1: Permission denied)"),
    # as py-spy prints them: a package's part of the path, the standard library's file name alone
    (dump("Condition.wait (threading.py:331)", "Queue.get (queue.py:180)", "load_batch (waitq.py:4)"), INPUT,
     "load_batch (waitq.py:4)"),
    (dump("Condition.wait (threading.py:331)", "Queue.get (queue.py:180)",
          "_try_get_data (torch/utils/data/dataloader.py:1133)", "<module> (train.py:40)"), INPUT,
     "_try_get_data (dataloader.py:1133)"),
    (dump("sync (torch_xla/torch_xla.py:80)", "step (train.py:10)"), COLLECTIVE, "sync (torch_xla.py:80)"),
    (dump("_value (jax/_src/array.py:640)", "__float__ (jax/_src/array.py:300)", "train (jt.py:90)"), COLLECTIVE,
     "_value (array.py:640)"),  # float(loss): the step's results, its collectives in it
    (dump("backend_compile (jax/_src/compiler.py:300)", "compile_or_get_cached (jax/_src/compiler.py:400)",
          "_cached_compilation (jax/_src/interpreters/pxla.py:2500)", "train (jt.py:90)"), PYTHON,
     "backend_compile (compiler.py:300)"),  # compiling under pjit is this host's own work, not a wait
])
def test_where_a_host_waits(text, kind, frame):
    assert place_of(text) == (place := place_of(text)) and (place.kind, place.frame) == (kind, frame)


def test_only_the_main_thread_counts():
    text = dump("all_reduce (/t/distributed_c10d.py:1)", thread="Thread-2") + dump("load_batch (/w/t.py:3)")
    assert place_of(text).kind == INPUT


def test_a_dump_whose_threads_are_not_named_is_read_from_its_first_thread():
    text = "Process 7: python t.py\nPython v3.11.7\n\nThread 7 (idle)\n    load_batch (t.py:3)\n"
    assert (place_of(text).kind, place_of(text).frame) == (INPUT, "load_batch (t.py:3)")


def test_a_torch_tpu_host_is_where_its_ranks_are_not_its_parents_loop():
    parent = "Process 10: python -m tpulaunch.host.ranks\n" + dump("run (tpulaunch/host/ranks.py:163)")
    rank = "Process {}: python train.py\n"
    waiting = rank.format(11) + dump("all_reduce (torch/distributed/distributed_c10d.py:2942)")
    loading = rank.format(12) + dump("load_batch (train.py:23)")
    assert place_of(parent + waiting + loading) == place_of(loading) and place_of(loading).kind == INPUT
    assert place_of(parent + waiting + waiting).kind == COLLECTIVE
    # any other host's children (a DataLoader's workers) are not its ranks: the host process speaks for it
    assert place_of(rank.format(20) + dump("all_reduce (c10d/distributed_c10d.py:1)") + loading).kind == COLLECTIVE


HOSTS = [HostRef(i, i // 2, i % 2) for i in range(4)]


def test_a_host_whose_stack_could_not_be_read_is_not_named_for_it():
    failed = "(py-spy dump took longer than 20 s)"
    h = triage({0: ALL_REDUCE, 1: ALL_REDUCE, 2: failed, 3: LOAD}, HOSTS)
    assert h.culprits == (3,) and h.slices == (1,)
    assert h.line.endswith("; no stack from host 2 ((py-spy dump took longer than 20 s))"), h.line
    h = triage({0: ALL_REDUCE, 1: ALL_REDUCE, 2: failed, 3: ALL_REDUCE}, HOSTS)
    assert h.culprits == () and "none of them is the cause" in h.line and "no stack from host 2" in h.line
    h = triage({i: failed for i in range(4)}, HOSTS)
    assert h.culprits == () and h.line.startswith("hang: no host's stack could be read; no stack from hosts 0,1,2,3")


def test_the_host_not_where_the_others_wait_is_the_culprit():
    h = triage({0: ALL_REDUCE, 1: ALL_REDUCE, 2: ALL_REDUCE, 3: LOAD}, HOSTS)
    assert h.culprits == (3,) and h.slices == (1,)
    assert h.line == ("hang: host 3 (slice 1 worker 1) is in load_batch (train.py:23); the other 3 wait in"
                      " all_reduce (distributed_c10d.py:2942)")
    doc = h.to_dict()
    assert doc["culprits"] == [3] and doc["hosts"]["3"] == {"kind": "input", "frame": "load_batch (train.py:23)"}
    assert type(h).from_dict(doc).culprits == (3,)


def test_several_culprits_and_their_slices():
    h = triage({0: ALL_REDUCE, 1: EVAL, 2: ALL_REDUCE, 3: LOAD}, HOSTS)
    assert h.culprits == (1, 3) and h.slices == (0, 1)
    assert "host 1 (slice 0 worker 1) is in sleep_a_while" in h.line and "host 3 (slice 1 worker 1)" in h.line
    assert h.line.endswith("the other 2 wait in all_reduce (distributed_c10d.py:2942)")


def test_when_every_host_waits_in_the_collective_no_host_is_named():
    h = triage({i: ALL_REDUCE for i in range(4)}, HOSTS)
    assert h.culprits == () and h.slices == () and "none of them is the cause" in h.line


def test_when_no_host_waits_in_a_collective_it_says_where_they_are():
    h = triage({0: LOAD, 1: LOAD, 2: EVAL, 3: LOAD}, HOSTS)
    assert h.culprits == () and h.line.startswith("hang: no host waits in a collective (hosts 0,1,3: in load_batch")


# -- the attempt watch ----------------------------------------------------------------------------


def watch(n: int, per_slice: int = 2, **rules) -> AttemptWatch:
    hosts = [HostResult(i, i // per_slice, i % per_slice) for i in range(n)]
    return AttemptWatch(0, hosts, StopRules(**rules), now=0.0)


def reply(**kw) -> PollReply:
    base = dict(lines=(), activity=0.0, code=None, ended=None, preempted=None, wall_s=1.0, step=None, checkpoint=None,
                phases={})
    base.update(kw)
    if base["lines"] and isinstance(base["lines"][0], str):
        base["lines"] = tuple(("stdout", t) for t in base["lines"])
    return PollReply(**base)


def test_libtpus_hang_report_stalls_the_attempt_at_once_with_stacks():
    w = watch(4)
    line = "E1128 Megascale hang detected: Timed out waiting for 4 graphs to complete at launch_id 13650. Timeout: 1m"
    act = w.on_reply(2, reply(lines=[line]), 5.0, 1005.0)
    assert isinstance(act, StopAll) and act.outcome is Outcome.STALLED and act.dump_stacks
    assert act.why.startswith("libtpu reported a hang on host 2: E1128 Megascale hang detected")
    assert sorted(act.hosts) == [0, 1, 2, 3]


def test_libtpus_hang_report_with_its_hosts_end_in_the_same_reply_keeps_that_end():
    """libtpu aborts (`--megascale_abort_on_hangs`) as it reports: the report and the host's exit code
    can come in one reply. The end is that host's, kept; the others are stopped (its poll is over: a
    host left pending would be waited for through the grace and the drain, its code lost)."""
    w = watch(4)
    act = w.on_reply(2, reply(lines=["E1128 Megascale hang detected: Timed out"], code=134, ended=1005.0), 5.0, 1005.0)
    assert isinstance(act, StopAll) and act.outcome is Outcome.STALLED and sorted(act.hosts) == [0, 1, 3]
    assert w.hosts[2].exit_code == 134 and 2 not in w.pending and not w.hosts[2].stopped_by_tpulaunch


def test_a_lost_host_takes_its_slice_and_is_the_one_blamed():
    w = watch(4)
    for i in range(4):
        w.on_reply(i, reply(lines=["step"]), 1.0, 1001.0)
    w.on_gone(3, Cause.NODE_LOST, "node lost")
    w.on_reply(2, reply(code=1, ended=1001.5), 2.0, 1001.5)  # its peer's collective broke first
    for i in (0, 1):
        w.on_reply(i, reply(code=143, ended=1002.0), 2.0, 1002.0)
    a = w.result("/l", 2.0, {})
    assert a.first_failure.process_index == 3 and a.outcome is Outcome.LOST
    assert a.hosts[2].went_with == 3 and a.hosts[2].preempted == "its slice went (host 3 lost: node lost)"
    assert a.hosts[2].failed and a.hosts[0].went_with is None  # slice 0 stays a slice of its own
    assert {a.hosts[i].slice_index for i in range(4) if a.hosts[i].lost or a.hosts[i].preempted} == {1}


def test_libtpus_hang_flags_go_first_and_the_hosts_own_flags_win():
    from tpulaunch.plan.env import libtpu_args, megascale_hang_flags

    ours = megascale_hang_flags(20.0)
    # 60 s past the stall timeout: tpulaunch's stall and its stacks come first, while the hosts live
    assert ours == "--megascale_abort_on_hangs=true --megascale_graph_hang_threshold=80s"
    assert megascale_hang_flags(None) == "--megascale_abort_on_hangs=true"
    assert libtpu_args(ours, "--megascale_abort_on_hangs=false --xla_tpu_x=1") == (
        ours + " --megascale_abort_on_hangs=false --xla_tpu_x=1")  # absl: the last of a flag wins: theirs
    assert libtpu_args(None, " --a=1 ") == "--a=1" and libtpu_args(None, None) is None

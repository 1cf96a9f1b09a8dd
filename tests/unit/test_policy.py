"""What happens after an attempt (`run.policy.decide`), over a table of cases, with no cluster."""

from __future__ import annotations

import pytest

from tpulaunch.errors import ExitCode
from tpulaunch.run.policy import Action, Budgets, Spent, decide
from tpulaunch.run.summary import Attempt, Cause, HostResult, Outcome


def attempt(outcome: Outcome, code: int = 0, cause: Cause | None = None) -> Attempt:
    first = None if outcome is Outcome.OK else HostResult(1, 0, 1, exit_code=code, reason="x", cause=cause)
    return Attempt(index=0, outcome=outcome, exit_code=code, hosts=[], log_dir="/l", first_failure=first)


FAILED3 = attempt(Outcome.FAILED, 3, Cause.EXITED)
LOST = attempt(Outcome.LOST, 75, Cause.NODE_LOST)
PREEMPTED = attempt(Outcome.PREEMPTED, 75, Cause.PREEMPTED)
HEAD = attempt(Outcome.LOST, 75, Cause.HEAD_LOST)


def _hung(culprits: tuple[int, ...], slices: tuple[int, ...]) -> Attempt:
    from tpulaunch.run.hang import Hang

    a = attempt(Outcome.STALLED, 124)
    a.hang = Hang({}, culprits, "load_batch (t.py:3)", "all_reduce (c10d.py:9)", "hang: ...", slices)
    return a


HUNG = _hung((3,), (1,))
HUNG_NO_CULPRIT = _hung((), ())  # every host waits in the collective: nothing to replace

CASES = [
    # (attempt, budgets, spent) -> (action, spent after, why contains)
    (attempt(Outcome.OK), Budgets(3, 3), Spent(), Action.FINISH, Spent(), None),
    (attempt(Outcome.TIMEOUT, 124), Budgets(3, 3), Spent(), Action.FINISH, Spent(), None),
    # a stall: a restart while --max-restarts allows; its culprits' slices replaced first with --replace-hung
    (attempt(Outcome.STALLED, 124), Budgets(0, 3), Spent(), Action.FINISH, Spent(), None),
    (attempt(Outcome.STALLED, 124), Budgets(3, 3), Spent(), Action.RESTART, Spent(restarts=1), None),
    (attempt(Outcome.STALLED, 124), Budgets(1), Spent(restarts=1), Action.FINISH, Spent(restarts=1),
     "--max-restarts 1 spent"),
    (HUNG, Budgets(1, replace_hung=True), Spent(), Action.REPLACE, Spent(restarts=1), None),
    (HUNG, Budgets(1), Spent(), Action.RESTART, Spent(restarts=1), None),  # without --replace-hung
    (HUNG_NO_CULPRIT, Budgets(1, replace_hung=True), Spent(), Action.RESTART, Spent(restarts=1), None),
    (attempt(Outcome.INTERRUPTED, 130), Budgets(3, 3), Spent(), Action.FINISH, Spent(), None),
    (FAILED3, Budgets(), Spent(), Action.FINISH, Spent(), None),  # no budget: nothing to say
    (FAILED3, Budgets(max_restarts=1), Spent(), Action.RESTART, Spent(restarts=1), None),
    (FAILED3, Budgets(max_restarts=1), Spent(restarts=1), Action.FINISH, Spent(restarts=1), "--max-restarts 1 spent"),
    (FAILED3, Budgets(max_restarts=5, max_preemptions=5), Spent(preemptions=5), Action.RESTART,
     Spent(restarts=1, preemptions=5), None),  # the budgets are separate
    (attempt(Outcome.FAILED, ExitCode.USAGE), Budgets(9), Spent(), Action.FINISH, Spent(), "never retried"),
    (attempt(Outcome.FAILED, ExitCode.BOOT_FAILED), Budgets(9), Spent(), Action.FINISH, Spent(), "never retried"),
    (attempt(Outcome.FAILED, ExitCode.TPU_BUSY), Budgets(9), Spent(), Action.FINISH, Spent(), "never retried"),
    (attempt(Outcome.FAILED, ExitCode.TPU_BUSY), Budgets(9, kill_stale=True), Spent(), Action.RESTART,
     Spent(restarts=1), None),
    (attempt(Outcome.FAILED, 137, Cause.EXITED), Budgets(1), Spent(), Action.RESTART, Spent(restarts=1), None),
    (LOST, Budgets(), Spent(), Action.FINISH, Spent(), None),
    (LOST, Budgets(max_preemptions=1), Spent(), Action.WAIT_FOR_SLICE, Spent(preemptions=1), None),
    (LOST, Budgets(max_preemptions=1), Spent(preemptions=1), Action.FINISH, Spent(preemptions=1),
     "--max-preemptions 1 spent"),
    (LOST, Budgets(max_restarts=9), Spent(), Action.FINISH, Spent(), None),  # restarts do not cover losses
    (PREEMPTED, Budgets(max_preemptions=2), Spent(preemptions=1), Action.WAIT_FOR_SLICE, Spent(preemptions=2), None),
    (HEAD, Budgets(max_preemptions=3), Spent(), Action.FINISH, Spent(), "Ray head is gone"),
]


@pytest.mark.parametrize("a, budgets, spent, action, after, why", CASES)
def test_decide(a, budgets, spent, action, after, why):
    d = decide(a, budgets, spent)
    assert (d.action, d.spent) == (action, after)
    if why is None:
        assert d.why is None
    else:
        assert why in d.why


def test_a_run_stopped_between_attempts_ends_143_whatever_it_was_doing():
    """`tpulaunch stop` while a preempted slice is re-created: the last attempt was PREEMPTED (75),
    the run ends STOPPED, 143 (130 for SIGINT); a run not stopped keeps its attempt's outcome."""
    import signal

    from tpulaunch.plan.mesh import plan_mesh
    from tpulaunch.plan.topology import resolve
    from tpulaunch.plan.launch import build_plan
    from tpulaunch.plan.slicespec import SliceSpec
    from tpulaunch.run.launch import _summary
    from tpulaunch.run.policy import Spent

    t = resolve("v4-16")
    plan = build_plan(slices=[SliceSpec.emulated_from(t, "s")], mesh=plan_mesh(t), script="t.py", run_id="r",
                      coordinator_port=1, emulated=True, log_dir="/l", workdir="/w")
    preempted = attempt(Outcome.PREEMPTED, 75)
    for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        s = _summary(plan, [preempted], Spent(), "waiting for the slice", signum, 1.0, {})
        assert (s.outcome, s.exit_code, s.interrupted) == (Outcome.INTERRUPTED, code, signal.Signals(signum).name)
    s = _summary(plan, [preempted], Spent(), None, None, 1.0, {})
    assert (s.outcome, s.exit_code) == (Outcome.PREEMPTED, 75)


def test_an_attempt_names_its_first_failed_host_or_itself():
    failed = attempt(Outcome.FAILED, 3, Cause.EXITED)
    assert failed.blamed == failed.who == "host 1 x"
    ok = Attempt(index=0, outcome=Outcome.PREEMPTED, exit_code=0, hosts=[], log_dir="/l", note="slice b preempted")
    assert ok.blamed == "the attempt" and ok.who == "slice b preempted"

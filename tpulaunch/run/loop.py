"""The run's attempts, one after another, as `run.policy` decides: a plain loop.

Each turn runs one attempt (`execute`), records its end in the timeline, asks the policy what next,
and carries it out with `run.recovery.resize` (wait for a lost slice or swap a spare in, replace a
hung slice, shrink or grow an elastic run) or ends the run. `run.context.RunContext` is what every
step shares.
"""

from __future__ import annotations

import time
from dataclasses import replace

from tpulaunch.plan.launch import LaunchPlan
from tpulaunch.run import policy
from tpulaunch.run.context import RunContext
from tpulaunch.run.execute import execute
from tpulaunch.run.record.events import Event
from tpulaunch.run.recovery import resize
from tpulaunch.run.status import RunState, RunView
from tpulaunch.run.summary import Attempt, attempts_brief


def run_attempts(plan: LaunchPlan, ctx: RunContext) -> tuple[policy.Spent, str | None]:
    """Run attempts until the policy finishes the run; returns what was spent and why it finished."""
    spent = policy.Spent()
    current = full = plan  # full: every slice the run asked for; current: the ones this attempt runs on
    resize.warm_spares(ctx, plan.topology)
    while True:
        a = _one_attempt(current, ctx)
        hit = {current.hosts[h.process_index].slice_name for h in a.hosts if h.lost or h.preempted}
        decision = policy.decide(a, ctx.sup.budgets, spent, whole_slices=len(current.slices) - len(hit))
        if decision.action is policy.Action.FINISH:
            return spent, decision.why
        spent = decision.spent
        if decision.action is policy.Action.GROW:  # slices preempted again while they were brought back
            spent = replace(spent, preemptions=spent.preemptions + sum(r.again for r in ctx.regrowths))
        note = (a.hang.line if a.hang else None) if decision.action is policy.Action.REPLACE else \
            f"attempt {a.index}: {a.outcome}: {a.who}"
        if decision.action not in (policy.Action.SHRINK, policy.Action.GROW):
            ctx.sink.status(RunView(plan.run_id, RunState.RESTARTING, a.index, tuple(), attempts_brief(ctx.attempts),
                                    note=note))
        if ctx.stopped():
            return spent, None
        ctx.sigs.raise_now = True  # no host runs between attempts: a stop ends a wait at once
        try:
            current, full, spent, why = _next(decision.action, a, current, full, hit, ctx, spent)
        finally:
            ctx.sigs.raise_now = False
        if why is not None:
            return spent, why
        if ctx.stopped():
            return spent, None


def _one_attempt(current: LaunchPlan, ctx: RunContext) -> Attempt:
    """One attempt, run and recorded (the timeline's start, each host's end, the attempt's end)."""
    tl = ctx.timeline
    tl.emit(Event.ATTEMPT_START, attempt=current.attempt, slices=[s.name for s in current.slices],
            reason=current.reason)
    a = execute(current, ctx.sink, replace(ctx.limits, grow=resize.grow_when(ctx.regrowths)), ctx.sigs,
                gcs_address=ctx.gcs, timeline=tl)
    if ctx.sup.recovery.recreate:
        resize.preempted_by_the_provider(a, current, ctx)
    ctx.attempts.append(a)
    tl.attempt_over(current.attempt)
    for h in a.hosts:  # each host's end: the last steps of a failed attempt are seen here only
        tl.emit(Event.HOST_END, h.ended_at or h.last_seen or time.time(), attempt=current.attempt,
                host=h.process_index, step=h.step, exit_code=h.exit_code, failed=h.failed)
    first = a.first_failure
    tl.emit(Event.ATTEMPT_END, attempt=current.attempt, outcome=str(a.outcome), exit_code=a.exit_code,
            host=first.process_index if first else None, why=a.who)
    return a


def _next(action: policy.Action, a: Attempt, current: LaunchPlan, full: LaunchPlan, hit: set[str], ctx: RunContext,
          spent: policy.Spent) -> tuple[LaunchPlan, LaunchPlan, policy.Spent, str | None]:
    """The policy's decision carried out: (the next plan, the full one, what is spent, why the run
    ends instead or None)."""
    if action in (policy.Action.SHRINK, policy.Action.GROW):
        current, full = resize.resize(action, a, current, full, sorted(hit), ctx, spent)
        return current, full, spent, None
    if action is policy.Action.REPLACE:
        current, full, why = resize.replace_hung(a, current, full, ctx)
        return current, full, spent, why
    if action is policy.Action.RESTART:
        ctx.sink.progress(f"{a.blamed}: restarting the whole slice (restart {spent.restarts} of"
                          f" {ctx.sup.budgets.max_restarts})")
        nxt = resize.next_attempt(current, "restart")
        return nxt, nxt if nxt.mesh.num_slices == full.mesh.num_slices else full, spent, None
    # WAIT_FOR_SLICE: a spare in each lost slice's place at once, else the lost ones back
    if current is full:
        swapped = resize.swap_in_spares(sorted(hit), a, current, ctx, "a preemption or a lost host")
        if swapped is not None:
            nxt = resize.next_attempt(swapped, "preemption")
            return nxt, nxt, spent, None
    else:  # too few slices left to go on: wait for the whole run's again
        for r in ctx.regrowths:
            r.cancel()
        ctx.regrowths.clear()
        hit |= {s.name for s in full.slices} - {s.name for s in current.slices}
        current = full.for_attempt(current.attempt, full.endpoints, current.reason)
    back, spent, why = resize.wait_for_lost(a, current, hit, ctx, spent)
    if back is None:
        return current, full, spent, why
    nxt = resize.next_attempt(back, "preemption")
    return nxt, nxt if nxt.mesh.num_slices == full.mesh.num_slices else full, spent, None

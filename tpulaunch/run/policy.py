"""What to do after an attempt: the restart and preemption budgets as one pure function.

`decide(attempt, budgets, spent)` looks only at the attempt's outcome and first failure, the
budgets the user set and what is spent; `run.launch` carries the decision out (waits for the
slice, relaunches, or ends the run). Tested over a table of cases with no cluster.

* A failed host (non-zero exit) relaunches the whole slice while `--max-restarts` allows; exits
  2 (bad input), 86 (boot failure) and 87 (TPU busy, without `--kill-stale`) never: a rerun would
  fail the same way.
* A lost or preempted host relaunches once the slice is whole again, while `--max-preemptions`
  allows; not when the Ray head itself is gone (nothing left to relaunch on).
* Elastic (`--min-slices K`): a lost or preempted slice, with at least K slices left whole, shrinks
  the run at once to the slices left (a preemption, counted); an attempt tpulaunch stopped because
  the lost slices are back grows it again (counted against nothing).
* A stalled attempt (`--stall-timeout`, or libtpu's own hang report) relaunches the whole slice
  while `--max-restarts` allows; with `--replace-hung` and culprits named by the triage
  (`run.hang`), their slices are replaced first (a spare, made again, or dropped under
  `--min-slices`). Either counts as a restart.
* Success, timeouts and signals end the run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from tpulaunch.errors import ExitCode
from tpulaunch.run.summary import NEVER_RETRIED, Attempt, Cause, Outcome


@dataclass(frozen=True)
class Budgets:
    """What the user allows (`--max-restarts`, `--max-preemptions`, `--kill-stale`)."""

    max_restarts: int = 0
    max_preemptions: int = 0
    kill_stale: bool = False
    min_slices: int = 0  # elastic: go on with at least this many slices (0: never shrink)
    replace_hung: bool = False  # --replace-hung: a hang's culprit slices are replaced before the restart


@dataclass(frozen=True)
class Spent:
    restarts: int = 0
    preemptions: int = 0


class Action(Enum):
    FINISH = "finish"  # the run ends with this attempt's exit code
    RESTART = "restart"  # relaunch the whole slice now
    WAIT_FOR_SLICE = "wait-for-slice"  # relaunch once every host is back in Ray
    SHRINK = "shrink"  # relaunch now on the slices left whole; the lost ones come back in the background
    GROW = "grow"  # relaunch on every slice of the run (the lost ones are back)
    REPLACE = "replace"  # replace the slices of a hang's culprits, then relaunch


@dataclass(frozen=True)
class Decision:
    action: Action
    spent: Spent
    why: str | None = None  # FINISH: why the run was not retried (a budget spent, an exit never retried)


def decide(attempt: Attempt, budgets: Budgets, spent: Spent, whole_slices: int | None = None) -> Decision:
    """The next step after `attempt` (see the module docstring). `whole_slices`: how many of the
    attempt's slices lost no host (elastic runs)."""
    outcome, first = attempt.outcome, attempt.first_failure
    if outcome is Outcome.GROWN:
        return Decision(Action.GROW, spent)
    if outcome in (Outcome.OK, Outcome.INTERRUPTED, Outcome.TIMEOUT):
        return Decision(Action.FINISH, spent)
    if outcome is Outcome.STALLED:
        if spent.restarts >= budgets.max_restarts:
            return Decision(Action.FINISH, spent, _spent("--max-restarts", budgets.max_restarts))
        counted = replace(spent, restarts=spent.restarts + 1)
        hang = attempt.hang
        if budgets.replace_hung and hang is not None and hang.slices:
            return Decision(Action.REPLACE, counted)
        return Decision(Action.RESTART, counted)
    if outcome is Outcome.PREFLIGHT:
        return Decision(Action.FINISH, spent, "the preflight checks failed: no script was started")
    if outcome in (Outcome.LOST, Outcome.PREEMPTED):
        if spent.preemptions >= budgets.max_preemptions:
            return Decision(Action.FINISH, spent, _spent("--max-preemptions", budgets.max_preemptions))
        if first is not None and first.cause is Cause.HEAD_LOST:
            return Decision(Action.FINISH, spent, "the Ray head is gone with its node: no cluster to relaunch on")
        counted = replace(spent, preemptions=spent.preemptions + 1)
        if budgets.min_slices and whole_slices is not None and budgets.min_slices <= whole_slices < len(attempt.slices):
            return Decision(Action.SHRINK, counted)
        return Decision(Action.WAIT_FOR_SLICE, counted)
    code = attempt.exit_code
    if code in NEVER_RETRIED or (code == ExitCode.TPU_BUSY and not budgets.kill_stale):
        return Decision(Action.FINISH, spent, f"exit {code} is never retried: a rerun would fail the same way")
    if spent.restarts >= budgets.max_restarts:
        return Decision(Action.FINISH, spent, _spent("--max-restarts", budgets.max_restarts))
    return Decision(Action.RESTART, replace(spent, restarts=spent.restarts + 1))


def _spent(flag: str, n: int) -> str | None:
    return f"{flag} {n} spent" if n else None

"""Between two attempts: the next plan after a lost slice, a hang or a slice come back.

Each function takes the run's `run.context.RunContext` and the plans (`current`: the slices the attempt ran
on; `full`: every slice the run asked for) and returns the next ones. What the provider does (make a
slice again, swap a spare in) is the provider's (`tpulaunch.providers`); what to do is `run.policy`'s.

* `wait_for_lost`: the lost slices made again (`--recreate`) or awaited until whole in Ray;
* `swap_in_spares`: spares of the run's shape take the lost (or hung) slices' places at once;
* `replace_hung`: `--replace-hung`: a hang's culprit slices swapped, made again or dropped;
* `resize`: an elastic run shrinks to the slices left, or grows back to all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from tpulaunch.errors import TpulaunchError
from tpulaunch.plan.contract import Endpoints
from tpulaunch.plan.launch import LaunchPlan
from tpulaunch.plan.topology import Topology
from tpulaunch.run import policy
from tpulaunch.run.context import RunContext
from tpulaunch.run.record.events import Event
from tpulaunch.run.recovery import elastic, recreate
from tpulaunch.run.summary import Attempt, Cause, HostResult, Outcome, exit_code_for, first_failure, outcome_of

if TYPE_CHECKING:
    from tpulaunch.discover.ray_labels import RaySlice
    from tpulaunch.run.watch import AttemptWatch


def fresh_endpoints(plan: LaunchPlan) -> Endpoints:
    """A new process group per attempt; on one machine also new ports (the old ones may linger)."""
    from tpulaunch.cluster.ports import free_port

    if not plan.local:
        return plan.endpoints
    return plan.endpoints.moved(master_port=free_port(), group_port=free_port(), jax_port=free_port(),
                                emulation_port=free_port(), exit_port=free_port())


def next_attempt(plan: LaunchPlan, reason: str) -> LaunchPlan:
    """`plan` as the next attempt (fresh endpoints), run for `reason`."""
    return plan.for_attempt(plan.attempt + 1, fresh_endpoints(plan), reason)


def preempted_by_the_provider(a: Attempt, plan: LaunchPlan, ctx: RunContext) -> None:
    """`--recreate`: a host whose process failed on a slice its provider says was preempted (the
    Cloud TPU API, the Kubernetes API) was preempted: its VM's or node's shutdown may end the script
    before its agent and raylet, so the loop heard an exit, not a loss. Asked once per such slice."""
    if a.outcome is not Outcome.FAILED:
        return

    def exited(h: HostResult) -> bool:  # a host that failed by its own exit
        return not (h.exit_code in (None, 0) or h.stopped_by_tpulaunch or h.lost or h.preempted)

    known = {s.name for s in ctx.cluster.slices} or {h.slice_name for h in plan.hosts}
    names = sorted({plan.hosts[h.process_index].slice_name for h in a.hosts if exited(h)} & known)
    if not names:
        return
    verdicts = recreate.preempted_slices(ctx.cluster, names)
    for h in a.hosts:
        name = plan.hosts[h.process_index].slice_name
        why = verdicts.get(name) if exited(h) else None
        if why:
            h.preempted, h.cause, h.reason = (f"slice {name}: {why}", Cause.PREEMPTED,
                                              f"preempted ({why}), then {h.reason}")
    if any(verdicts.values()):
        a.first_failure = first_failure(a.hosts)
        a.outcome = outcome_of(a.first_failure)
        a.exit_code = exit_code_for(a.outcome, a.first_failure)


def lost_to_preemption(a: Attempt, lost: list[str], ctx: RunContext) -> None:
    """A spare took the lost slices' places: the provider's word (once) on whether they were preempted,
    which the recreate path hears as it makes them again, and a spare's swap does not wait for."""
    if a.outcome is not Outcome.LOST:
        return
    verdicts = {n: why for n, why in recreate.preempted_slices(ctx.cluster, lost).items() if why}
    if verdicts:
        a.outcome = Outcome.PREEMPTED
        a.note = "; ".join(f"slice {n} preempted ({why})" for n, why in verdicts.items())


def grow_when(regrowths: list[elastic.Regrowth]) -> Callable[[AttemptWatch, float], str | None] | None:
    """The watch's grow callback: grow back once every lost slice is back (a slice that could not
    come back keeps the run small)."""
    if not regrowths:
        return None

    def ask(watch: AttemptWatch, now: float) -> str | None:
        if any(r.error for r in regrowths):
            return None
        whys = [r.should_grow(watch, now) for r in regrowths]
        return whys[-1] if all(whys) else None

    return ask


def wait_for_lost(a: Attempt, current: LaunchPlan, hit: set[str], ctx: RunContext,
                  spent: policy.Spent) -> tuple[LaunchPlan | None, policy.Spent, str | None]:
    """The lost slices (`hit`) made again (`--recreate`) and every host of the plan whole in Ray:
    (the plan to run next, what is spent, None), or (None, spent, why the run ends)."""
    rec = ctx.sup.recovery
    budget = ctx.sup.budgets.max_preemptions
    t0 = time.monotonic()
    if rec.recreate:
        lost = sorted(hit)
        ctx.timeline.emit(Event.RECREATE_START, slices=lost)
        back = recreate.Comeback(ctx.cluster, lost, ctx.sink.progress, budget=budget - spent.preemptions)
        failed: TpulaunchError | None = None
        slices = []
        try:
            slices = back.run(rec.preemption_wait)
        except TpulaunchError as e:
            failed = e
        spent = replace(spent, preemptions=spent.preemptions + back.again)  # preempted again meanwhile
        a.recreated = list(back.made)
        ctx.timeline.emit(Event.RECREATE_END, slices=lost, ok=failed is None)
        if failed is not None:
            return None, spent, (f"the slice was not made again within --preemption-wait {rec.preemption_wait:g} s:"
                                 f" {failed.line()}")
        if a.recreated:  # the provider's word: these hosts were not just lost, their slice was preempted
            a.outcome = Outcome.PREEMPTED
            a.note = "; ".join(dict.fromkeys(f"slice {r.slice} preempted ({r.why})" for r in a.recreated))
            current = current.on_slices(recreate.in_run_order(current.slices, slices))
    left = max(1.0, rec.preemption_wait - (time.monotonic() - t0))
    ctx.sink.progress(f"{a.blamed}: waiting up to {left:.0f} s for the slice to be whole again in Ray"
                      f" (preemption {spent.preemptions} of {budget})")
    t1 = time.monotonic()
    if not wait_whole(current, left, ctx):
        return None, spent, f"the slice was not whole again within --preemption-wait {rec.preemption_wait:g} s"
    for r in a.recreated:
        r.steps["ray_whole_s"] = time.monotonic() - t1
    return where_ray_has_them(current), spent, None


def swap_in_spares(lost: list[str], a: Attempt, current: LaunchPlan, ctx: RunContext, why: str, *,
                   heal: bool = True) -> LaunchPlan | None:
    """A spare of the run's shape, whole and free in Ray, for each slice in `lost`: the plan with them
    in the lost ones' places (same slice ids; process indices, `MEGASCALE_*` and the mesh made afresh
    for that fleet), the record saying the lost ones are the spares now, the attempt's outcome
    preempted if the provider says so (`lost_to_preemption`), and (`heal`) the lost ones brought
    back in the background (as spares). None when there are not spares enough (the run waits
    instead)."""
    from tpulaunch import providers
    from tpulaunch.discover import ray_labels

    provider = providers.of(ctx.cluster)
    spares = provider.spares()
    if not spares:
        return None
    t0 = time.monotonic()
    topo = current.topology
    ready = free_spares(spares, ray_labels.read_slices(), topo, ctx.healing())
    if len(ready) < len(lost):
        ctx.sink.progress(f"{len(ready)} spare(s) of {topo.accelerator_type} ({topo.topology}) whole and free,"
                          f" {len(lost)} needed: waiting for the lost slice(s) instead")
        return None
    # Not strict: there may be more spares ready than slices lost; the first ones take their places.
    swaps = {name: spare.to_spec() for name, spare in zip(lost, ready, strict=False)}
    for name, spare in zip(lost, ready, strict=False):
        provider.swap(name, spare.name)
    plan = current.swapped(swaps)
    took = time.monotonic() - t0
    a.replaced = [{"slice": name, "how": f"spare {spec.name}", "spare": spec.name, "why": why,
                   "seconds": round(took, 3)} for name, spec in swaps.items()]
    ctx.timeline.emit(Event.SWAP, slices=list(swaps), spares=[s.name for s in swaps.values()])
    ctx.sink.progress("; ".join(f"spare {spec.name} takes {name}'s place" for name, spec in swaps.items())
                      + f" ({took:.2f} s): {name if len(lost) == 1 else 'they'} come(s) back as spare(s) in the"
                      " background")
    # asked before the lost ones are brought back: bringing them back moves the record to their new pods
    lost_to_preemption(a, list(swaps), ctx)
    if heal:
        rec = ctx.sup.recovery
        ctx.healings.append(elastic.Regrowth(ctx.cluster, current, list(swaps), recreate=rec.recreate,
                                             wait_s=rec.preemption_wait, grow_after=None, say=ctx.sink.progress,
                                             budget=0, spare=True))
    return plan


def warm_spares(ctx: RunContext, topo: Topology) -> int:
    """Start the host agents of the cluster's spare slices of the run's shape that are whole and free
    in Ray, so that a swap finds them running (`host.agent.warm_agents`). Returns how many hosts.
    Best effort: a spare whose agent could not be started now starts it when it steps in."""
    from tpulaunch import providers
    from tpulaunch.discover import ray_labels
    from tpulaunch.host.agent import warm_agents

    try:
        spares = set(providers.of(ctx.cluster).spares())
        if not spares:
            return 0
        ready = free_spares(spares, ray_labels.read_slices(), topo, ctx.healing())
        return warm_agents([(s.name, w) for s in ready for w, _, _, _ in s.workers])
    except Exception:  # Ray's answer: the run goes on, and a swap starts the agents itself
        return 0


def free_spares(names: Iterable[str], slices: Iterable[RaySlice], topo: Topology,
                healing: Collection[str] = ()) -> list[RaySlice]:
    """The spares named in `names` (in that order) that Ray's `slices` show whole, free and of the
    run's shape, and not being made again (`healing`: a hung slice a spare replaced is a spare on
    record at once, and alive in Ray until its replacement takes it down): the ones a swap may use.
    Pure."""
    by_name = {s.name: s for s in slices}
    return [by_name[n] for n in names if n in by_name and n not in healing and by_name[n].intact(topo.num_hosts)
            and not by_name[n].busy and same_shape(by_name[n], topo)]


def same_shape(s: RaySlice, topo: Topology) -> bool:
    """A spare is used only when it is the run's shape: a spare of another shape never is."""
    from tpulaunch.plan import topology as topo_mod

    try:
        t = topo_mod.resolve(topology=s.topology or None, accelerator=s.pod_type)
    except TpulaunchError:
        return False
    return (t.generation.name, t.topology, t.num_hosts) == (topo.generation.name, topo.topology, topo.num_hosts)


def replace_hung(a: Attempt, current: LaunchPlan, full: LaunchPlan,
                 ctx: RunContext) -> tuple[LaunchPlan, LaunchPlan, str | None]:
    """`--replace-hung`: the hang's culprit slices are swapped for spares, made again by the cluster's
    provider, or (where it cannot) dropped under --min-slices; then the whole run restarts from its
    checkpoint. Returns (the next plan, the full one, why the run ends instead or None)."""
    from tpulaunch import providers
    from tpulaunch.host import frameworks

    assert a.hang is not None
    hang = a.hang
    names = [current.slices[k].name for k in hang.slices]
    provider = providers.of(ctx.cluster)
    wait_s = ctx.sup.recovery.preemption_wait
    if current is full:
        swapped = swap_in_spares(names, a, current, ctx, hang.line, heal=False)
        if swapped is not None:  # a spare took each hung slice's place; the hung ones are made again as spares
            if provider.replace_refusal() is None:
                ctx.healings.append(elastic.Background(
                    f"slice(s) {', '.join(names)} made again as spares",
                    lambda: provider.replace(names, hang.line, wait_s, ctx.sink.progress), ctx.sink.progress,
                    slices=names))
            nxt = next_attempt(swapped, "restart")
            return nxt, nxt, None
    t0 = time.monotonic()
    ctx.timeline.emit(Event.REPLACE_START, slices=names, why=hang.line)
    if provider.replace_refusal() is None:
        try:
            recs, slices = provider.replace(names, hang.line, wait_s, ctx.sink.progress)
        except TpulaunchError as e:
            ctx.timeline.emit(Event.REPLACE_END, slices=names, ok=False)
            return current, full, f"the hung slice(s) {', '.join(names)} could not be replaced: {e.line()}"
        current = current.on_slices(recreate.in_run_order(current.slices, slices))
        if not wait_whole(current, max(1.0, wait_s - (time.monotonic() - t0)), ctx):
            ctx.timeline.emit(Event.REPLACE_END, slices=names, ok=False)
            return current, full, f"the replaced slice(s) were not whole in Ray within --preemption-wait {wait_s:g} s"
        current = where_ray_has_them(current)
        took = time.monotonic() - t0
        a.replaced = [{"slice": r.slice, "how": "made again", "why": hang.line, "seconds": round(took, 2),
                       **({"replica": r.replica} if r.replica else {})} for r in recs]
        ctx.timeline.emit(Event.REPLACE_END, slices=names, ok=True)
        ctx.sink.progress(f"replaced {', '.join(names)} after the hang ({took:.1f} s): restarting the whole run from"
                          " its checkpoint")
        nxt = next_attempt(current, "restart")
        return nxt, nxt if nxt.mesh.num_slices == full.mesh.num_slices else full, None
    keep = [s.name for s in current.slices if s.name not in names]
    min_slices = ctx.sup.budgets.min_slices
    if min_slices and len(keep) >= min_slices:  # dropped: the run goes on without them
        a.replaced = [{"slice": n, "how": "dropped", "why": hang.line, "seconds": 0.0} for n in names]
        ctx.timeline.emit(Event.REPLACE_END, slices=names, ok=True)
        ctx.sink.progress(f"dropping {', '.join(names)} after the hang: going on on {', '.join(keep)}")
        small = current.on_fleet(keep, frameworks.get(current.framework).emulation_env(current.topology, len(keep)))
        nxt = next_attempt(small, "shrink")
        return nxt, nxt, None
    ctx.timeline.emit(Event.REPLACE_END, slices=names, ok=False)
    return current, full, f"the hung slice(s) {', '.join(names)} cannot be replaced: {provider.replace_refusal()}"


def resize(action: policy.Action, a: Attempt, current: LaunchPlan, full: LaunchPlan, hit: list[str],
           ctx: RunContext, spent: policy.Spent) -> tuple[LaunchPlan, LaunchPlan]:
    """The next attempt of an elastic run: on the slices left whole (shrink; the lost ones start
    coming back), or on every slice of the run again (grow). Returns (the next plan, the full one)."""
    from tpulaunch.host import frameworks

    n = full.mesh.num_slices
    rec, budget = ctx.sup.recovery, ctx.sup.budgets.max_preemptions
    if action is policy.Action.SHRINK:
        keep = [s.name for s in current.slices if s.name not in hit]
        ctx.regrowths.append(elastic.Regrowth(ctx.cluster, full, hit, recreate=rec.recreate, wait_s=rec.preemption_wait,
                                              grow_after=rec.grow_after, say=ctx.sink.progress,
                                              budget=budget - spent.preemptions))
        ctx.sink.progress(f"{a.who}: going on at once on {len(keep)} of {n} slices ({', '.join(keep)}) while"
                          f" {', '.join(hit)} come(s) back (preemption {spent.preemptions} of {budget})")
        ctx.timeline.emit(Event.SHRINK, attempt=current.attempt + 1, slices=keep, lost=hit)
        small = full.on_fleet(keep, frameworks.get(full.framework).emulation_env(full.topology, len(keep)))
        return small.for_attempt(current.attempt + 1, fresh_endpoints(small), "shrink"), full
    back = [s for r in ctx.regrowths for s in r.lost]
    a.recreated = [made for r in ctx.regrowths for made in r.recreated]
    specs = next((r.slices for r in reversed(ctx.regrowths) if r.slices), None)
    ctx.regrowths.clear()
    if specs:  # re-created slices have new VMs and addresses
        full = full.on_slices(recreate.in_run_order(full.slices, specs))
    full = where_ray_has_them(full)
    ctx.sink.progress(f"growing back to all {n} slices ({', '.join(back)} returned)")
    ctx.timeline.emit(Event.GROW, attempt=current.attempt + 1, slices=[s.name for s in full.slices], back=back)
    full = full.for_attempt(current.attempt + 1, fresh_endpoints(full), "grow")
    return full, full


def where_ray_has_them(plan: LaunchPlan) -> LaunchPlan:
    """A plan of slices found through Ray's labels, at the addresses Ray has their hosts at now: a
    slice that came back (a KubeRay replica made again, a VM rejoined) has new ones. Others as they are."""
    if plan.local or not plan.slices or plan.slices[0].source != "ray":
        return plan
    from tpulaunch.discover import ray_labels

    now = [s.to_spec() for s in ray_labels.read_slices()]
    fresh = [s for s in now if s.name in {p.name for p in plan.slices}]
    if len(fresh) != len(plan.slices) or any(len(s.workers) != plan.topology.num_hosts for s in fresh):
        return plan  # not whole in Ray after all: the next attempt's own wait says so
    return plan.on_slices(recreate.in_run_order(plan.slices, fresh))


def wait_whole(plan: LaunchPlan, wait_s: float, ctx: RunContext) -> bool:
    """Until every host of the plan's slices is alive and free in Ray (or `wait_s` passes, or a stop)."""
    return elastic.wait_whole(ctx.cluster, plan.topology, [s.name for s in plan.slices], wait_s,
                              lambda: ctx.sigs.received is not None, ctx.sink.progress)

"""Before any script starts: what makes multi-host runs hang, checked on every host at once.

The hangs TPU users lose hours to are start-up hangs whose cause is on one host: another version
of a framework or of the script, a blocked coordinator port, a chip held by a stale process,
wrong worker ids or MEGASCALE values. The agents are up and the plan is made before any script
starts, so every host is asked in one round (`HostAgent.preflight`, which runs `host/probe.py`
in the run's own environment) and the answers are compared here, purely. A finding names the
host(s) and the fix; an error ends the attempt before any script runs (exit 78), a warning is
printed and the run goes on.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tpulaunch.host.protocol import PreflightReport, PreflightRequest
from tpulaunch.plan.launch import LaunchPlan

LOW_DISK_BYTES = 1 << 30  # below this free under the compile cache or the log dir: a warning
LOW_MEMORY_BYTES = 1 << 30
COMPARED = ("python", "tpulaunch", "torch", "torch_xla", "jax", "jaxlib", "libtpu", "libtpu-nightly")


@dataclass(frozen=True)
class Finding:
    error: bool  # False: a warning (printed, the run goes on)
    hosts: tuple[int, ...]  # process indices it is about
    what: str
    fix: str

    def line(self) -> str:
        return f"{self.what}. {self.fix}" if self.fix else self.what

    def to_dict(self) -> dict:
        return {"severity": "error" if self.error else "warning", "hosts": list(self.hosts), "what": self.what,
                "fix": self.fix}


def ports(plan: LaunchPlan) -> list[tuple[int, str]]:
    """The ports the run's hosts will meet on (all on process 0's host), with what each is for."""
    e = plan.endpoints
    out = [(e.master_port, "MASTER_PORT")]
    if e.group_port and e.group_port != e.master_port:
        out.append((e.group_port, "tpulaunch's gloo group"))
    if e.jax_port is not None:
        out.append((e.jax_port, "the JAX coordinator"))
    if e.emulation_port is not None:
        out.append((e.emulation_port, "the emulated hosts' input store"))
    if e.exit_port is not None:
        out.append((e.exit_port, "the hosts' ordered exit"))
    if plan.mesh.num_slices > 1 and not plan.local:
        out.append((e.megascale_port, "the MEGASCALE coordinator"))
    return out


def requests(plan: LaunchPlan, timeout_s: float = 2.0) -> list[PreflightRequest]:
    """What each host checks: every other host connects to process 0's ports; process 0 checks it can
    listen on them."""
    meet = ports(plan)
    out = []
    for h in plan.hosts:
        zero = h.process_index == 0
        connect = () if zero else tuple((plan.endpoints.host, port, what) for port, what in meet)
        out.append(PreflightRequest(connect=connect, bind=tuple(meet) if zero else (), cache_dir=plan.job.compile_cache,
                                    log_dir=plan.job.log_dir, timeout_s=timeout_s))
    return out


def _hosts(ps: list[int]) -> str:
    ps = sorted(ps)
    return f"host {ps[0]}" if len(ps) == 1 else "hosts " + ",".join(map(str, ps))


def _minor(v: str) -> str:
    return ".".join(v.split(".")[:2])


def findings(plan: LaunchPlan, reports: list[PreflightReport]) -> list[Finding]:
    """Every problem the reports show, errors first. Pure."""
    out: list[Finding] = []
    by_proc = {r.process_index: r for r in reports}
    for r in reports:
        if r.error:
            out.append(Finding(True, (r.process_index,), f"host {r.process_index} could not be checked: {r.error}",
                               "its log and the agent's say more"))
    good = [r for r in reports if not r.error]
    out += _versions(good) + _code(plan, good) + _network(plan, good) + _chips(good) + _identity(plan, by_proc)
    out += _resources(good)
    return sorted(out, key=lambda f: (not f.error, f.hosts))


def _versions(reports: list[PreflightReport]) -> list[Finding]:
    out = []
    for name in COMPARED:
        seen: dict[str, list[int]] = defaultdict(list)
        for r in reports:
            seen[r.probe.get("versions", {}).get(name, "not installed")].append(r.process_index)
        if len(seen) < 2:
            continue
        common = max(seen, key=lambda v: len(seen[v]))
        odd = [(v, ps) for v, ps in seen.items() if v != common]
        minors = {_minor(v) for v in seen}
        error = len(minors) > 1
        what = "; ".join(f"{_hosts(ps)} {'has' if v != 'not installed' else 'has no'} {name}"
                         + (f" {v}" if v != "not installed" else "") for v, ps in odd)
        out.append(Finding(error, tuple(p for _v, ps in odd for p in ps),
                           f"{what}, the others {name} {common}" + ("" if error else " (a patch version apart)"),
                           f"install the same {name} on every host" if error else ""))
    return out


def _code(plan: LaunchPlan, reports: list[PreflightReport]) -> list[Finding]:
    out = []
    for key, what in (("script_sha256", f"the script {plan.job.script}"),
                      ("workdir_sha256", "the working directory's Python files")):
        seen: dict[str, list[int]] = defaultdict(list)
        for r in reports:
            if r.probe.get(key):
                seen[r.probe[key]].append(r.process_index)
        if len(seen) > 1:
            common = max(seen, key=lambda d: len(seen[d]))
            odd = [p for d, ps in seen.items() if d != common for p in ps]
            other = next(d for d in seen if d != common)
            out.append(Finding(True, tuple(odd), f"{_hosts(odd)} would run other code than the others: {what} differs"
                                                 f" (sha256 {other[:12]} vs {common[:12]})",
                               "give every host the same files (ship the working directory, or sync it)"))
    return out


def _network(plan: LaunchPlan, reports: list[PreflightReport]) -> list[Finding]:
    out = []
    blocked: dict[tuple[int, str, str], list[int]] = defaultdict(list)
    for r in reports:
        for _host, port, what, result in r.probe.get("connect", []):
            if result not in ("refused", "open"):
                blocked[(port, what, result)].append(r.process_index)
        for port, what, free in r.probe.get("bind", []):
            if not free:
                out.append(Finding(True, (r.process_index,), f"host {r.process_index} cannot listen on port {port}"
                                                             f" ({what}): something else holds it",
                                   "stop what holds it (`ss -ltnp`), or choose other ports"))
    for (port, what, result), ps in sorted(blocked.items()):
        out.append(Finding(True, tuple(ps), f"{_hosts(ps)} cannot reach host 0:{port} ({what}): {result}",
                           "open the port between the hosts (the VPC's firewall rule for internal traffic)"))
    return out


def _chips(reports: list[PreflightReport]) -> list[Finding]:
    out = [Finding(True, (r.process_index,), f"host {r.process_index}'s TPU is held: {'; '.join(r.tpu_holders)}",
                   "rerun with --kill-stale, or `tpulaunch cluster doctor --kill-stale` on that host")
           for r in reports if r.tpu_holders]
    out += [Finding(False, (r.process_index,), f"host {r.process_index} has a stale libtpu lockfile {r.stale_lockfile}"
                                               " (no process holds it)", "--kill-stale removes it")
            for r in reports if r.stale_lockfile and not r.tpu_holders]
    return out


def _identity(plan: LaunchPlan, by_proc: dict[int, PreflightReport]) -> list[Finding]:
    """Worker ids unique and contiguous per slice; each host's node, labels (and metadata) agree
    with the plan; MEGASCALE values consistent with the slices."""
    out = []
    per_slice: dict[str, list[int]] = defaultdict(list)
    for h in plan.hosts:
        per_slice[h.slice_name].append(h.worker_id)
        r = by_proc.get(h.process_index)
        if r is None:
            continue
        said = {"node env TPU_WORKER_ID": r.node_worker_id, "Ray label ray.io/tpu-worker-id": r.label_worker_id,
                "metadata agent-worker-number": r.metadata_worker_id}
        wrong = [f"{k} says {v}" for k, v in said.items() if v not in (None, "") and v != str(h.worker_id)]
        if r.label_slice not in (None, h.slice_name):
            wrong.append(f"its Ray label says slice {r.label_slice}")
        if wrong:
            out.append(Finding(True, (h.process_index,), f"host {h.process_index} is planned as worker {h.worker_id} of"
                                                         f" {h.slice_name}, but " + ", ".join(wrong),
                               "the VM's identity and Ray's labels must agree: restart Ray on that host"))
    for name, ids in per_slice.items():
        if sorted(ids) != list(range(len(ids))):
            out.append(Finding(True, (), f"slice {name}'s worker ids are {sorted(ids)}, not 0..{len(ids) - 1}",
                               "each TPU worker of a slice must carry its own id (check the nodes' labels)"))
    slice_ids = sorted({h.slice_index for h in plan.hosts})
    if plan.mesh.num_slices > 1 and slice_ids != list(range(plan.mesh.num_slices)):
        out.append(Finding(True, (), f"the plan's MEGASCALE slice ids are {slice_ids} for {plan.mesh.num_slices}"
                                     " slices", "report this bug"))
    return out


def _resources(reports: list[PreflightReport]) -> list[Finding]:
    out = []
    for r in reports:
        for what, free in (r.probe.get("disk_free") or {}).items():
            if free is not None and free < LOW_DISK_BYTES:
                out.append(Finding(False, (r.process_index,), f"host {r.process_index} has {free / 2**20:.0f} MiB free"
                                                              f" under its {what}", "free some disk"))
        mem = r.probe.get("mem_available")
        if mem is not None and mem < LOW_MEMORY_BYTES:
            out.append(Finding(False, (r.process_index,), f"host {r.process_index} has {mem / 2**20:.0f} MiB of memory"
                                                          " available", ""))
    return out

"""`tpulaunch stacks RUN`: where every host of a running run is, without stopping it.

The run's hosts are found through their agents (each agent says which run, attempt and host its
process serves: `AgentInfo.run`), `py-spy dump` runs next to each host process at once, and the
answer is one line grouping the hosts by the frame they are in (the line `--stall-timeout`
prints) plus the full dumps, written under the run's attempt directory:

    <log dir>/<run id>/attempt-<k>/stacks-<UTC time>/host-<i>.txt

On a cluster whose head is elsewhere, `tpulaunch stacks` runs there as a Ray job (the run's
files are on the head), and this side prints what it answered.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tpulaunch.errors import LaunchError
from tpulaunch.host.protocol import AgentInfo, HostRun
from tpulaunch.run.paths import RunPaths
from tpulaunch.run.watch import where_hosts_are

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from tpulaunch.host.agent import HostAgent

DUMP_TIMEOUT_S = 30.0

H = TypeVar("H")  # an agent's handle (`pick` is pure: any value stands for one)


@dataclass(frozen=True)
class Stacks:
    """One look at a run's hosts."""

    run_id: str
    attempt: int
    dumps: dict[int, str]  # process index -> `py-spy dump` text
    where: str  # `hosts 0,1: in step (train.py:40); host 2: in ...`
    dir: str  # where the dumps were written
    missing: list[int] = field(default_factory=list)  # hosts of the attempt with no agent serving it now

    def to_dict(self) -> dict:
        return {"schema": "tpulaunch.stacks/v1", "run_id": self.run_id, "attempt": self.attempt, "where": self.where,
                "dir": self.dir, "hosts": sorted(self.dumps), "missing": self.missing,
                "files": {str(i): str(RunPaths.stacks_file(Path(self.dir), i)) for i in sorted(self.dumps)}}


def serving_agents() -> list[tuple[ActorHandle[HostAgent], AgentInfo]]:
    """Every host agent on the connected cluster with a host process running, and what it serves."""
    import ray

    from tpulaunch.host.agent import NAMESPACE

    handles: list[ActorHandle[HostAgent]] = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == NAMESPACE and a["name"].startswith("tpulaunch-agent-"):
            try:
                handles.append(ray.get_actor(a["name"], namespace=NAMESPACE))
            except ValueError:  # gone meanwhile
                continue
    refs = [h.info.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=15.0) if refs else ([], [])
    out = []
    for h, ref in zip(handles, refs, strict=True):
        if ref in ready:
            try:
                info = ray.get(ref)
            except Exception:  # an agent lost with its node: it serves nothing
                continue
            if info.run is not None:
                out.append((h, info))
    return out


def pick(agents: Sequence[tuple[H, AgentInfo]], run: str) -> tuple[str, int, list[tuple[H, HostRun]]]:
    """The run's id, its current attempt and its hosts' agents, each with what it serves. `run`: an
    id, or `last` (the one run going on; several: an error naming them). Pure."""
    serving = [(h, info.run) for h, info in agents if info.run is not None]
    runs = sorted({r.run_id for _h, r in serving})
    if run == "last":
        if not runs:
            raise LaunchError("no run is going on on this cluster", "`tpulaunch runs` lists the detached runs")
        if len(runs) > 1:
            raise LaunchError(f"{len(runs)} runs are going on: {', '.join(runs)}", "name one: `tpulaunch stacks RUN`")
        run = runs[0]
    mine = [(h, r) for h, r in serving if r.run_id == run]
    if not mine:
        going = ", ".join(runs) or "none"
        raise LaunchError(f"run {run} has no host running on this cluster (runs going on: {going})",
                          "a run's stacks can be taken while it runs; an ended run's are in its logs")
    attempt = max(r.attempt for _h, r in mine)
    mine = sorted([(h, r) for h, r in mine if r.attempt == attempt], key=lambda hr: hr[1].process_index)
    return run, attempt, mine


def take(run: str, fallback_log_dir: str = "runs") -> Stacks:
    """Dump every host of `run` (connected to its cluster) and write the dumps (see the module)."""
    import ray

    run_id, attempt, mine = pick(serving_agents(), run)
    refs = {r.process_index: h.dump_stacks.remote(DUMP_TIMEOUT_S) for h, r in mine}
    dumps = {}
    for p, ref in refs.items():
        try:
            dumps[p] = ray.get(ref, timeout=DUMP_TIMEOUT_S + 10)
        except Exception as e:  # one host's failure is its line, not the command's
            dumps[p] = f"(no dump: {type(e).__name__}: {e})"
    log_dir = Path(mine[0][1].log_dir)
    if not log_dir.is_dir():  # the run's directory is on another machine
        log_dir = Path(fallback_log_dir) / run_id
    out = RunPaths.of(log_dir).stacks_dump(attempt, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    for p, text in dumps.items():
        RunPaths.stacks_file(out, p).write_text(text)
    missing = sorted(set(range(mine[0][1].hosts)) - set(dumps))
    return Stacks(run_id, attempt, dumps, where_hosts_are(dumps), str(out), missing)

"""The supervision at scale on real Ray: N simulated hosts answer the real `RayFleet`.

`python scale.py N SCENARIO SECONDS` prints one JSON document. The hosts are the models of
`tests/fakes/fleet.py` (`SimHost`), served by `PROCS` async actor processes that speak the host
agent's calls (`start`, `poll(max_lines, wait_s, batch_s)`, `terminate`, ...): each host's handle
forwards its calls, so the driver makes one real Ray call per host per poll, exactly as with real
agents, and runs the real supervision (`run.execute.drive`: `RayFleet`, `AttemptWatch`, the host
logs, a terminal sink printing to /dev/null).

Scenarios: `quiet` (no host prints), `chatty` (every host prints a line a second), `failure`
(chatty; host N/2 exits 1 halfway). Measured in the driver process: CPU (process time / wall),
peak RSS, polls per second, lines written per second and lines sent vs written, the time from the
failure to the last host told to stop, and the time to write the summary.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from fakes.fleet import SimHost, sim_plan  # noqa: E402

from tpulaunch.host.protocol import PollReply, PreflightReport, Started  # noqa: E402

PROCS = 4
SIZES = {16: "v5p-128", 256: "v5p-2048", 2304: "tpu7x-18432"}


class SimHosts:
    """Hosts `first..first+len(models)` of the run, in one actor process (async: thousands of
    long polls in flight cost no threads)."""

    def __init__(self, first: int, models: list[SimHost]) -> None:
        self.first, self.models = first, models
        self.t0: float | None = None
        self.delivered = [0] * len(models)
        self.told: dict[int, float] = {}
        self.wake: dict[int, asyncio.Event] = {}
        self.polls = 0

    def _end(self, k: int) -> tuple[float | None, int]:
        """When host k's process ends (seconds after start, None: not yet known) and its code."""
        m, told = self.models[k], self.told.get(k)
        stop = None if told is None else told - (self.t0 or told)
        if m.exit_at_s is not None and (stop is None or m.exit_at_s <= stop):
            return m.exit_at_s, m.exit_code
        return stop, 143

    def _due(self, k: int, now: float) -> tuple[int, int | None]:
        """(lines printed by `now`, the exit code if it ended by then)."""
        m, t = self.models[k], now - (self.t0 or now)
        end, code = self._end(k)
        upto = t if end is None else min(t, end)
        lines = len(m.banner) + (int(upto / m.line_every_s) if m.line_every_s else 0)
        return lines, (code if end is not None and t >= end else None)

    async def start(self, i: int, state, options) -> Started:  # noqa: ANN001
        self.t0 = self.t0 or time.time()
        return Started(20_000 + i, False, "simulated")

    async def preflight(self, i: int, state, options, request) -> PreflightReport:  # noqa: ANN001
        w = str(state.slot.worker_id)
        return PreflightReport(state.process_index, {}, w, w, state.slot.slice_name)

    async def poll(self, i: int, max_lines: int = 5000, wait_s: float = 0.0, batch_s: float = 0.0) -> PollReply:
        """As `HostAgent.poll`: at once with the end; lines gathered for `batch_s`; else `wait_s`."""
        self.polls += 1
        k, t_call = i - self.first, time.time()
        wake = self.wake.setdefault(k, asyncio.Event())
        while True:
            now = time.time()
            lines, code = self._due(k, now)
            news = lines - self.delivered[k]
            if code is not None or (news and now - t_call >= batch_s) or now - t_call >= wait_s:
                break
            m, t = self.models[k], now - (self.t0 or now)
            until = [t_call + (batch_s if news else wait_s)]
            if not news and m.line_every_s:
                until.append((self.t0 or now) + (int(t / m.line_every_s) + 1) * m.line_every_s)
            end, _ = self._end(k)
            if end is not None:
                until.append((self.t0 or now) + end)
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), timeout=max(0.001, min(until) - now))
            except asyncio.TimeoutError:
                pass
        n = min(max_lines, news)
        out = tuple(("stdout", f"step {self.delivered[k] + j + 1} of host {i}: loss 0.5") for j in range(n))
        self.delivered[k] += n
        ended = code is not None and self.delivered[k] >= lines
        return PollReply(lines=out, code=code if ended else None, wall_s=now - (self.t0 or now),
                         ended=now if ended else None, activity=now)

    async def terminate(self, i: int, grace_s: float = 3.0) -> None:
        k = i - self.first
        if k not in self.told:
            self.told[k] = time.time()
            self.wake.setdefault(k, asyncio.Event()).set()

    async def release(self, i: int, prewarm=None) -> None:  # noqa: ANN001
        return None

    async def dump_stacks(self, i: int, timeout_s: float = 20.0) -> str:
        return "Thread 1 (idle): MainThread\n    train_step (train.py:12)\n"

    async def stats(self) -> dict:
        produced = sum(self._due(k, 1e18)[0] for k in range(len(self.models))) if self.t0 else 0
        failed = [(self.t0 or 0) + m.exit_at_s for m in self.models if m.exit_code and m.exit_at_s is not None]
        return {"polls": self.polls, "produced": produced, "told": list(self.told.values()),
                "failed_at": min(failed) if failed else None}


class _Call:
    def __init__(self, method, i: int) -> None:  # noqa: ANN001
        self.method, self.i = method, i

    def remote(self, *args):  # noqa: ANN002, ANN201
        return self.method.remote(self.i, *args)


class SimAgent:
    """Host i's handle: every agent call goes to its block's actor, with the host's index."""

    def __init__(self, actor, i: int) -> None:  # noqa: ANN001
        for name in ("start", "preflight", "poll", "terminate", "release", "dump_stacks"):
            setattr(self, name, _Call(getattr(actor, name), i))


def models(n: int, scenario: str, seconds: float) -> list[SimHost]:
    chatty = scenario in ("chatty", "failure")
    out = []
    for i in range(n):
        fail = scenario == "failure" and i == n // 2
        out.append(SimHost(line_every_s=1.0 if chatty else None, exit_at_s=seconds / 2 if fail else seconds,
                           exit_code=1 if fail else 0))
    return out


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(n: int, scenario: str, seconds: float) -> dict:
    import ray

    from tpulaunch.cli.cmd_run import TerminalSink
    from tpulaunch.cli.output import Output
    from tpulaunch.run import policy
    from tpulaunch.run.execute import Limits, attempt_watch, drive
    from tpulaunch.run.fleet import RayFleet
    from tpulaunch.run.launch import _summary

    ray.init(num_cpus=PROCS, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO / "tests")}})  # the actors unpickle SimHost
    Actor = ray.remote(SimHosts).options(num_cpus=0, max_concurrency=max(1000, n))
    ms = models(n, scenario, seconds)
    per = -(-n // PROCS)
    actors = [Actor.remote(a * per, ms[a * per:(a + 1) * per]) for a in range(PROCS) if a * per < n]
    ray.get([a.stats.remote() for a in actors])
    agents = [SimAgent(actors[i // per], i) for i in range(n)]
    log_dir = tempfile.mkdtemp(prefix="tpl-scale-")
    plan = sim_plan(SIZES[n], str(Path(log_dir) / "run"))
    limits = Limits(preflight=False, grace_s=1.0)
    logs, watch = attempt_watch(plan, limits)
    out = Output()
    devnull = open(os.devnull, "w")  # noqa: SIM115
    from rich.console import Console

    out.out = out.err = Console(file=devnull, no_color=True, force_terminal=False, width=200)
    sink = TerminalSink(out, None, n)

    class NoSignal:
        received = None

    rss0 = rss_mib()
    c0, w0 = time.process_time(), time.time()
    drive(plan, RayFleet(agents), watch, sink, logs, limits, NoSignal(), {})
    c1, w1 = time.process_time(), time.time()
    attempt = watch.result(str(logs.paths.attempt(0)), w1 - w0, {})
    t = time.perf_counter()
    summary = _summary(plan, [attempt], policy.Spent(), None, None, w1 - w0, {})
    logs.paths.summary.write_text(json.dumps(summary.to_dict()))
    summary_s = time.perf_counter() - t
    stats = ray.get([a.stats.remote() for a in actors])
    written = sum(len(logs.paths.host_log(0, h.process_index).read_text().splitlines()) for h in plan.hosts)
    told = [x for s in stats for x in s["told"]]
    failed = [s["failed_at"] for s in stats if s["failed_at"]]
    ray.shutdown()
    return {
        "hosts": n, "scenario": scenario, "wall_s": w1 - w0, "cpu_cores": (c1 - c0) / (w1 - w0),
        "rss_mib": rss_mib(), "rss_growth_mib": rss_mib() - rss0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "polls_per_s": sum(s["polls"] for s in stats) / (w1 - w0),
        "lines_sent": sum(s["produced"] for s in stats), "lines_written": written,
        "lines_per_s": written / (w1 - w0),
        "stop_s": (max(told) - min(failed)) if told and failed else None, "told": len(told),
        "summary_s": summary_s, "exit_code": attempt.exit_code,
    }


if __name__ == "__main__":
    if "--old-cadence" in sys.argv:  # the baseline: one poll per host per second, every line at once
        import tpulaunch.run.fleet as fleet

        fleet.cadence = lambda hosts: (1.0, 0.0)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    print("SCALE " + json.dumps(main(int(args[0]), args[1], float(args[2]))))

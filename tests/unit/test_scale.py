"""The supervision at N = 256 hosts, driven by simulated hosts behind the Fleet seam (no Ray, no
processes): no line lost, one host's failure stops every other, the summary names it, and the
terminal shows what matters instead of every line. The numbers (CPU, memory, RPC rates,
stop latency at 256 and 2,304 hosts) are the bench's (`scripts/bench --only scale`)."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from fakes.fleet import SimFleet, SimHost, sim_plan
from tpulaunch.cli.cmd_run import TerminalSink, report
from tpulaunch.cli.hostlines import HostLineFilter, grouped_results, many_status, ranges
from tpulaunch.cli.output import Output
from tpulaunch.run.execute import Limits, Sink, attempt_watch, drive
from tpulaunch.run import policy
from tpulaunch.run.launch import _summary
from tpulaunch.run.paths import RunPaths
from tpulaunch.run.status import HostPhase, HostView
from tpulaunch.run.summary import Outcome

N_ACC = "v5p-2048"  # 1024 chips, 256 hosts of 4


class Quiet:
    received = None


class Counting(Sink):
    def __init__(self) -> None:
        self.lines = 0
        self.progress_lines: list[str] = []

    def host_line(self, process: int, stream: str, text: str) -> None:
        self.lines += 1

    def progress(self, message: str) -> None:
        self.progress_lines.append(message)


def supervise_sim(tmp_path, models, sink=None, **limits):
    plan = sim_plan(N_ACC, str(tmp_path / "runs" / "sim"))
    assert len(plan.hosts) == 256
    fleet = SimFleet(models(len(plan.hosts)) if callable(models) else models)
    lim = Limits(preflight=True, grace_s=0.5, **limits)
    logs, watch = attempt_watch(plan, lim)
    timings: dict = {}
    sink = sink or Counting()
    drive(plan, fleet, watch, sink, logs, lim, Quiet(), timings)
    attempt = watch.result(str(logs.paths.attempt(0)), 0.0, timings)
    return plan, fleet, sink, attempt


def written(plan) -> int:
    """Lines in every host's log of attempt 0."""
    paths = RunPaths.of(plan.job.log_dir)
    return sum(len(paths.host_log(0, h.process_index).read_text().splitlines()) for h in plan.hosts)


def test_256_chatty_hosts_lose_no_line(tmp_path):
    plan, fleet, sink, attempt = supervise_sim(
        tmp_path, lambda n: [SimHost(line_every_s=0.05, banner=("booting", "mesh ok"), exit_at_s=1.5)] * n)
    assert attempt.outcome is Outcome.OK and attempt.exit_code == 0
    assert fleet.lines_sent > 256 * 25
    assert written(plan) == fleet.lines_sent == sink.lines  # every line reached its host's log and the sink
    assert all(h.exit_code == 0 for h in attempt.hosts)
    assert fleet.replies < fleet.lines_sent  # lines arrive in batches, not one reply per line


def test_one_failure_among_256_stops_every_other_host(tmp_path):
    def models(n):
        return [SimHost(line_every_s=0.5, exit_at_s=0.8, exit_code=3) if i == 137 else SimHost(line_every_s=0.5)
                for i in range(n)]

    plan, fleet, sink, attempt = supervise_sim(tmp_path, models)
    assert attempt.outcome is Outcome.FAILED and attempt.exit_code == 3
    assert attempt.first_failure.process_index == 137
    told = [i for i, h in enumerate(fleet.hosts) if h.told_to_stop is not None]
    assert told == [i for i in range(256) if i != 137]  # one broadcast, every other host
    assert [h.exit_code for h in attempt.hosts].count(143) == 255
    assert sum("stopping the other hosts" in p for p in sink.progress_lines) == 1
    assert written(plan) == fleet.lines_sent


def test_a_lost_host_among_256_is_the_one_blamed(tmp_path):
    def models(n):
        return [SimHost(line_every_s=0.3, lost_at_s=0.7) if i == 200 else SimHost(line_every_s=0.3) for i in range(n)]

    plan, fleet, sink, attempt = supervise_sim(tmp_path, models)
    assert attempt.outcome is Outcome.LOST and attempt.first_failure.process_index == 200
    assert attempt.first_failure.reason == "node lost"
    assert written(plan) == fleet.lines_sent


def test_a_straggler_among_256_is_named(tmp_path):
    def models(n):
        return [SimHost(line_every_s=None, step_every_s=0.2 if i == 9 else 0.02, exit_at_s=2.5) for i in range(n)]

    plan, fleet, sink, attempt = supervise_sim(tmp_path, models)
    named = [p for p in sink.progress_lines if "straggler" in p]
    assert named and all(p.startswith("host 9 is a straggler") for p in named), named
    assert attempt.hosts[9].step_rate < 0.5 * attempt.hosts[0].step_rate


def _terminal(hosts: int, show=None, every=False) -> tuple[TerminalSink, io.StringIO]:
    buf = io.StringIO()
    out = Output()
    out.out = out.err = Console(file=buf, width=200, no_color=True, force_terminal=False)
    return TerminalSink(out, show, hosts, every), buf


def test_the_terminal_of_many_hosts_shows_host_0_errors_and_a_status(tmp_path):
    sink, buf = _terminal(256)
    for i in range(256):
        sink.host_line(i, "stdout", "Loading checkpoint shards: 100%")
    sink.host_line(77, "stderr", "Traceback (most recent call last):")
    sink.host_line(77, "stderr", '  File "train.py", line 3, in <module>')
    sink.host_line(77, "stderr", "ValueError: bad shape")
    sink.host_line(77, "stdout", "resuming at step 5")
    sink.host_line(12, "stderr", "RuntimeError: XLA compilation failed")
    text = buf.getvalue()
    assert "256 hosts: showing host 0, every host's errors" in text
    assert text.count("Loading checkpoint shards") == 1 and "[host 0] Loading" in text
    assert '[host 77]   File "train.py", line 3' in text and "[host 77] ValueError: bad shape" in text
    assert "resuming at step 5" not in text and "[host 12] RuntimeError: XLA compilation failed" in text
    every, buf2 = _terminal(256, every=True)
    for i in range(256):
        every.host_line(i, "stdout", "hello")
    assert buf2.getvalue().count("hello") == 256
    few, buf3 = _terminal(16)
    for i in range(16):
        few.host_line(i, "stdout", "hello")
    assert buf3.getvalue().count("hello") == 16 and "showing host 0" not in buf3.getvalue()


def test_the_end_of_a_2304_host_run_is_a_few_lines(tmp_path):
    from tpulaunch.run.summary import Attempt, HostResult

    hosts = [HostResult(i, i // 64, i % 64, exit_code=0, reason="exit 0", wall_s=100.0 + i / 100) for i in range(2304)]
    hosts[17].exit_code, hosts[17].reason = 3, "exit 3"
    for h in hosts:
        if h.process_index != 17:
            h.exit_code, h.reason, h.stopped_by_tpulaunch = 143, "exit 143 (SIGTERM)", True
    plan = sim_plan("tpu7x-18432", str(tmp_path / "runs" / "big"))
    a = Attempt(0, Outcome.FAILED, 3, hosts, str(tmp_path), first_failure=hosts[17])
    summary = _summary(plan, [a], policy.Spent(), None, None, 1.0, {})
    sink, buf = _terminal(2304)
    report(sink.out, summary, sink)
    lines = buf.getvalue().splitlines()
    assert len(lines) <= 5, lines
    assert any(ln.startswith("hosts 0-16,18-2303 (2303): exit 143 (SIGTERM) (stopped by tpulaunch) in ") for ln in lines)
    assert any(ln.startswith("host 17: exit 3 in ") for ln in lines)


def test_many_status_and_ranges():
    now = time.time()
    views = tuple(HostView(i, 0, i, HostPhase.RUNNING, None, now - (30 if i == 5 else 1), f"line {i}") for i in range(300))
    views += (HostView(300, 0, 300, HostPhase.LOST, reason="node lost"),)
    assert many_status(views, now) == "301 hosts: 300 running, 1 lost; quietest: host 5, 30 s ago: line 5"
    assert ranges([3, 1, 2, 9]) == "1-3,9"
    assert grouped_results([(0, "exit 0", 1.0), (1, "exit 0", 1.0)]) == ["hosts 0-1 (2): exit 0 in 1.0 s"]
    f = HostLineFilter(17)
    assert f.many and f.wants(0, "x") and not f.wants(3, "x") and f.wants(3, "CUDA error: boom")
    assert not HostLineFilter(17, {3}).many and HostLineFilter(17, {3}).wants(3, "x")


@pytest.fixture(autouse=True)
def _no_color(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")

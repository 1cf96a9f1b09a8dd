"""One line on how fast this machine does what the suite does most: read the clock, enter the
kernel, start a process, start Python.

Why: the same suite, on machines sold as the same (2 cores, 24 GiB), used 640-670 CPU-s on one and
about 2,200 on another, while a pure-Python benchmark ran at one speed on both. The suite is mostly
processes starting and Ray's, XLA's and gloo's threads waking on timers, which is where virtual
machines differ (a clock read that is a system call, not a vDSO read; costly exits to the
hypervisor). `./scripts/test` prints this line after each process's summary, so a slow run says
whether the machine was slow.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path


def _per_call_ns(fn, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def _best_ms(argv: list[str], n: int) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def _loop_ns(n: int) -> float:
    """CPU time (not wall: the other pytest processes share the cores) of one step of a Python loop."""
    t0 = time.process_time_ns()
    total = 0
    for i in range(n):
        total += i
    return (time.process_time_ns() - t0) / n


def _page_us(mb: int) -> float:
    """CPU time to touch a page of fresh memory once (the kernel's fault and zeroing; on a virtual
    machine whose memory the host backs on demand, the host's too)."""
    t0 = time.process_time_ns()
    m = mmap.mmap(-1, mb << 20)
    for off in range(0, mb << 20, 4096):
        m[off] = 1
    m.close()
    return (time.process_time_ns() - t0) / ((mb << 20) // 4096) / 1000


def report() -> str:
    """E.g. `this machine: clocksource tsc, clock read 60 ns, system call 230 ns, fork+exec 1.1 ms,
    python -c pass 19 ms, a Python loop's step 34 ns of CPU, a fresh page 4.4 us, load 2.1` (each the best
    or mean of a few tries; about 0.5 s in all). On 2026-12-07 the suite's pytest took 945-1,149 s
    where it had taken 700-735 s on 2026-11-28, and torch_xla's import 6.0 CPU-s against 3.6-3.85,
    while the clock, system call and start figures were those of the faster days. So two more: the
    loop's step gauges the CPU itself (34-54 ns that day), the fresh page the kernel's and the host's
    cost of new memory (4.4-4.8 us that day); neither was measured on a faster day, so what they say
    comes by comparing runs from now on."""
    source = Path("/sys/devices/system/clocksource/clocksource0/current_clocksource")
    clock = source.read_text().strip() if source.exists() else "unknown"
    read_ns = _per_call_ns(time.monotonic_ns, 200_000)
    call_ns = _per_call_ns(os.getppid, 100_000)
    spawn_ms = _best_ms(["/bin/true"], 10)
    python_ms = _best_ms([sys.executable, "-S", "-c", "pass"], 3)
    loop_ns = min(_loop_ns(1_000_000) for _ in range(3))
    page_us = min(_page_us(64) for _ in range(2))
    return (f"this machine: clocksource {clock}, clock read {read_ns:.0f} ns, system call {call_ns:.0f} ns,"
            f" fork+exec {spawn_ms:.1f} ms, python -S -c pass {python_ms:.0f} ms, a Python loop's step {loop_ns:.0f} ns"
            f" of CPU, a fresh page {page_us:.1f} us, load {os.getloadavg()[0]:.1f}")

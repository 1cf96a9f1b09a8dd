"""Which host lines reach the terminal (pure): every line of a few hosts; for many, what matters.

With up to `MANY_HOSTS` hosts every line is shown. Above that, 2,304 hosts printing the same
banner would bury the one line that matters, so by default the terminal shows host 0's lines,
every line of any host that looks like an error (and the rest of a traceback it starts), and a
status line every `STATUS_EVERY_S` (`many_status`). `--hosts all` shows everything again,
`--hosts 0,5` exactly those hosts. Every host's full log is on disk either way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tpulaunch.run.status import HostPhase, HostView

MANY_HOSTS = 16
STATUS_EVERY_S = 10.0
_ALARM = re.compile(r"error|exception|traceback|fatal|panic|abort|segmentation fault|core dumped|\bkilled\b", re.I)
_TRACEBACK = "Traceback (most recent call last):"


@dataclass
class HostLineFilter:
    """`hosts`: how many the run has; `chosen`: `--hosts` (None: not given; "all" is every host)."""

    hosts: int
    chosen: set[int] | None = None
    every: bool = False  # `--hosts all`
    _in_traceback: set[int] = field(default_factory=set)

    @property
    def many(self) -> bool:
        """The many-hosts view: no --hosts, and more hosts than a terminal can follow."""
        return self.chosen is None and not self.every and self.hosts > MANY_HOSTS

    def wants(self, process: int, text: str) -> bool:
        if self.chosen is not None:
            return process in self.chosen
        if not self.many:
            return True
        if process in self._in_traceback:
            if text[:1] not in (" ", "\t") and not text.startswith(_TRACEBACK):
                self._in_traceback.discard(process)  # the exception's own line ends the block
            return True
        if text.startswith(_TRACEBACK):
            self._in_traceback.add(process)
            return True
        return process == 0 or bool(_ALARM.search(text))


def many_status(views: tuple[HostView, ...], now: float) -> str:
    """One line about all hosts: how many run, ended, were lost; the quietest running host."""
    count = {p: 0 for p in HostPhase}
    for v in views:
        count[v.phase] += 1
    parts = [f"{len(views)} hosts:", f"{count[HostPhase.RUNNING] + count[HostPhase.STARTING]} running"]
    parts += [f"{n} {p.value}" for p, n in count.items() if n and p not in (HostPhase.RUNNING, HostPhase.STARTING)]
    running = [v for v in views if v.phase is HostPhase.RUNNING and v.last_activity]
    line = " ".join(parts[:2]) + ("" if len(parts) == 2 else ", " + ", ".join(parts[2:]))
    if running:
        q = min(running, key=lambda v: v.last_activity or 0.0)
        last = q.last_line[:100] if q.last_line else "(no line yet)"
        line += f"; quietest: host {q.process_index}, {max(0.0, now - (q.last_activity or now)):.0f} s ago: {last}"
    return line


def ranges(indices: list[int]) -> str:
    """`0-3,7,9-12`: sorted indices as runs."""
    out, ids = [], sorted(indices)
    start = prev = ids[0] if ids else 0
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out) if ids else ""


def grouped_results(results: list[tuple[int, str, float]]) -> list[str]:
    """The end-of-run host lines for many hosts: one per outcome, `hosts 0-2302 (2303): exit 0 in
    11.2-14.9 s`. `results`: (process index, how it ended, seconds)."""
    groups: dict[str, list[tuple[int, float]]] = {}
    for p, how, wall in results:
        groups.setdefault(how, []).append((p, wall))
    lines = []
    for how, members in sorted(groups.items(), key=lambda kv: min(p for p, _ in kv[1])):
        walls = [w for _, w in members]
        span = f"{min(walls):.1f} s" if max(walls) - min(walls) < 0.05 else f"{min(walls):.1f}-{max(walls):.1f} s"
        who = (f"host {members[0][0]}" if len(members) == 1
               else f"hosts {ranges([p for p, _ in members])} ({len(members)})")
        lines.append(f"{who}: {how} in {span}")
    return lines

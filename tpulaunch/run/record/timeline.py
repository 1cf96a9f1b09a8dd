"""A run's event timeline: `events.jsonl` in its directory, one JSON object a line, appended as the
run goes (`tpulaunch goodput` and `tpulaunch trace` read it; a detached run's is served by Ray's
log API like its host logs).

Every event has `t` (the launcher's clock, `time.time()`) and `kind`:

    run_start       {run_id, hosts, slices, emulated}
    cluster_start / cluster_ready   {how: "start" | "connect"}
    attempt_start   {attempt}
    preflight_start / preflight_end {attempt, ok}
    host_start      {attempt, host, prewarmed}     the host's process took the run
    step            {attempt, host, step[, first]} sampled (below); `first`: the host's first step
    checkpoint      {attempt, host, step, save_s}  `tpulaunch.heartbeat(step=N, checkpoint=True)`
    host_end        {attempt, host, step, exit_code, failed}   at the host process's end
    attempt_end     {attempt, outcome, exit_code, host, why}
    recreate_start / recreate_end   {slices, ok}
    replace_start / replace_end     {slices, ok[, why]}    --replace-hung
    swap            {slices, spares}               spares took lost or hung slices' places
    shrink / grow   {attempt, slices, lost | back}  an elastic run's resizes
    run_end         {outcome, exit_code}

The kinds are `events.Event`'s members: `emit` takes nothing else.

Steps are sampled per host: the first of each attempt, then at most one every
max(0.5 s, the attempt's stepping time so far / 100), so a million steps cost kilobytes; the last
step seen is written when the attempt ends. Checkpoints are all kept.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from tpulaunch.run.record.events import Event

MIN_GAP_S = 0.5
SAMPLES = 100  # the gap grows with the attempt's stepping time: ~100 samples a decade of it


class Timeline:
    """Appends events to `path` (None: keeps nothing, for runs without a directory)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._steps: dict[tuple[int, int], dict[str, Any]] = {}  # (attempt, host) -> sampling state

    def emit(self, kind: Event, t: float | None = None, **fields: Any) -> None:
        if not isinstance(kind, Event):
            raise TypeError(f"a timeline event's kind is an Event, not {kind!r}")
        if self.path is None:
            return
        line = json.dumps({"t": round(time.time() if t is None else t, 3), "kind": kind.value, **fields})
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")

    def on_step(self, attempt: int, host: int, reply: Any, t: float | None = None) -> None:
        """What a host's poll reply (`host.protocol.PollReply`) said of its steps: its first step
        (once), a sample when due, every new checkpoint; each at its own time on this clock (the
        poll's, less the ages the host measured)."""
        now = time.time() if t is None else t
        s = self._steps.setdefault((attempt, host), {"first_t": None, "last_t": 0.0, "last": None, "ckpt": None,
                                                     "seen": None, "seen_t": None})
        if s["first_t"] is None and reply.first_step is not None:
            first, age = reply.first_step
            s["first_t"] = now - age
            self.emit(Event.STEP, now - age, attempt=attempt, host=host, step=first, first=True)
            s["last"], s["last_t"] = first, now - age
        saved = reply.checkpoint
        if saved is not None and saved[0] != (s["ckpt"] or (None,))[0]:
            s["ckpt"] = saved
            self.emit(Event.CHECKPOINT, now - saved[2], attempt=attempt, host=host, step=saved[0], save_s=saved[1])
        step, at = reply.step, now - reply.step_age
        if step is None or step == s["seen"]:
            return
        s["seen"], s["seen_t"] = step, at
        if s["first_t"] is None:
            s["first_t"] = at
        gap = max(MIN_GAP_S, (at - s["first_t"]) / SAMPLES)
        if s["last"] is None or (step != s["last"] and at - s["last_t"] >= gap):
            s["last"], s["last_t"] = step, at
            self.emit(Event.STEP, at, attempt=attempt, host=host, step=step)

    def attempt_over(self, attempt: int) -> None:
        """The last step each host was seen at, if the sampling skipped it."""
        for (a, host), s in sorted(self._steps.items()):
            if a == attempt and s["seen"] is not None and s["seen"] != s["last"]:
                s["last"], s["last_t"] = s["seen"], s["seen_t"]
                self.emit(Event.STEP, s["seen_t"], attempt=attempt, host=host, step=s["seen"])


def read(path: Path) -> list[dict]:
    """The events of a timeline file."""
    return parse(path.read_text(errors="replace"))


def parse(text: str) -> list[dict]:
    """The events in a timeline's text (a torn last line, while it is written, is left out)."""
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("t"), (int, float)) and isinstance(doc.get("kind"), str):
            out.append(doc)
    return out

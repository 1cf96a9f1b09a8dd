"""The heartbeat file: how a host process tells its agent where it is, without printing a line.

The script writes it (`tpulaunch.heartbeat`, `host/context.py`), the agent reads it on every poll
(`host/agent.py`), and nothing else shares the format. One record of at most `RECORD_BYTES`,
rewritten in place at offset 0 ("STEP FIRST SINCE_FIRST [SAVED SAVE_S SINCE_SAVED]"): the last
step, this process's first step and the seconds since it, and the last save's step, duration and
age. Times are differences on the host's clock; the reader turns them into ages with the file's
mtime (the write is the mtime's update), so the launcher places them on its own clock.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

RECORD_BYTES = 96  # padded with spaces: a shorter record overwrites every digit of a longer one


@dataclass(frozen=True)
class Beat:
    """One reading of a heartbeat file: ages are seconds before it was read."""

    step: int
    step_age: float
    first_step: tuple[int, float] | None = None  # (step, age)
    checkpoint: tuple[int, float, float] | None = None  # (step, save seconds, age)

    def reply_fields(self) -> dict:
        """The `PollReply` fields it fills (`checkpoint` only once a save was marked)."""
        out: dict = {"step": self.step, "step_age": self.step_age}
        if self.first_step is not None:
            out["first_step"] = self.first_step
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        return out


def record(step: int, first: tuple[int, float], saved: tuple[int, float, float] | None, now: float) -> bytes:
    """What `heartbeat(step=...)` writes: `first` is (step, when), `saved` (step, save seconds,
    when), in `time.monotonic()` seconds like `now`."""
    text = f"{int(step)} {first[0]} {now - first[1]:.3f}"
    if saved:
        text += f" {saved[0]} {saved[1]:.3f} {now - saved[2]:.3f}"
    return (text + "\n").ljust(RECORD_BYTES).encode()


def parse(data: bytes, age: float) -> Beat | None:
    """A record written `age` seconds ago; None for an empty file (the script reported no step)."""
    words = data.split()
    if not words:
        return None
    first = (int(words[1]), age + float(words[2])) if len(words) >= 3 else None
    saved = (int(words[3]), float(words[4]), age + float(words[5])) if len(words) >= 6 else None
    return Beat(step=int(words[0]), step_age=age, first_step=first, checkpoint=saved)


def read(path: str) -> Beat | None:
    """The file's record, aged by its mtime; None if there is none (or it cannot be read)."""
    try:
        with open(path, "rb") as f:
            data = f.read(RECORD_BYTES + 32)
            age = max(0.0, time.time() - os.fstat(f.fileno()).st_mtime)
        return parse(data, age)
    except (OSError, ValueError):
        return None

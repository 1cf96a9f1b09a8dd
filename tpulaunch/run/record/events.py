"""The kinds of a run's timeline events, one name each: `Timeline.emit` takes only these, and
`goodput` and `trace` match on them, so a misspelt kind is an AttributeError where it is written,
never a bucket left silently empty. The fields of each are in `timeline`'s docstring. Pure."""

from __future__ import annotations

from enum import Enum


class Event(str, Enum):
    RUN_START = "run_start"
    CLUSTER_START = "cluster_start"
    CLUSTER_READY = "cluster_ready"
    CAPACITY_REQUESTED = "capacity_requested"  # a slice asked for (goodput's provisioning)
    CAPACITY_READY = "capacity_ready"
    ATTEMPT_START = "attempt_start"
    PREFLIGHT_START = "preflight_start"
    PREFLIGHT_END = "preflight_end"
    HOST_START = "host_start"
    STEP = "step"
    CHECKPOINT = "checkpoint"
    HOST_END = "host_end"
    ATTEMPT_END = "attempt_end"
    RECREATE_START = "recreate_start"
    RECREATE_END = "recreate_end"
    REPLACE_START = "replace_start"
    REPLACE_END = "replace_end"
    SWAP = "swap"
    SHRINK = "shrink"
    GROW = "grow"
    RUN_END = "run_end"

    def __str__(self) -> str:
        return self.value

    @property
    def span(self) -> str:
        """A `_start` event's span name (`attempt_start` -> `attempt`)."""
        return self.value.rsplit("_", 1)[0]

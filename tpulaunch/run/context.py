"""What the attempts of one run share (`RunContext`): the loop (`run.loop`) and what it does between
attempts (`run.recovery.resize`) take it, instead of ten parameters each."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpulaunch.cluster.record import ClusterInfo
from tpulaunch.run.execute import Interrupts, Limits, Sink
from tpulaunch.run.record.timeline import Timeline
from tpulaunch.run.recovery import elastic
from tpulaunch.run.summary import Attempt
from tpulaunch.run.supervision import Supervision


@dataclass
class RunContext:
    """What the attempts of one run share: how it is supervised, where it reports, its cluster and
    timeline, and what goes on in the background (slices coming back)."""

    sup: Supervision
    sink: Sink
    limits: Limits
    sigs: Interrupts
    cluster: ClusterInfo
    timeline: Timeline
    attempts: list[Attempt] = field(default_factory=list)
    regrowths: list[elastic.Regrowth] = field(default_factory=list)  # lost slices coming back (elastic)
    healings: list = field(default_factory=list)  # slices a spare replaced, coming back as spares

    @property
    def gcs(self) -> str | None:
        return None if self.cluster.address.startswith("ray://") else self.cluster.address

    def stopped(self) -> bool:
        return self.sigs.received is not None

    def healing(self) -> set[str]:
        """The slices being made again in the background: no spare until they are."""
        return set().union(*(h.healing() for h in self.healings))

    def cancel_background(self) -> None:
        for r in [*self.regrowths, *self.healings]:
            r.cancel()

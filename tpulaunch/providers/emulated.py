"""Emulated slices: Ray nodes on this machine, one per host. A lost host is started again by the
wait for its slice (`run.elastic.wait_whole`), as a repaired TPU VM rejoins: nothing to re-create."""

from __future__ import annotations

from tpulaunch.providers.base import Progress, Provider


class EmulatedProvider(Provider):
    kind = "emulated"

    def recreate_refusal(self) -> str | None:
        return ("--recreate makes real slices again (Cloud TPU, GKE); an emulated slice's lost hosts are started"
                " again without it")

    def down(self, progress: Progress) -> dict:
        """Its processes (those carrying its id) and its temp dir (if marked for it); the record."""
        from tpulaunch.cluster import emulated
        from tpulaunch.cluster.record import clear_record, record_path

        n = emulated.stop_cluster(self.info, record=str(record_path()))
        clear_record()
        return {"processes_stopped": n}

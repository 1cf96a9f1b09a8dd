"""Emulated slices: Ray nodes on this machine, one per host. A lost host is started again by the
wait for its slice (`run.recovery.elastic.wait_whole`), as a repaired TPU VM rejoins: nothing to re-create."""

from __future__ import annotations

import time

from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.providers.base import Progress, Provider, Recreation, Say


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

    def replace_refusal(self) -> str | None:
        return None if self.info.running_here else "the emulated cluster runs on another machine"

    def replace(self, names: list[str], why: str, deadline_s: float,
                say: Say) -> tuple[list[Recreation], list[SliceSpec]]:
        """Stop the slices' host nodes and start them again: a TPU VM replaced by a new one with the
        same identity (the run waits for them in Ray next)."""
        from tpulaunch.cluster import emulated

        info = self.info
        hosts = [(s.name, w.worker_id) for s in info.slices if s.name in names for w in s.workers]
        t = time.monotonic()
        n = emulated.stop_hosts(info, hosts)
        say(f"slice(s) {', '.join(names)}: stopped their {len(hosts)} host node(s) ({n} processes); starting new ones")
        emulated.restart_hosts(info, info.slices[0].to_topology(), hosts)
        took = time.monotonic() - t
        return [Recreation(name, "", why, {"replace_s": took}) for name in names], list(info.slices)

    def bring_back(self, lost: list[str], deadline_s: float, say: Say) -> tuple[list[Recreation], list[SliceSpec]]:
        """Start again the lost slices' hosts whose Ray node is gone (as a repaired TPU VM rejoins)."""
        from tpulaunch.cluster import emulated

        doc = self.status()
        alive = {(s["name"], h["worker_id"]) for s in doc["slices"] for h in s["hosts"] if h["alive"]}
        missing = [(s.name, w.worker_id) for s in self.info.slices if s.name in lost for w in s.workers
                   if (s.name, w.worker_id) not in alive]
        t = time.monotonic()
        if missing:
            say("starting the lost emulated host(s) again: " + ", ".join(f"{n} worker {w}" for n, w in missing))
            emulated.restart_hosts(self.info, self.info.slices[0].to_topology(), missing)
        return ([Recreation(n, "", "its hosts' Ray nodes were gone", {"restart_s": time.monotonic() - t})
                 for n in sorted({n for n, _w in missing})], list(self.info.slices))

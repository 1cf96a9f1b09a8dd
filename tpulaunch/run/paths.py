"""`RunPaths`: the one authority for where a run's files go.

    <log dir>/<run id>/
        summary.json                      what happened (written once, at the end)
        status.json                       where a detached run is (kept up to date by its supervisor)
        events.jsonl                      the run's timeline, appended as it goes (`run/timeline.py`)
        cluster.json                      the cluster it runs on (`tpulaunch stacks` finds it there)
        ray.log                           Ray's own output during the run
        attempt-<k>/host-<i>.log          everything host i printed in attempt k
        attempt-<k>/host-<i>.stacks.txt   py-spy dump of host i (timeouts, stalls)
        attempt-<k>/stacks-<time>/host-<i>.txt   `tpulaunch stacks` while it ran
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    root: Path  # <log dir>/<run id>

    @staticmethod
    def of(log_dir: str | Path) -> RunPaths:
        """The paths of the run whose directory is `log_dir` (`LaunchPlan.job.log_dir`)."""
        return RunPaths(Path(log_dir))

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def cluster(self) -> Path:
        return self.root / "cluster.json"

    @property
    def ray_log(self) -> Path:
        return self.root / "ray.log"

    def attempt(self, k: int) -> Path:
        return self.root / f"attempt-{k}"

    def host_log(self, k: int, process_index: int) -> Path:
        return self.attempt(k) / f"host-{process_index}.log"

    def host_stacks(self, k: int, process_index: int) -> Path:
        return self.attempt(k) / f"host-{process_index}.stacks.txt"

    def rank_log(self, k: int, process_index: int, rank: int) -> Path:
        """One process of a host that runs one per device (torch_tpu): `host-<i>/rank-<r>.log`."""
        return self.attempt(k) / f"host-{process_index}" / f"rank-{rank}.log"

    def stacks_dump(self, k: int, when: str) -> Path:
        """`tpulaunch stacks` while the run goes on: one directory per call."""
        return self.attempt(k) / f"stacks-{when}"

    @staticmethod
    def stacks_file(dump_dir: Path, process_index: int) -> Path:
        return dump_dir / f"host-{process_index}.txt"

"""Where slices come from, one provider each behind one seam (`base.Provider`): emulated on this
machine, TPU VMs through the Cloud TPU API, and GKE (KubeRay). `of(cluster)` is the one place that
tells them apart; run/ and cli/ ask the provider, never a concrete API."""

from __future__ import annotations

from tpulaunch.cluster.record import ClusterInfo
from tpulaunch.providers.base import Provider, Recreation, RejoinFailed


def of(info: ClusterInfo | None) -> Provider:
    """The provider of a cluster (a cluster given only by its address: the base, which can make nothing again)."""
    if info is not None and info.gke is not None:
        from tpulaunch.providers.gke import GkeProvider

        return GkeProvider(info)
    if info is not None and info.remote is not None:
        from tpulaunch.providers.tpu_vm import TpuVmProvider

        return TpuVmProvider(info)
    if info is None or info.emulated:
        from tpulaunch.providers.emulated import EmulatedProvider

        return EmulatedProvider(info)  # type: ignore[arg-type]  # None: no cluster, only its refusals are asked
    return Provider(info)


__all__ = ["Provider", "Recreation", "RejoinFailed", "of"]

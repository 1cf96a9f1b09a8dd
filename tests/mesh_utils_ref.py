"""JAX's own `mesh_utils` fed devices as a slice reports them: the reference our placement is held to.

Devices carry the chip coordinates, cores and worker order a TPU slice reports (the order
`jax.devices()` gives there: by process, chips x-fastest, cores innermost) and the `device_kind`
that selects mesh_utils' per-generation handlers. Shared by tests/unit/test_placement.py and
scripts/bench.d/mesh_scores.py.
"""

from __future__ import annotations

import numpy as np

from tpulaunch.plan.topology import Topology

# the device_kind each generation's devices report, as mesh_utils' handlers key them
KIND = {"v2": "TPU v2", "v3": "TPU v3", "v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5p",
        "v6e": "TPU v6 lite", "v7x": "TPU7x"}


class FakeTpuDevice:
    """What mesh_utils reads of a jax TPU device."""

    platform = "tpu"

    def __init__(self, id: int, coords: tuple, core_on_chip: int, device_kind: str, process_index: int,
                 slice_index: int = 0):
        self.id, self.coords, self.core_on_chip = id, coords, core_on_chip
        self.device_kind, self.process_index, self.slice_index = device_kind, process_index, slice_index


def devices(t: Topology, num_slices: int = 1) -> list[FakeTpuDevice]:
    kind = KIND[t.generation.name]
    out = []
    for s in range(num_slices):
        for i, (w, chip, core) in enumerate(t.iter_devices()):
            out.append(FakeTpuDevice(s * t.devices + i, tuple(chip), core, kind, s * t.num_hosts + w, s))
    return out


def _mesh_utils():
    """JAX's module, imported when first asked for: importing JAX costs 1.3 CPU-s, which every pytest
    process of `./scripts/test` would otherwise spend collecting the suite."""
    from jax._src import mesh_utils

    return mesh_utils


def jax_ids(t: Topology, shape: tuple[int, ...], **kw) -> np.ndarray | None:
    """mesh_utils' layout of one slice as plan device ids, or None where it builds none."""
    try:
        mesh = _mesh_utils().create_device_mesh(shape, devices(t), **kw)
    except (NotImplementedError, ValueError, AssertionError, TypeError):
        return None  # refused (TypeError: its split-axes search fails on a dimension with a factor 7, as 4x4x28)
    return np.vectorize(lambda d: d.id)(mesh)


def hybrid(t: Topology, ici_shape: tuple[int, ...], dcn_shape: tuple[int, ...], num_slices: int) -> np.ndarray:
    """mesh_utils' hybrid (multislice) mesh, as FakeTpuDevices."""
    return _mesh_utils().create_hybrid_device_mesh(ici_shape, dcn_shape, devices(t, num_slices),
                                                allow_split_physical_axes=True)


def no_worse(ours: list, theirs: list) -> bool:
    """Innermost axis first; where it ties, the total."""
    a = [h for h in ours if h is not None]
    b = [h for h in theirs if h is not None]
    if abs(a[-1] - b[-1]) > 1e-9:
        return a[-1] < b[-1]
    return sum(a) <= sum(b) + 1e-9

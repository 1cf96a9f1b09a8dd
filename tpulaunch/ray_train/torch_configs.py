"""The torch configs of `tpulaunch.ray_train` (`TorchTrainer(torch_config=...)`), apart because a
`TorchConfig` cannot be defined without importing torch; the package imports them on first use."""

from __future__ import annotations

from dataclasses import dataclass

from ray.train.torch import TorchConfig

from tpulaunch.ray_train.backends import _SliceOptions, _TorchTpuBackend, _TorchXlaBackend


@dataclass
class XlaSpmdConfig(_SliceOptions, TorchConfig):
    """`TorchTrainer(torch_config=XlaSpmdConfig())`: torch_xla SPMD on the slice, mesh ready.

    `mesh` / `dcn` take the CLI's syntax (`data=4,model=4`; `data=2` across slices). `env` is
    added to every worker's environment. `compile_cache`: True for tpulaunch's default directory
    on each host, a path, or False.
    """

    backend: str | None = "xla-spmd"  # anything but empty: TorchTrainer would pick "tpu_dist"

    @property
    def backend_cls(self) -> type:
        return _TorchXlaBackend


@dataclass
class TorchTpuConfig(_SliceOptions, TorchConfig):
    """`TorchTrainer(torch_config=TorchTpuConfig())`: TorchTPU, one worker per TPU device.

    What Ray Train leaves out, supplied as `tpulaunch run --framework torch_tpu` does: ranks grouped
    by host in slice-builder address order (not Ray's placement order), `TORCH_TPU_TOPOLOGY`,
    `TORCH_TPU_SLICEBUILDER_ADDRESSES`, `TORCH_TPU_DEVICES_PER_HOST`, multislice `MEGASCALE_*`
    with the coordinator's port; the default group is open (`tpu_dist`, gloo emulated) and
    `tpulaunch.get_mesh()` is the planned `DeviceMesh`. Use `resources_per_worker={"TPU": 1}` and
    `num_workers` = devices of every slice.
    """

    backend: str | None = "tpulaunch-torch-tpu"  # anything but empty: TorchTrainer would pick "tpu_dist"

    @property
    def backend_cls(self) -> type:
        return _TorchTpuBackend

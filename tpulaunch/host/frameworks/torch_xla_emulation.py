"""What an emulated torch_xla host answers, so a script sees what it would see on the slice.

An emulated host is one CPU process holding the whole slice's devices (several CPU processes
cannot form one XLA runtime), so left alone every host would call itself process 0 of 1. On the
slice, libtpu forms one runtime over all hosts. `install()` makes the runtime's answers those
of host `i` of `N`; the README's emulation section lists them:

| query | real slice | emulated host, after `install()` |
| --- | --- | --- |
| `xr.process_index()` / `xr.process_count()` | `i` / `N` (libtpu) | `i` / `N` |
| `xr.host_index()` | the TPU worker id | the TPU worker id |
| `xr.addressable_runtime_device_count()` | devices of one host | devices of one host |
| `xr.global_runtime_device_count()` | devices of the slice | devices of the slice (unchanged) |
| `xr.get_master_ip()` | host 0's IP (found by an SPMD computation) | host 0's IP (from the plan) |

Per-host input (`ShardingSpec(..., minibatch=True)` in `MpDeviceLoader` / `ParallelLoader` /
`xm.send_cpu_data_to_device`): on the slice each host uploads its own rows and the runtime
assembles the global batch. Here each host holds every device, so the hosts' local batches are
all-gathered over a private gloo group and the global batch is uploaded whole, each host's rows
in the blocks its own devices hold (as the runtime places them on the slice; process order where
hosts share a block): every emulated host computes on the same global batch the slice would. The per-host divisibility
check torch_xla makes on the slice is made here too.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpulaunch.plan.contract import HostState


def _answer(original: Callable[..., Any], value: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def emulated(*_args: Any, **_kwargs: Any) -> Any:
        return value

    return emulated


def install(state: HostState) -> None:
    """Patch torch_xla's runtime queries and minibatch upload for emulated host `state`."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    coordinator_host = state.endpoints.host
    answers = {
        "process_index": state.process_index,
        "process_count": state.num_processes,
        "host_index": state.worker_id,
        "addressable_runtime_device_count": state.mesh.topology.devices_per_host,
        "get_master_ip": coordinator_host,
    }
    for name, value in answers.items():
        if hasattr(xr, name):
            setattr(xr, name, _answer(getattr(xr, name), value))
    gather = _MinibatchGather(state)
    xm.send_cpu_data_to_device = _minibatch_as_global(xm.send_cpu_data_to_device, gather, xm)


class _MinibatchGather:
    """All-gathers each host's local batch over a private gloo group (opened on first use)."""

    def __init__(self, state: HostState) -> None:
        self.state = state
        self.devices_per_host = state.mesh.topology.devices_per_host
        self._group: Any = None
        self._lock = threading.Lock()

    def _pg(self) -> Any:
        if self._group is None:
            import torch.distributed as dist

            from tpulaunch.host.frameworks.torch_dist import dist_timeout

            ends = self.state.endpoints
            if ends.emulation_port is None:
                raise RuntimeError("tpulaunch planned no store for the emulated hosts' per-host input")
            store = dist.TCPStore(ends.host, ends.emulation_port, self.state.num_processes,
                                  self.state.process_index == 0, timeout=dist_timeout())
            self._group = dist.ProcessGroupGloo(dist.PrefixStore("tpulaunch-minibatch", store),
                                                self.state.process_index, self.state.num_processes,
                                                dist_timeout())
            self._store = store  # keep the server (host 0) alive as long as the group
        return self._group

    def global_batch(self, local: Any, spec: Any) -> Any:
        import torch

        if not spec.can_apply(local) or local.dim() == 0:
            return local  # torch_xla uploads these as they are (replicated) on the slice too
        if local.size(0) % self.devices_per_host:
            raise RuntimeError(
                "When minibatch is configured, the per-host batch size must be divisible by local runtime"
                f" device count. Per host input data shape = {local.size()}, local_runtime_device_count ="
                f" {self.devices_per_host}")
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.state.num_processes)]
        with self._lock:
            self._pg().allgather([parts], [local]).wait()
        owners = _row_owners(spec, self.devices_per_host)
        if owners is None:
            return torch.cat(parts, dim=0)
        chunks = {p: list(parts[p].chunk(owners.count(p), dim=0)) for p in set(owners)}
        return torch.cat([chunks[p].pop(0) for p in owners], dim=0)


def _row_owners(spec: Any, devices_per_host: int) -> list[int] | None:
    """The process whose devices hold each block of rows (dim 0) under `spec`, or None.

    On the slice each host's local rows go, in order, to the blocks its own devices hold; the
    global batch is those blocks in mesh order. None where that is not one host per block (the
    rows are not sharded, or hosts share a block): then the rows stay in process order.
    """
    import numpy as np

    if not spec.partition_spec or spec.partition_spec[0] is None:
        return None
    tiles = np.asarray(spec._tile_assignment)
    hosts = tiles.reshape(tiles.shape[0], -1) // devices_per_host
    if not (hosts == hosts[:, :1]).all():
        return None
    owners = [int(h) for h in hosts[:, 0]]
    counts = {owners.count(p) for p in set(owners)}
    return owners if len(counts) == 1 else None


def _minibatch_as_global(original: Callable[..., Any], gather: _MinibatchGather, xm: Any) -> Callable[..., Any]:
    plain_specs: dict[int, Any] = {}

    def without_minibatch(spec: Any) -> Any:
        if id(spec) not in plain_specs:
            plain = copy.copy(spec)
            plain.minibatch = False
            plain_specs[id(spec)] = (spec, plain)  # keep `spec` alive so its id stays unique
        return plain_specs[id(spec)][1]

    @functools.wraps(original)
    def send_cpu_data_to_device(datas: Any, device: Any, input_sharding: Any = None) -> Any:
        if input_sharding is None or not getattr(input_sharding, "minibatch", False):
            return original(datas, device, input_sharding)
        import torch

        def to_global(tensors: list) -> list:
            return [gather.global_batch(t, input_sharding) for t in tensors]

        def is_cpu_tensor(v: Any) -> bool:
            return type(v) is torch.Tensor and v.device.type == "cpu"

        if type(datas) is torch.Tensor:
            datas = [datas]
        global_datas = xm.ToXlaTensorArena(to_global, is_cpu_tensor).transform(datas)
        return original(global_datas, device, without_minibatch(input_sharding))

    return send_cpu_data_to_device

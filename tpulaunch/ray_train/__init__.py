"""Ray Train on TPU slices: `TorchTrainer` / `JaxTrainer` workers booted as `tpulaunch run` boots hosts.

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from tpulaunch.ray_train import XlaSpmdConfig

    TorchTrainer(train_fn, torch_config=XlaSpmdConfig(mesh="data=4,model=4"), scaling_config=ScalingConfig(
        num_workers=4, use_tpu=True, topology="2x8", accelerator_type="TPU-V6E", resources_per_worker={"TPU": 4}))

Inside `train_fn`, `tpulaunch.get_mesh()` and `tpulaunch.context()` work as under `tpulaunch run`.

Ray Train places one worker per TPU host and ranks them in placement order, which is not the TPU
worker id. When the worker group is up, the backend (in Ray Train's controller) asks every worker
for its node's TPU labels, builds the slices from them, and plans the launch with the code
`tpulaunch run` uses (`plan_mesh`, `build_plan`): process index = the TPU worker id (slice-major
on multislice), never Ray's rank. Each worker then gets its host's environment and HostState and
boots exactly as a host process does (`host.bootstrap.boot`: SPMD mode, the slice's gloo group or
`jax.distributed`, the mesh from the plan, `context()`). On an emulated cluster (no TPU devices on
the workers) the workers emulate their hosts on CPU, as `tpulaunch run` does.

A worker group that Ray Train restarts (`FailureConfig(max_failures=N)`) is planned and booted
again, with `context().restart_count` counting up. A worker that cannot boot fails the run with
tpulaunch's one-line reason (Ray does not retry a failed backend start).

Needs `pip install 'tpulaunch[raytrain]'`; `import tpulaunch` does not import this package.
`planning` plans a worker group from what its workers report (pure: no Ray); `backends` asks the
workers, boots them and holds `JaxSpmdConfig`; the torch configs are in `torch_configs` (a
`TorchConfig` cannot be defined without importing torch). The configs are imported here on first
use: planning alone imports no Ray Train, and a `JaxTrainer`'s driver, controller and workers never
import torch (4.5 CPU-s each on 2-core machines, and a JAX-only environment has none).
"""

from __future__ import annotations

from typing import Any

from tpulaunch.ray_train.planning import WorkerFacts, local_indices, plan_for_workers

__all__ = ["JaxSpmdConfig", "SliceSetupError", "TorchTpuConfig", "WorkerFacts", "XlaSpmdConfig", "local_indices",
           "plan_for_workers"]


def __getattr__(name: str) -> Any:
    """The configs and `SliceSetupError` (Ray Train's, and torch's for the torch configs): imported on
    first use."""
    if name in ("XlaSpmdConfig", "TorchTpuConfig"):
        from tpulaunch.ray_train import torch_configs

        return getattr(torch_configs, name)
    if name in ("JaxSpmdConfig", "SliceSetupError"):
        from tpulaunch.ray_train import backends

        return getattr(backends, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

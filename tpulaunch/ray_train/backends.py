"""Ray Train backends for TPU slices: ask each worker where it runs, plan the group as that slice
(`planning.plan_for_workers`), boot each worker as the slice's host (see the package's docstring),
and `JaxSpmdConfig`."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
from ray.train.backend import Backend
from ray.train.v2.jax.config import JaxConfig

from tpulaunch.discover.ray_labels import POD_TYPE, SLICE, TOPO, WORKER
from tpulaunch.errors import ExitCode, TpulaunchError
from tpulaunch.host import frameworks
from tpulaunch.plan import torch_tpu
from tpulaunch.plan.contract import HostState
from tpulaunch.plan.env import PLAN_MULTISLICE_ENV, host_env
from tpulaunch.plan.launch import new_run_id
from tpulaunch.plan.mesh import check_placement, parse_axes
from tpulaunch.ray_train.planning import WorkerFacts, local_indices, plan_for_workers

SHUTDOWN_TIMEOUT_S = 30.0


class SliceSetupError(TpulaunchError):
    """The worker group could not become the slice: not one worker per host, or a worker could not
    boot (its runtime, its mesh, its TPU). Raised in Ray Train's controller; the driver sees it."""

    exit_code = ExitCode.BOOT_FAILED


# -- what runs in the workers ------------------------------------------------------------------


def _worker_facts() -> WorkerFacts:
    from pathlib import Path

    from tpulaunch.host.tpu_holders import tpu_devices

    rc = ray.get_runtime_context()
    labels = {k: _label_value(v) for k, v in dict(rc.get_node_labels()).items()}
    worker = labels.get(WORKER) or os.environ.get("TPU_WORKER_ID")
    return WorkerFacts(
        rank=ray.train.get_context().get_world_rank(), ip=ray.util.get_node_ip_address(),
        slice_name=labels.get(SLICE) or os.environ.get("TPU_NAME"),
        worker_id=int(worker) if worker not in (None, "") else None,
        pod_type=labels.get(POD_TYPE) or os.environ.get("TPU_ACCELERATOR_TYPE"),
        topology=labels.get(TOPO) or os.environ.get("TPU_TOPOLOGY"),
        tpu_devices=bool(tpu_devices(Path("/"))),
    )


def _label_value(value: str | list[str]) -> str | None:
    """A node label's value: Ray annotates a list (of one); it may give the string itself."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


def _free_ports(n: int) -> list[int]:
    from tpulaunch.cluster.ports import free_ports

    return free_ports(n)


def _storage_path() -> str:
    try:
        return str(ray.train.get_context().get_storage().experiment_fs_path)
    except Exception:  # only a place context().log_dir points at
        return ""


def _boot_worker(state_blob: bytes, env: dict[str, str], local_index: int | None = None) -> str | None:
    """Become the host `state` describes. Returns None, or the one-line reason it could not."""
    import traceback

    from tpulaunch.host import bootstrap, tpu_holders
    from tpulaunch.host.environment import layered

    state: HostState = pickle.loads(state_blob)
    for key in PLAN_MULTISLICE_ENV:  # the node's own (a multislice pod's) are not this run's slices
        os.environ.pop(key, None)
    os.environ.update(layered(os.environ, env, state))  # the node's XLA_FLAGS stay under an emulation's
    try:
        if not state.emulated:
            report = tpu_holders.scan()
            if not report.clean:
                who = "; ".join(f"pid {h.pid} ({h.cmdline[:80]}) holds {', '.join(h.paths)}" for h in report.holders)
                return (f"the TPU on this host is busy: {who or f'stale lockfile {report.lockfile}'}."
                        " Clear it with `tpulaunch cluster doctor --kill-stale`")
        bootstrap.boot(state, local_index)
    except TpulaunchError as e:
        return e.line()
    except Exception as e:  # the reason goes to the driver, the traceback to the worker log
        traceback.print_exc()
        return f"framework boot failed: {type(e).__name__}: {e}"
    return None


def _shutdown_worker(framework: str) -> None:
    frameworks.get(framework).shutdown()


# -- the backends ------------------------------------------------------------------------------


class _SliceBackend(Backend):
    """Plans the slice from the workers' labels and boots each worker as its TPU host.

    One instance lives in Ray Train's controller for the whole `fit()`: `on_start` runs again for
    each worker group a restart brings up, so the attempt number and run id live here.
    """

    framework = "torch_xla"

    def __init__(self) -> None:
        self._run_id = new_run_id()
        self._attempt = -1

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        self._attempt += 1
        try:
            self._boot_all(worker_group, backend_config)
        except TpulaunchError as e:
            # Ray 2.60 leaks a worker group whose backend fails to start: it already counts as
            # started, so neither its builder nor the controller shuts it down, and the slice stays
            # reserved (a second fit() in the same driver then waits forever). Release it here.
            try:
                worker_group.shutdown()
            except Exception:  # the reason below matters more
                pass
            raise SliceSetupError(f"tpulaunch: {e.line()}") from None

    def _boot_all(self, worker_group: Any, backend_config: Any) -> None:
        facts: list[WorkerFacts] = worker_group.execute(_worker_facts)
        args = dict(framework=self.framework, mesh=backend_config.mesh, dcn=backend_config.dcn,
                    placement=backend_config.placement,
                    run_id=self._run_id, attempt=self._attempt, compile_cache=backend_config.compile_cache)
        _, states = plan_for_workers(facts, ports=[0, 0, 0], **args)  # checks the workers, finds process 0
        zero = next(rank for rank, state in states.items() if state.process_index == 0)
        # process 0 hosts the coordinators: their ports must be free on its node
        ports = worker_group.execute_single(zero, _free_ports, 3)
        plan, states = plan_for_workers(facts, ports=ports, log_dir=worker_group.execute_single(zero, _storage_path),
                                        **args)
        local = local_indices(facts) if self.per_device else {}
        futures = {rank: worker_group.execute_single_async(
            rank, _boot_worker, pickle.dumps(state), {**host_env(state), **self._process_env(state, local.get(rank)),
                                                      **backend_config.env}, local.get(rank))
            for rank, state in states.items()}
        failed = []
        for rank, fut in sorted(futures.items(), key=lambda kv: states[kv[0]].process_index):
            reason = ray.get(fut)
            if reason:
                s = states[rank]
                failed.append(f"host {s.process_index} (slice {s.slice_name} worker {s.worker_id},"
                              f" Ray Train rank {rank}): {reason}")
        if failed:
            more = f" (and {len(failed) - 1} more host(s))" if len(failed) > 1 else ""
            raise SliceSetupError(failed[0] + more)

    per_device = False  # one worker per TPU device (torch_tpu), else one per host

    @staticmethod
    def _process_env(state: HostState, local: int | None) -> dict[str, str]:
        return {} if local is None else torch_tpu.processes(state)[local].env

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        futures = worker_group.execute_async(_shutdown_worker, self.framework)
        ray.wait(futures, num_returns=len(futures), timeout=SHUTDOWN_TIMEOUT_S)


class _TorchXlaBackend(_SliceBackend):
    framework = "torch_xla"


class _JaxBackend(_SliceBackend):
    framework = "jax"


class _TorchTpuBackend(_SliceBackend):
    framework = "torch_tpu"
    per_device = True


def _check_axes(mesh: str | None, dcn: str | None, placement: str = "auto") -> None:
    """Bad mesh syntax fails on the driver, before Ray Train starts anything."""
    check_placement(placement)
    if mesh:
        parse_axes(mesh)
    if dcn:
        parse_axes(dcn, "--dcn")


@dataclass
class _SliceOptions:
    """What both configs add to Ray's: the mesh (the CLI's syntax), worker env, compile cache."""

    mesh: str | None = None
    dcn: str | None = None
    env: dict | None = None
    compile_cache: Any = True
    placement: str = "auto"  # how the mesh is laid onto the chips, as `--placement`

    def __post_init__(self) -> None:
        _check_axes(self.mesh, self.dcn, self.placement)
        self.env = dict(self.env or {})

    def to_dict(self) -> dict[str, Any]:
        # a mixin: the Ray config after it in each config's MRO (JaxConfig, TorchConfig) has to_dict
        base = super().to_dict()  # type: ignore[misc]  # (mypy sees only `object` above the mixin)
        return {**base, "mesh": self.mesh, "dcn": self.dcn, "placement": self.placement}


@dataclass
class JaxSpmdConfig(_SliceOptions, JaxConfig):
    """`JaxTrainer(jax_config=JaxSpmdConfig())`: `jax.distributed` over the slice, mesh ready."""

    use_tpu: bool = True

    @property
    def backend_cls(self) -> type:
        return _JaxBackend

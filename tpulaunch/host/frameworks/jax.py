"""JAX multi-controller adapter: `jax.distributed.initialize`, then a `jax.sharding.Mesh`.

One process per TPU host drives all of the host's chips. Boot joins every host's process into
one JAX runtime with explicit coordinates (coordinator, process count, process id = TPU worker id,
plus `slice * hosts_per_slice` on multislice), never JAX's own cluster auto-detection: the
launch plan, not the environment, decides who is who.

Emulation is real multi-process JAX: each emulated host holds exactly its own chips' worth of
CPU devices (`--xla_force_host_platform_device_count`), `jax.distributed.initialize` joins the
hosts, and gloo carries the cross-host collectives. So `jax.device_count()` is the slice's
device count and `jax.local_device_count()` is one host's, as on the TPU.

Stopping: once initialized, JAX's preemption notifier catches SIGTERM (so training code can reach
a preemption sync point and checkpoint). tpulaunch leaves that alone; a host it stops may need the
SIGKILL that follows the grace period (exit 137 rather than 143).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, Any, TypedDict

from tpulaunch import settings
from tpulaunch.errors import LaunchError, MeshMismatchError

if TYPE_CHECKING:
    from tpulaunch.plan.contract import HostState
    from tpulaunch.plan.mesh import MeshPlan
    from tpulaunch.plan.topology import Topology


class _Bind(TypedDict, total=False):
    """What `jax.distributed.initialize` is given of where its coordinator listens (nothing: JAX's default)."""

    coordinator_bind_address: str


class Jax:
    name = "jax"
    _initialized = False

    def emulation_env(self, topology: Topology, num_slices: int) -> dict[str, str]:
        return {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={topology.devices_per_host}",
            "PJRT_DEVICE": "CPU",  # harmless for JAX; keeps torch_xla (if imported too) off the TPU path
        }

    def preload(self) -> None:
        import jax
        import jax.numpy
        import jax.sharding  # noqa: F401 - preload: importing is the point

    def boot(self, state: HostState) -> None:
        import jax

        if state.job.compile_cache:
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(state.job.compile_cache))
            if state.emulated:  # CPU compilations are quick; cache them anyway
                jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
            # gloo carries cross-process collectives between CPU devices (emulation); on a TPU it
            # only affects the host CPU backend. Must be set before the backends start.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if state.num_processes > 1:
            address = state.endpoints.jax_address
            if not address:
                raise LaunchError(
                    "this launch planned no JAX coordinator",
                    "launch JAX scripts with --framework jax (or auto), which plans the JAX coordinator",
                )
            # an emulated slice's hosts are this machine: its coordinator listens on loopback only
            # (JAX's default is every interface)
            bind: _Bind = {"coordinator_bind_address": address} if state.job.local else {}
            jax.distributed.initialize(
                coordinator_address=address,
                num_processes=state.num_processes,
                process_id=state.process_index,
                cluster_detection_method="deactivate",  # every value is explicit; detect nothing
                initialization_timeout=int(settings.seconds("TPULAUNCH_JAX_INIT_TIMEOUT",
                                                            settings.host_seconds("TPULAUNCH_DIST_TIMEOUT"))),
                **bind,
            )
            self._initialized = True
            _adopt_user_initialize(self, state)
        if jax.process_count() != state.num_processes or jax.process_index() != state.process_index:
            raise MeshMismatchError(
                f"JAX reports process {jax.process_index()} of {jax.process_count()},"
                f" but tpulaunch launched process {state.process_index} of {state.num_processes}",
                "the slice tpulaunch planned is not the slice JAX sees; check --tpu/--topology",
            )

    def build_mesh(self, plan: MeshPlan, state: HostState) -> Any:
        import jax
        import numpy as np
        from jax.sharding import Mesh

        devices = jax.devices()
        if len(devices) != plan.num_devices:
            raise MeshMismatchError(
                f"JAX has {len(devices)} devices but the planned mesh"
                f" {dict(zip(plan.axis_names, plan.shape, strict=True))} needs {plan.num_devices}",
                "the slice does not match --topology/--num-slices",
            )
        local = jax.local_device_count()
        if local != plan.topology.devices_per_host:
            raise MeshMismatchError(
                f"JAX has {local} devices on this host but a {plan.topology.accelerator_type} host"
                f" holds {plan.topology.devices_per_host}",
                "the slice does not match --topology/--accelerator",
            )
        order = device_order(plan, [device_attributes(d) for d in devices])
        grid = np.array([devices[i] for i in order], dtype=object).reshape(plan.shape)
        return Mesh(grid, plan.axis_names)

    def leaving_after_failure(self) -> None:
        """A failed host's exit does not wait for hosts that will not come: JAX's own atexit handler
        (`jax._src.api.clean_up`) ends in `jax.distributed.shutdown()`, a barrier with every host,
        which the others (still in their steps, soon stopped) never reach. The script's own
        handlers still run."""
        api = sys.modules.get("jax._src.api")
        clean_up = getattr(api, "clean_up", None)
        if clean_up is not None:
            import atexit

            atexit.unregister(clean_up)

    def shutdown(self) -> None:
        """`jax.distributed.shutdown()` (a barrier with every host), bounded in time."""
        if not self._initialized:
            return
        self._initialized = False
        timeout = settings.host_seconds("TPULAUNCH_JAX_SHUTDOWN_TIMEOUT")

        def _shutdown() -> None:
            try:
                import jax

                jax.distributed.shutdown()
            except Exception as e:  # best effort on the way out
                print(f"tpulaunch: jax.distributed.shutdown failed: {e}", file=sys.stderr)

        t = threading.Thread(target=_shutdown, name="tpulaunch-jax-shutdown", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            print(f"tpulaunch: jax.distributed.shutdown did not finish in {timeout:g} s; leaving anyway",
                  file=sys.stderr)


def _adopt_user_initialize(adapter: Jax, state: HostState) -> None:
    """A script's own `jax.distributed.initialize()` finds the slice's runtime already joined.

    JAX allows one initialize per process, before any backend use; tpulaunch has made it (with the
    plan's coordinator, process count and id). The script's call, with no arguments as Google's
    TPU docs show or with explicit ones that agree with the plan, returns at once; arguments that
    contradict the plan (another process count or id) are an error that says so, and a second
    call fails as it would on a TPU host. The script's
    own `jax.distributed.shutdown()` runs as usual, and tpulaunch then does not shut down again.
    """
    import functools
    import inspect

    import jax

    original_init, original_shutdown = jax.distributed.initialize, jax.distributed.shutdown
    signature = inspect.signature(original_init)

    calls: list[bool] = []

    @functools.wraps(original_init)
    def initialize(*args: Any, **kwargs: Any) -> None:
        if not adapter._initialized:
            return original_init(*args, **kwargs)
        if calls:
            raise RuntimeError("distributed.initialize should only be called once.")  # as JAX says
        calls.append(True)
        given = signature.bind_partial(*args, **kwargs).arguments
        wrong = [f"{k}={given[k]}" for k, ours in (("num_processes", state.num_processes),
                                                   ("process_id", state.process_index))
                 if given.get(k) is not None and int(given[k]) != ours]
        if wrong:
            raise RuntimeError(
                f"jax.distributed.initialize({', '.join(wrong)}) contradicts the slice tpulaunch launched:"
                f" this host is process {state.process_index} of {state.num_processes}")
        return None

    @functools.wraps(original_shutdown)
    def shutdown() -> None:
        adapter._initialized = False
        return original_shutdown()

    jax.distributed.initialize = initialize
    jax.distributed.shutdown = shutdown


def device_attributes(device: Any) -> dict:
    """The facts of one `jax.Device` the mapping needs, as plain data."""
    out = {"id": int(device.id), "process_index": int(device.process_index), "platform": device.platform}
    coords = getattr(device, "coords", None)
    if coords is not None:
        out["coords"] = tuple(int(c) for c in coords)
        out["core_on_chip"] = int(getattr(device, "core_on_chip", 0) or 0)
        out["slice_index"] = int(getattr(device, "slice_index", 0) or 0)
    return out


def device_order(plan: MeshPlan, attributes: list[dict]) -> list[int]:
    """Indices into `attributes` (one dict per `jax.devices()` entry) in row-major mesh order.

    TPU devices carry `coords`, `core_on_chip` and `slice_index`: we match on those, so the mesh
    is right whatever order JAX lists them in, and check that each device belongs to the process
    the plan put it on. CPU devices (emulation) carry no coordinates: plan device `d` of process
    `p` is the `d - p * devices_per_host`-th device of process `p`, by device id.
    """
    dph = plan.topology.devices_per_host
    out: list[int] = []
    if attributes and "coords" in attributes[0]:
        for dev_id, i in zip(plan.device_ids(), plan.match_physical(attributes, "JAX"), strict=True):
            d = plan.device(dev_id)
            if attributes[i]["process_index"] != d.process:
                raise MeshMismatchError(
                    f"planned device {dev_id} (slice {d.slice}, chip {d.chip}) belongs to JAX process"
                    f" {attributes[i]['process_index']}, but the plan puts it on process {d.process}",
                    "TPU worker ids and JAX process ids disagree; check the slice's worker order",
                )
            out.append(i)
        return out
    by_process: dict[int, list[int]] = {}
    for i, a in enumerate(attributes):
        by_process.setdefault(a["process_index"], []).append(i)
    for p in by_process:
        by_process[p].sort(key=lambda i: attributes[i]["id"])
    for dev_id in plan.device_ids():
        d = plan.device(dev_id)
        k = dev_id - d.process * dph
        mine = by_process.get(d.process, [])
        if not 0 <= k < len(mine):
            raise MeshMismatchError(
                f"planned device {dev_id} is device {k} of process {d.process}, which has {len(mine)} device(s)",
                "the runtime's devices per host do not match the plan; check --topology",
            )
        out.append(mine[k])
    return out


ADAPTER = Jax()

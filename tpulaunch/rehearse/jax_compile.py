"""Every JAX program compiled for the target TPU before the CPU compiles (and so runs) it.

Runs inside the rehearsal process (`rehearse.child`). JAX lowers each `jit` program once
(`pxla.lower_sharding_computation`, behind `jit`'s caches) and compiles it once
(`MeshComputation.compile`); both are wrapped:

* at lowering, the arguments are kept on the computation;
* at its compile, the same jaxpr is lowered again with the TPU's lowering rules (`lowering_platforms
  =("tpu",)`: Pallas kernels go through Mosaic, not the CPU interpreter), with the same shardings,
  and compiled by libtpu's compile-only client for the libtpu devices the program's CPU devices
  stand for (CPU device `i` is plan device `i`; `target.device_map` matches it to libtpu's device
  by slice, chip coordinates and core). Sharding annotations name positions in the device
  assignment, so the program is partitioned over the same mesh, device for device.

What libtpu returns (memory per device, the compiled HLO's collectives) or refuses is recorded;
a program that would not fit or compile stops the process (`os._exit`, exit 88) before the CPU
compiles it. Programs lowered for named platforms (`jax.export`, `.lower(lowering_platforms=...)`)
are none the CPU runs and are not rehearsed.

Depends on JAX internals (`pxla.lower_sharding_computation`, `MeshComputation.compile`,
`pxla.create_compile_options`, `compiler.backend_compile_and_load`), as they are in JAX 0.10;
`install` checks that they are there and says so if a JAX has moved them.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tpulaunch.errors import ExitCode, LaunchError
from tpulaunch.rehearse.report import Program, collectives

_PENDING = "_tpulaunch_rehearsal"  # attribute on a MeshComputation: how it was lowered


class TpuTarget:
    """libtpu's description of the plan's slices, and its devices in plan device order."""

    def __init__(self, plan: Any, args: dict) -> None:  # plan: MeshPlan
        from jax.experimental import topologies

        from tpulaunch.host.frameworks.jax import device_attributes
        from tpulaunch.rehearse.target import device_map

        devices: list[Any] = list(topologies.get_topology_desc(**args).devices)  # jaxlib's Device: a C type, no stubs
        self.by_plan_id = [devices[i] for i in device_map(plan, [device_attributes(d) for d in devices])]
        self.client = devices[0].client
        self.device_kind = devices[0].device_kind


def first_line(text: str, limit: int = 600) -> str:
    """An error's first meaningful line (libtpu's messages run to pages)."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    line = (lines[0] if lines else "no message").rstrip(".")
    return line if len(line) <= limit else line[:limit] + " ..."


def compile_for_tpu(target: TpuTarget, lower: Callable[..., Any], args: tuple, kwargs: dict,
                    cpu_devices: Any) -> Program:
    """Lower the program again for TPU and compile it with libtpu for the mapped devices."""
    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client as xc
    from jax.errors import JaxRuntimeError

    name = str(args[2])
    t0 = time.monotonic()
    n = len(cpu_devices) if cpu_devices is not None else 0
    ca: dict = {}  # the TPU lowering's compile arguments, once there is one
    try:
        comp = lower(*args, **{**kwargs, "lowering_platforms": ("tpu",)})
        ca = comp.compile_args
        devices = cpu_devices if cpu_devices is not None else comp._device_list
        n = len(devices)
        tpu = tuple(target.by_plan_id[d.id] for d in devices)
        to_inputs, to_outputs = pxla.get_prop_to_input_output(
            ca["in_shardings"], ca["out_shardings"], len(ca["ordered_effects"]))
        options = pxla.create_compile_options(
            comp._hlo, ca["tuple_args"], to_inputs, to_outputs, target.client,
            np.array(tpu, dtype=object), dict(comp._compiler_options_kvs))
        exe = compiler.backend_compile_and_load(target.client, comp._hlo, xc.DeviceList(tpu), options, [])
        m = exe.get_compiled_memory_stats()
        text = "\n".join(h.to_string() for h in exe.hlo_modules())
        return Program(name, n, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                       m.temp_size_in_bytes, m.generated_code_size_in_bytes, collectives(text),
                       round(time.monotonic() - t0, 3))
    except (JaxRuntimeError, NotImplementedError) as e:  # libtpu's refusal, or no TPU lowering: the finding
        return Program(name, n, per_device_bytes(ca.get("global_in_avals", ()), ca.get("in_shardings", ())),
                       per_device_bytes(ca.get("global_out_avals", ()), ca.get("out_shardings", ())),
                       compile_s=round(time.monotonic() - t0, 3), error=first_line(str(e)))


def per_device_bytes(avals: Any, shardings: Any) -> int:
    """The bytes of one device's shards of these arrays (the whole array where XLA chooses the
    sharding): what the program's arguments or outputs hold, when libtpu gives no figures."""
    import math

    total = 0
    # Not strict: a best-effort figure on the error path (`compile_for_tpu` passes `()` for a missing key).
    for aval, sharding in zip(avals, shardings, strict=False):
        try:
            shape = sharding.shard_shape(aval.shape) if hasattr(sharding, "shard_shape") else aval.shape
            total += math.prod(shape) * aval.dtype.itemsize
        except Exception:  # a token, a key type: no bytes to count
            continue
    return total


def install(target: TpuTarget, record: Callable[[Program], str | None]) -> None:
    """Wrap JAX's lowering and compile; `record` gets each program and returns a stop line or None."""
    from jax._src.interpreters import pxla

    lower = getattr(pxla, "lower_sharding_computation", None)
    compile_ = getattr(getattr(pxla, "MeshComputation", None), "compile", None)
    if lower is None or compile_ is None or not hasattr(pxla, "create_compile_options"):
        import jax

        raise LaunchError(f"--rehearse cannot reach JAX {jax.__version__}'s compile step (it knows JAX 0.10's)",
                          "install the JAX that tpulaunch[rehearse] pins")
    lock = threading.Lock()

    def lowering(*args: Any, **kwargs: Any) -> Any:
        comp = lower(*args, **kwargs)
        if kwargs.get("lowering_platforms") is None:
            setattr(comp, _PENDING, (args, kwargs))
        return comp

    def compiling(self: Any, compiler_options: Any = None, *, device_assignment: Any = None) -> Any:
        pending = self.__dict__.pop(_PENDING, None)
        if pending is not None:
            from jax._src.interpreters.pxla import _create_device_list

            devices = _create_device_list(device_assignment) or self._device_list
            program = compile_for_tpu(target, lower, pending[0], pending[1], devices)
            with lock:
                stop = record(program)
            if stop:
                print(f"tpulaunch: {stop}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(ExitCode.REHEARSAL)  # nothing of the script runs on: the CPU never compiles it
        return compile_(self, compiler_options, device_assignment=device_assignment)

    pxla.lower_sharding_computation = lowering
    pxla.MeshComputation.compile = compiling  # type: ignore[method-assign]  # the point: JAX's compile, wrapped

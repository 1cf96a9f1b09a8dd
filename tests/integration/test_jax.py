"""The JAX adapter: real multi-process JAX (CPU devices, gloo) on an emulated slice.

The end-to-end tests share one warm emulated v5p-16 (`tpulaunch cluster up`, `--address auto`)
(the session-wide `shared_cluster` fixture of conftest.py, also used by test_run.py). Each
launch costs 20-40 s here, so one script checks many things in one run. JAX is never faked: the
only stand-ins are plain dicts of device attributes fed to the pure id-mapping function, and a
patched `find_spec` to simulate a machine without jax.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from support import REPO, SHARED, SHARED_HOSTS, cli_env, last_summary, run_cli, write_scripts

# The global array every host builds with make_array_from_callback (and the test with numpy).
SUM_SHAPE = (16, 12)


def _global_array() -> np.ndarray:
    return (np.arange(np.prod(SUM_SHAPE), dtype=np.int32).reshape(SUM_SHAPE) % 97) - 40


SCRIPTS = {
    # no `--framework`: auto-detection must pick jax from this import
    "jax_checks.py": """
        import json
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import tpulaunch

        ctx = tpulaunch.context()
        mesh = tpulaunch.get_mesh()
        plan = tpulaunch.get_mesh_plan()
        # the mesh is the plan: position by position, the planned process and its k-th local device
        local = {}
        for d in jax.devices():
            local.setdefault(d.process_index, []).append(d)
        for p in local:
            local[p].sort(key=lambda d: d.id)
        per_host = plan.topology.devices_per_host
        matches = all(
            mesh.devices.flat[i] == local[plan.device(pid).process][pid - plan.device(pid).process * per_host]
            for i, pid in enumerate(plan.device_ids())
        )
        shape = SUM_SHAPE
        glob = (np.arange(np.prod(shape), dtype=np.int32).reshape(shape) % 97) - 40
        x = jax.make_array_from_callback(shape, NamedSharding(mesh, P("data", "model")), lambda idx: glob[idx])
        total = jax.jit(lambda a: jnp.sum(a * a - 3 * a))(x)
        print("CHECKS " + json.dumps({
            "process_count": jax.process_count(), "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(), "process_index": jax.process_index(),
            "worker_id": ctx.worker_id, "tpulaunch_process_index": ctx.process_index,
            "platform": jax.devices()[0].platform, "emulated": ctx.emulated, "framework": ctx.framework,
            "mesh_shape": dict(mesh.shape), "mesh_is_plan": matches,
            "sharded_shards": len(x.addressable_shards), "sum": int(total),
        }), flush=True)
    """.replace("SUM_SHAPE", repr(SUM_SHAPE)),
    "jax_die.py": """
        import sys, time
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import tpulaunch

        ctx = tpulaunch.context()
        mesh = tpulaunch.get_mesh()
        x = jax.make_array_from_callback((16,), NamedSharding(mesh, P(tuple(mesh.axis_names))),
                                         lambda idx: np.ones(16, np.int32)[idx])
        print("collective", int(jax.jit(jnp.sum)(x)), flush=True)  # every host took part
        if ctx.process_index == 1:
            print("host 1 dying", flush=True)
            sys.exit(7)
        time.sleep(600)
    """,
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("jaxwork"), SCRIPTS)


# -- no runtime: plan, env, id mapping, missing jax ---------------------------------------------


def test_build_mesh_checks_device_counts_and_single_host_boot():
    """In a fresh process with 8 CPU devices: a 1-host v6e-8 boots without a coordinator and gets
    its mesh; plans needing another device count, or another count per host, are refused."""
    code = textwrap.dedent("""
        import json
        from tpulaunch.plan import mesh as M, topology as T
        from tpulaunch.plan.launch import build_plan
        from tpulaunch.plan.slicespec import SliceSpec
        from tpulaunch.errors import MeshMismatchError
        from tpulaunch.host.frameworks.jax import ADAPTER

        def state(mesh):
            return build_plan(slices=[SliceSpec.emulated_from(mesh.topology, "s")], mesh=mesh, script="x.py",
                              framework="jax", run_id="r", coordinator_port=1, emulated=True, log_dir="/tmp",
                              workdir="/tmp").state(0)
        out = {}
        plan = M.plan_mesh(T.resolve("v6e-8"))
        ADAPTER.boot(state(plan))
        mesh = ADAPTER.build_mesh(plan, state(plan))
        out["ok"] = [dict(mesh.shape), [d.id for d in mesh.devices.flat] == plan.device_ids()]
        for name, topo in (("v6e-4", T.resolve("v6e-4")),
                           ("two-vm", T.resolve(None, topology="2x4", accelerator="v5e", chips_per_host=4))):
            p = M.plan_mesh(topo)
            try:
                ADAPTER.build_mesh(p, state(p))
                out[name] = "built"
            except MeshMismatchError as e:
                out[name] = e.line()
        ADAPTER.shutdown()
        print(json.dumps(out))
    """)
    env = cli_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] == [{"data": 8}, True]
    assert out["v6e-4"].startswith("JAX has 8 devices but the planned mesh {'data': 4} needs 4"), out
    assert out["two-vm"].startswith("JAX has 8 devices on this host but a v5litepod-8 host holds 4"), out


# -- on the warm emulated slice -----------------------------------------------------------------


@pytest.mark.cluster
def test_auto_picks_jax_and_every_host_sees_the_global_runtime(shared_cluster, workdir, tmp_path):
    proc = run_cli("run", "jax_checks.py", *SHARED, "--address", "auto", "--log-dir", str(tmp_path),
                   cwd=workdir, env=shared_cluster["env"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "framework: jax (the script imports jax)" in proc.stderr
    assert "EMULATED slice" in proc.stderr
    g = _global_array().astype(np.int64)
    expected = int((g * g - 3 * g).sum())
    seen = {}
    for i in range(SHARED_HOSTS):
        m = re.search(rf"^\[host {i}\] CHECKS (.*)$", proc.stdout, re.M)
        assert m, proc.stdout[-3000:]
        seen[i] = json.loads(m.group(1))
    for i, c in seen.items():
        assert c["process_count"] == SHARED_HOSTS and c["device_count"] == 8 and c["local_device_count"] == 4, c
        assert c["process_index"] == c["worker_id"] == c["tpulaunch_process_index"] == i, c
        assert c["platform"] == "cpu" and c["emulated"] is True and c["framework"] == "jax", c
        assert c["mesh_shape"] == {"data": 2, "model": 4} and c["mesh_is_plan"] is True, c
        assert c["sharded_shards"] == 4, c  # each host holds only its own shards
        assert c["sum"] == expected, (c["sum"], expected)
    assert last_summary(tmp_path)["exit_code"] == 0


@pytest.mark.cluster
def test_recipe_jax_mlp_loss_falls(shared_cluster, tmp_path):
    proc = run_cli("run", "recipes/jax_mlp.py", *SHARED, "--address", "auto", "--framework", "jax",
                   "--log-dir", str(tmp_path), "--", "--steps", "20", cwd=REPO, env=shared_cluster["env"], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curves = []
    for i in range(SHARED_HOSTS):
        losses = [float(m) for m in re.findall(rf"\[host {i}\] host {i} step \d+ loss ([0-9.]+)", proc.stdout)]
        assert len(losses) >= 3, proc.stdout
        assert losses[-1] < losses[0] * 0.5, losses
        curves.append(losses)
    assert all(c == curves[0] for c in curves), "SPMD: every host reports the same global loss"


@pytest.mark.cluster
def test_recipe_jax_transformer_trains_with_2d_sharding(shared_cluster, tmp_path):
    """The JAX demo: batch over `data`, Megatron-split weights over `model`, one jit per step."""
    proc = run_cli("run", "recipes/jax_transformer.py", *SHARED, "--address", "auto", "--framework", "jax",
                   "--no-compile-cache", "--log-dir", str(tmp_path), "--", "--steps", "12", "--layers", "1",
                   cwd=REPO, env=shared_cluster["env"], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[host 0] mesh {'data': 2, 'model': 4}, 2 host(s), emulated" in proc.stdout, proc.stdout
    curves = [[float(m) for m in re.findall(rf"\[host {i}\] host {i} step \d+ loss ([0-9.]+)", proc.stdout)]
              for i in range(SHARED_HOSTS)]
    assert len(curves[0]) == 4 and curves[0][-1] < curves[0][0] * 0.2, curves[0]
    assert all(c == curves[0] for c in curves), "SPMD: every host reports the same global loss"


@pytest.mark.cluster
def test_a_dying_host_fails_the_jax_launch_fast(shared_cluster, workdir, tmp_path):
    # A huge shutdown timeout: if a failed host waited in jax.distributed.shutdown's barrier
    # (with hosts that never arrive), this run would hang instead of failing fast.
    proc = run_cli("run", "jax_die.py", *SHARED, "--address", "auto", "--framework", "jax", "--json",
                   "--env", "TPULAUNCH_JAX_SHUTDOWN_TIMEOUT=600", "--log-dir", str(tmp_path),
                   cwd=workdir, env=shared_cluster["env"], timeout=300)
    assert proc.returncode == 7, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["exit_code"] == 7 and summary["first_failure"]["process_index"] == 1
    hosts = {h["process_index"]: h for h in summary["hosts"]}
    assert hosts[1]["exit_code"] == 7 and hosts[1]["wall_s"] < 120, hosts[1]
    for i in range(SHARED_HOSTS):
        if i == 1:
            continue
        # JAX's preemption notifier catches SIGTERM, so a host may need tpulaunch's SIGKILL
        assert hosts[i]["exit_code"] in (128 + signal.SIGTERM, 128 + signal.SIGKILL), hosts[i]
        assert hosts[i]["stopped_by_tpulaunch"], hosts[i]
    for i in range(SHARED_HOSTS):
        assert "collective 16" in Path(hosts[i]["log"]).read_text()
    # nor in JAX's own exit handler (the same barrier): host 1 left without the exit steps' bound
    assert "exit handlers and threads were still running" not in Path(hosts[1]["log"]).read_text()
    status = json.loads(run_cli("cluster", "status", "--json", env=shared_cluster["env"]).stdout)
    assert not any(h["busy"] for h in status["slices"][0]["hosts"])


@pytest.mark.cluster
def test_the_compile_cache_is_written_by_one_run_and_read_by_the_next(shared_cluster, tmp_path):
    """JAX's persistent cache: process 0 writes it (JAX's rule) and reads it on the next run.

    On a TPU slice every host computes the same cache key, so every host reads process 0's
    entries. On CPU devices JAX's key includes the CPU topology's fingerprint, which differs per
    process, so on an emulated slice the other hosts compute keys of their own and compile again
    (`BENCHMARKS.md` shows what that costs); this test checks what holds on both: process 0.
    """
    cache = tmp_path / "cache"

    def train(log: str) -> str:
        proc = run_cli("run", "recipes/jax_mlp.py", *SHARED, "--address", "auto", "--framework", "jax",
                       "--compile-cache", str(cache), "--env", "JAX_LOG_COMPILES=1", "--log-dir", str(tmp_path / log),
                       "--", "--steps", "3", cwd=REPO, env=shared_cluster["env"], timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        hosts = sorted(last_summary(tmp_path / log)["hosts"], key=lambda h: h["process_index"])
        return Path(hosts[0]["log"]).read_text()

    first = train("first")
    entries = sorted(p for p in cache.rglob("*") if p.is_file())
    assert entries, "the first run wrote no cache entry"
    assert "Persistent compilation cache hit" not in first
    second = train("second")
    hits = re.findall(r"Persistent compilation cache hit for '([^']+)'", second)
    assert "jit_train_step" in " ".join(hits), hits
    assert sorted(p for p in cache.rglob("*") if p.is_file()) == entries, "the second run compiled anew"

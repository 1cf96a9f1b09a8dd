"""`tpulaunch run SCRIPT --rehearse`: real JAX on CPU devices, real libtpu compiling for the target TPU.

No cluster: the rehearsal is one process holding the slice's devices. Each test is the CLI in a
subprocess, as a user types it.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from support import REPO, run_cli, write_scripts

RECIPE = str(REPO / "recipes" / "jax_transformer.py")
GiB = 2**30

TOO_BIG = '''
"""A jitted program whose replicated output is 17 GiB on every device: more than a v5e chip's 16 GiB."""
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import tpulaunch

mesh = tpulaunch.get_mesh()
small = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P()))(jnp.ones((4,)))
print("the small program ran:", float(small.sum()), flush=True)
big = jax.jit(lambda: jnp.ones((17 * 2**30 // 4,), jnp.float32), out_shardings=NamedSharding(mesh, P()))
out = big()
with open(sys.argv[1], "w") as f:  # reached only if the CPU ran the 17 GiB program
    f.write(str(out.shape))
'''

# Its own mesh (not tpulaunch's), shard_map with a psum, a sharding constraint inside jit, donation.
OWN_MESH = '''
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()).reshape(8, -1), ("batch", "model"))

@partial(jax.shard_map, mesh=mesh, in_specs=P("batch", "model"), out_specs=P(None, "model"))
def col_sums(x):
    return jax.lax.psum(x.sum(0, keepdims=True), "batch")

@partial(jax.jit, donate_argnums=0)
def step(x):
    y = jax.lax.with_sharding_constraint(jnp.tanh(x) @ x.T, NamedSharding(mesh, P("batch", None)))
    return x + 0.01 * y @ x, col_sums(x)

x = jax.device_put(jnp.ones((512, 256)), NamedSharding(mesh, P("batch", "model")))
x, s = step(x)
print("col sums", float(s.sum()), flush=True)
'''


def _rehearse(*args: str, cwd: Path | str = REPO, timeout: float = 300):  # noqa: ANN202
    return run_cli("run", *args, cwd=cwd, timeout=timeout)


def test_the_transformer_recipe_rehearsed_for_a_v5p_128(tmp_path):
    proc = _rehearse(RECIPE, "--topology", "4x4x4", "--accelerator", "v5p", "--rehearse", "--json",
                     "--log-dir", str(tmp_path), "--", "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["target"] == "v5p-128 (4x4x4)" and doc["devices"] == 64 and doc["device_kind"] == "TPU v5"
    assert doc["libtpu_version"] == metadata.version("libtpu") and doc["hbm_bytes_per_device"] == 95 * GiB
    step = [p for p in doc["programs"] if p["name"] == "train_step"]
    assert len(step) == 1, [p["name"] for p in doc["programs"]]
    step = step[0]
    assert step["devices"] == 64 and step["collectives"].get("all-reduce", 0) > 0
    assert 0 < step["total_bytes"] < GiB and step["temp_bytes"] > 0 and step["code_bytes"] > 0
    assert "[rehearsal] host 0 step 1 loss" in proc.stderr  # the script ran on, on the CPU
    saved = json.loads((Path(tmp_path) / next(p.name for p in Path(tmp_path).iterdir()) / "rehearsal.json").read_text())
    assert saved["programs"] == doc["programs"]


def test_the_transformer_recipe_rehearsed_for_a_v6e_256_prints_its_table(tmp_path):
    """256 devices, 64 hosts: a slice no machine here could emulate, rehearsed in one process."""
    proc = _rehearse(RECIPE, "--topology", "16x16", "--accelerator", "v6e", "--rehearse", "--log-dir", str(tmp_path),
                     "--", "--steps", "1", "--batch", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in proc.stdout.splitlines() if not r.startswith("[rehearsal] ")]  # the script's own lines
    assert rows[0].split()[:3] == ["program", "devices", "arguments"]
    step = [r.split() for r in rows if r.startswith("train_step")]
    assert len(step) == 1 and step[0][1] == "256" and "all-reduce" in step[0]
    assert "rehearsal for v6e-256 (16x16): 256 devices of TPU v6 lite, 32.0 GiB HBM each; libtpu" in proc.stderr
    assert "program(s) fit v6e-256 (16x16)" in proc.stderr and "exit 0" in proc.stderr


def test_a_program_too_big_for_a_v5e_is_stopped_before_the_cpu_runs_it(tmp_path):
    work = write_scripts(tmp_path, {"too_big.py": TOO_BIG})
    marker = tmp_path / "the-cpu-ran-it"
    proc = _rehearse("too_big.py", "--topology", "4x4", "--accelerator", "v5e", "--rehearse",
                     "--log-dir", str(tmp_path / "runs"), "--", str(marker), cwd=work)
    assert proc.returncode == 88, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: program <lambda> does not fit TPU v5 lite's HBM: its arguments and outputs"
                                " alone hold 18253611008 bytes (17.0 GiB) per device, against 17179869184 bytes")
    assert "the CPU did not run it; exit 88" in errors[0]
    assert "the small program ran: 8.0" in proc.stdout  # the programs before it did run
    assert not marker.exists()
    doc = json.loads(next((tmp_path / "runs").iterdir()).joinpath("rehearsal.json").read_text())
    assert doc["exit_code"] == 88 and doc["stopped"] and doc["script_exit"] is None
    # 16 devices x 17 GiB would be 272 GiB; the process never held a tenth of one device's share
    assert doc["peak_rss_bytes"] < 2 * GiB, doc["peak_rss_bytes"]


def test_a_script_with_its_own_mesh_on_a_v4_multislice(tmp_path):
    """Not tpulaunch's mesh: the script's own, over jax.devices(); v4 megacore, 2 slices of 16 chips."""
    work = write_scripts(tmp_path, {"own_mesh.py": OWN_MESH})
    proc = _rehearse("own_mesh.py", "--topology", "2x2x4", "--accelerator", "v4", "--num-slices", "2", "--rehearse",
                     "--json", "--log-dir", str(tmp_path / "runs"), cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["target"] == "v4-32 (2x2x4) x 2 slices" and doc["devices"] == 32 and doc["device_kind"] == "TPU v4"
    step = next(p for p in doc["programs"] if p["name"] == "step")
    assert step["devices"] == 32 and step["alias_bytes"] > 0 and step["collectives"]
    assert "col sums" in proc.stderr

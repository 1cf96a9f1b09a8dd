"""Per-host input on a mesh whose layout is not host-contiguous (placement `auto`).

On a v5p 2x2x2 shaped as the shared one (conftest.py `side_cluster`) with `--mesh data=4,model=2`,
`auto` lays the mesh so that every row of `data` is one host's two devices, but a host's rows are no
longer one contiguous block of the mesh (host 0 holds rows 0 and 3; the old rule scored 2.5 hops per
`data` ring step, this one 1.0). Each host loads its own share with the idioms of the frameworks'
docs, and must find exactly that share on its own devices:

* torch_xla: `DistributedSampler(num_replicas=process_count, rank=process_index)` with
  `MpDeviceLoader(..., input_sharding=ShardingSpec(mesh, ("data", None), minibatch=True))`;
* JAX: `jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local_rows)`.
"""

from __future__ import annotations

import json
import re

import pytest

from support import SHARED, SHARED_HOSTS, run_cli, write_scripts

HOSTS, F = SHARED_HOSTS, 8
ROWS = 16  # the global batch: dataset rows 0..15; host r's sampler share is rows r, r+2, ..., r+14
MESH = ("--mesh", "data=4,model=2")

SCRIPTS = {
    "torch_rows.py": """
        import json
        import numpy as np, torch
        import torch_xla, torch_xla.runtime as xr, torch_xla.distributed.spmd.xla_sharding
        import torch_xla.distributed.spmd as xs, torch_xla.distributed.parallel_loader as pl
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
        import tpulaunch

        mesh = tpulaunch.get_mesh()
        hosts, me = xr.process_count(), xr.process_index()
        data = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
        ds = TensorDataset(data)
        loader = DataLoader(ds, batch_size=16 // hosts, sampler=DistributedSampler(ds, num_replicas=hosts, rank=me, shuffle=False))
        (batch,) = next(iter(pl.MpDeviceLoader(loader, torch_xla.device(),
                                               input_sharding=xs.ShardingSpec(mesh, ("data", None), minibatch=True))))
        shards = {int(s.shard_device.split(":")[1]): sorted(int(r) for r in s.data[:, 0].cpu() // 8)
                  for s in xs.xla_sharding.wrap_as_sharded_tensor(batch).local_shards}
        print("ROWS " + json.dumps({"shape": list(batch.shape), "sum": float(batch.sum()),
                                    "shards": shards, "grid": np.asarray(mesh.device_ids).tolist()}), flush=True)
    """,
    "jax_rows.py": """
        import json
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import tpulaunch

        mesh = tpulaunch.get_mesh()
        me, hosts = jax.process_index(), jax.process_count()
        data = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
        local = data[me:16:hosts]  # the sampler's share: rows me, me+hosts, ...
        batch = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
        shards = {d.id: sorted(int(r) for r in np.asarray(s.data)[:, 0] // 8)
                  for s in batch.addressable_shards for d in [s.device]}
        total = float(jax.jit(jnp.sum)(batch))
        print("ROWS " + json.dumps({"shape": list(batch.shape), "sum": total, "shards": shards,
                                    "process_of": {d.id: d.process_index for d in mesh.devices.flat}}), flush=True)
    """,
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return write_scripts(tmp_path_factory.mktemp("placement"), SCRIPTS)


def _rows(proc) -> dict[int, dict]:
    found = {int(h): json.loads(doc) for h, doc in re.findall(r"^\[host (\d)\] ROWS (.*)$", proc.stdout, re.M)}
    assert sorted(found) == list(range(HOSTS)), proc.stdout[-3000:] + proc.stderr[-3000:]
    return found


def _run(side_cluster, workdir, tmp_path, script, framework):
    dry = run_cli("mesh", "inspect", *SHARED, *MESH, "--json")
    plan = json.loads(dry.stdout)
    old = json.loads(run_cli("mesh", "inspect", *SHARED, *MESH, "--placement", "host", "--json").stdout)
    assert plan["keeps_host_rows"] and plan["grid"] != old["grid"]  # a layout that is not the old one
    firsts = [row[0] // 4 for row in plan["grid"]]  # the host of each row of `data`
    assert firsts != sorted(firsts), plan["grid"]  # ... and a host's rows are not one block
    proc = run_cli("run", script, *SHARED, *MESH, "--address", "auto",
                   "--framework", framework, "--log-dir", str(tmp_path), cwd=workdir, env=side_cluster["env"],
                   timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return plan, _rows(proc)


def _whole_global_batch(got: dict) -> None:
    """Every host sees the slice's global batch: dataset rows 0..15, whole."""
    assert got["shape"] == [ROWS, F] and got["sum"] == float(sum(range(ROWS * F)))


@pytest.mark.cluster
def test_torch_xla_minibatch_rows_land_on_their_hosts_devices(side_cluster, workdir, tmp_path):
    plan, rows = _run(side_cluster, workdir, tmp_path, "torch_rows.py", "torch_xla")
    for host, got in rows.items():
        _whole_global_batch(got)
        assert sum(plan["grid"], []) == got["grid"]  # the script's mesh is the plan's
        # every device holds rows of the host that owns it: host h's share is rows h, h+2, ..., h+14
        assert sorted(int(d) for d in got["shards"]) == list(range(8))
        for dev, ids in got["shards"].items():
            assert ids and all(r % HOSTS == int(dev) // 4 for r in ids), (host, dev, ids)


@pytest.mark.cluster
def test_jax_process_local_rows_land_on_their_hosts_devices(side_cluster, workdir, tmp_path):
    plan, rows = _run(side_cluster, workdir, tmp_path, "jax_rows.py", "jax")
    for host, got in rows.items():
        _whole_global_batch(got)
        assert len(got["shards"]) == 4  # this host's own devices
        for dev, ids in got["shards"].items():
            assert got["process_of"][dev] == host
            assert ids and all(r % HOSTS == host for r in ids), (host, dev, ids)

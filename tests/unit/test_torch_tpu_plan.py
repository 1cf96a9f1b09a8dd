"""TorchTPU's launch contract (`plan/torch_tpu.py`), against torch-tpu 0.2.0's own `set_tpu_launch_env`.

`tests/unit/golden/torch_tpu_launch_env.json` holds what the wheel's function writes on every host
of every slice shape the catalog has for v4, v5e, v5p, v6e and v7x (up to 64 hosts) and on two-slice
runs, given the same hosts and the slice's topology from outside (`scripts/torch_tpu_golden` runs the
wheel's modules with only the PCI scan and the device-coordinate child stubbed). Where both set a
variable, they must agree; where they differ by design the test says so.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest

from tpulaunch.cluster import ports
from tpulaunch.errors import LaunchError
from tpulaunch.host import frameworks, ranks
from tpulaunch.plan import topology as T
from tpulaunch.plan import torch_tpu
from tpulaunch.plan.launch import build_plan
from tpulaunch.plan.mesh import plan_mesh
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint

pytestmark = pytest.mark.unit

GOLDEN = json.loads((Path(__file__).parent / "golden" / "torch_tpu_launch_env.json").read_text())


def _topology(case: dict) -> T.Topology:
    return T.resolve(topology=case["topology"], accelerator=case["generation"], chips_per_host=case["chips_per_host"])


def _plan(topo: T.Topology, hosts_per_slice: list[list[str]], emulated: bool = False, user_env=None, attempt: int = 0):
    slices = [SliceSpec(name=f"tpu-{s}", accelerator_type=topo.accelerator_type, topology=topo.topology,
                        source="tpu-api", workers=tuple(WorkerEndpoint(w, ip) for w, ip in enumerate(ips)),
                        slice_index=s) for s, ips in enumerate(hosts_per_slice)]
    n = len(slices)
    plan = build_plan(slices=slices, mesh=plan_mesh(topo, None, None, n), script="t.py", framework="torch_tpu",
                      run_id="20261125-000000-abcd", coordinator_port=torch_tpu.MASTER_PORT, group_port=29502,
                      emulated=emulated, metadata_server=not emulated, log_dir="/l", workdir="/w",
                      user_env=user_env or {})
    return plan.for_attempt(attempt) if attempt else plan


def _hosts_of(case: dict) -> list[list[str]]:
    """Every slice's hosts as the golden names them (slice s: 10.{s+1}.x.y when there are several)."""
    n = case["num_slices"]
    count = len(case["hosts"])
    if n == 1:
        return [case["hosts"]]
    return [[f"10.{s + 1}.{i // 256}.{i % 256}" for i in range(count)] for s in range(n)]


@pytest.mark.parametrize("case", GOLDEN["cases"],
                         ids=[f"{c['accelerator_type']}-{c['topology']}-s{c['slice']}of{c['num_slices']}" for c in GOLDEN["cases"]])
def test_the_plan_agrees_with_the_wheels_set_tpu_launch_env(case):
    assert case["error"] is None
    topo = _topology(case)
    plan = _plan(topo, _hosts_of(case))
    hosts = len(case["hosts"])
    for worker in range(hosts):
        process_index = case["slice"] * hosts + worker
        procs = torch_tpu.processes(plan.state(process_index))
        assert len(procs) == topo.devices_per_host == int(case["inputs"]["TORCH_TPU_DEVICES_PER_HOST"])
        env = procs[0].env
        wheel = {**case["same"], **{k: v[worker] for k, v in case["per_host"].items() if v[worker] is not None}}
        outside = case["inputs"].get("TORCH_TPU_TOPOLOGY")
        assert env["TORCH_TPU_TOPOLOGY"] == (outside or wheel["TORCH_TPU_TOPOLOGY"])  # the wheel keeps an outside value
        addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
        if hosts == 1:
            # single host: the wheel picks random free ports on localhost; ours are its fixed 8070+i
            # on the host's address (only the host itself dials them)
            assert len(addresses) == len(wheel["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(","))
            assert all(a.startswith(case["hosts"][0] + ":") for a in addresses)
            continue
        assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == wheel["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
        assert env["MASTER_PORT"] == wheel["MASTER_PORT"] == "29500"
        if case["num_slices"] == 1:
            assert (env["NODE_RANK"], env["NNODES"], env["MASTER_ADDR"]) == (
                wheel["NODE_RANK"], wheel["NNODES"], wheel["MASTER_ADDR"])
        else:  # the operator pins what the wheel can only give per slice: global node ranks, one master
            assert int(env["NODE_RANK"]) == case["slice"] * hosts + int(wheel["NODE_RANK"])
            assert int(env["NNODES"]) == case["num_slices"] * int(wheel["NNODES"])
            assert env["MASTER_ADDR"] == "10.1.0.0" and wheel["MASTER_ADDR"] == f"10.{case['slice'] + 1}.0.0"


def test_the_golden_covers_every_generation_torch_tpu_knows_multi_host_and_multislice():
    cases = GOLDEN["cases"]
    assert {c["generation"] for c in cases} == set(torch_tpu.GENERATIONS)
    for gen in ("v5p", "v6e", "v7x"):
        assert any(c["generation"] == gen and len(c["hosts"]) > 1 for c in cases)
        assert any(c["generation"] == gen and c["num_slices"] == 2 for c in cases)
    assert max(len(c["hosts"]) for c in cases) == GOLDEN["max_hosts"] == 64


def _check_ranks(plan) -> None:
    """Ranks are host-major in address order: rank r's address (addresses[r % n]) is on its own host
    at its local index, and every rank is the plan's device id of its device."""
    topo, n_per = plan.topology, plan.topology.devices_per_host
    seen = []
    for h in plan.hosts:
        for p in torch_tpu.processes(plan.state(h.process_index)):
            addresses = p.env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
            assert addresses[p.rank % len(addresses)] == addresses[h.worker_id * n_per + p.local_rank]
            assert addresses[p.rank % len(addresses)].split(":")[0] == h.ip
            dev = plan.mesh.device(p.rank)
            assert (dev.process, dev.worker_id) == (h.process_index, h.worker_id)
            assert int(p.env["RANK"]) == p.rank and int(p.env["LOCAL_RANK"]) == p.local_rank
            assert p.env["WORLD_SIZE"] == str(plan.mesh.num_devices)
            seen.append(p.rank)
    assert sorted(seen) == list(range(plan.mesh.num_devices)) and topo.devices_per_host == n_per


@pytest.mark.parametrize("accelerator,slices", [("v5p-16", 1), ("v5p-16", 2), ("tpu7x-32", 2), ("v6e-16", 3)])
def test_ranks_are_host_major_and_are_the_meshs_device_ids(accelerator, slices):
    topo = T.resolve(accelerator=accelerator)
    _check_ranks(_plan(topo, [[f"10.{s}.0.{w}" for w in range(topo.num_hosts)] for s in range(slices)]))


def test_multislice_adds_megascale_with_the_coordinators_port_and_the_runtimes_per_rank_ports():
    topo = T.resolve(accelerator="tpu7x-16")  # 2 hosts of 8 devices
    plan = _plan(topo, [["10.0.0.1", "10.0.0.2"], ["10.0.1.1", "10.0.1.2"]])
    p = torch_tpu.processes(plan.state(3))[5]  # slice 1, worker 1, local rank 5
    assert p.rank == 3 * 8 + 5
    assert p.env["MEGASCALE_COORDINATOR_ADDRESS"] == "10.0.0.1:8080"  # local rank 0 of the coordinator host
    assert (p.env["MEGASCALE_SLICE_ID"], p.env["MEGASCALE_NUM_SLICES"]) == ("1", "2")
    assert (p.env["MEGASCALE_PORT"], p.env["MEGASCALE_DEBUG_PORT"]) == ("8090", "8091")  # 8080+2L, 8081+2L
    assert p.env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].startswith("10.0.1.1:8070,")  # its own slice's hosts
    assert "SKIP_MEGASCALE_PJRT_CLIENT" not in p.env and "SKIP_MEGASCALE_PJRT_CLIENT" not in plan.env(3)
    single = torch_tpu.processes(_plan(topo, [["10.0.0.1", "10.0.0.2"]]).state(0))[0].env
    assert not any(k.startswith("MEGASCALE") for k in single)


def test_emulated_hosts_share_an_address_so_their_slice_builder_ports_go_on_per_host():
    topo = T.resolve(accelerator="v5p-16")
    plan = _plan(topo, [["127.0.0.1", "127.0.0.1"]], emulated=True)
    addresses = torch_tpu.processes(plan.state(1))[0].env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    assert len(set(addresses)) == len(addresses) == 8
    _check_ranks(plan)


def test_topology_string_is_the_comma_form_with_cores_on_v7x():
    assert torch_tpu.topology_string(T.resolve(accelerator="v5p-128")) == "4,4,4"
    assert torch_tpu.topology_string(T.resolve(accelerator="v6e-16")) == "4,4,1"
    assert torch_tpu.topology_string(T.resolve(accelerator="tpu7x-32")) == "2,2,4,2"


def test_one_session_id_per_attempt_on_every_host_and_the_users_env_wins():
    topo = T.resolve(accelerator="v5p-16")
    plan = _plan(topo, [["10.0.0.1", "10.0.0.2"]], user_env={"MASTER_PORT": "1234", "TORCH_TPU_TOPOLOGY": "9,9,9"})
    ids = {p.env["TORCH_TPU_XPROF_SESSION_ID"] for h in (0, 1) for p in torch_tpu.processes(plan.state(h))}
    assert len(ids) == 1 and ids.pop().isdigit()
    again = plan.for_attempt(1)
    assert torch_tpu.processes(again.state(0))[0].env["TORCH_TPU_XPROF_SESSION_ID"] != \
        torch_tpu.processes(plan.state(0))[0].env["TORCH_TPU_XPROF_SESSION_ID"]
    env = torch_tpu.processes(plan.state(0))[0].env
    assert "MASTER_PORT" not in env and "TORCH_TPU_TOPOLOGY" not in env  # the host's env carries the user's
    assert plan.env(0)["MASTER_PORT"] == "1234"


def test_generations_torch_tpu_does_not_know_are_refused():
    with pytest.raises(LaunchError, match="torch-tpu 0.2.0 supports"):
        torch_tpu.check_generation(T.resolve(accelerator="v3-32"))
    torch_tpu.check_generation(T.resolve(accelerator="v5p-16"))


def test_dry_run_document_lists_every_process_with_its_env():
    topo = T.resolve(accelerator="v5p-16")
    doc = _plan(topo, [["10.0.0.1", "10.0.0.2"]]).to_dict()
    assert [[p["rank"] for p in h["processes"]] for h in doc["hosts"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert doc["hosts"][1]["processes"][2]["env"]["RANK"] == "6"
    json.dumps(doc)


def test_the_ports_tpulaunch_hands_out_avoid_torch_tpus_fixed_ones(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # claims of its own: another run may have claimed 12345
    monkeypatch.setattr(ports, "_handed_out", set(ports._handed_out))
    picks = iter([[torch_tpu.MASTER_PORT, torch_tpu.HANDSHAKE_PORT, 12345]])
    monkeypatch.setattr(random, "sample", lambda *_a, **_k: next(picks))
    monkeypatch.setattr(ports, "_is_free", lambda _port: True)
    assert ports.free_ports(1) == [12345]


def test_the_framework_is_detected_and_a_hosts_lines_name_their_rank():
    assert frameworks.detect("import torch_tpu\n")[0] == "torch_tpu"
    assert frameworks.detect("import torch.distributed as d\nd.init_process_group('tpu_dist')\n")[0] == "torch_tpu"
    assert frameworks.detect("import torch_xla\n# tpu_dist\n")[0] == "torch_xla"
    line = ranks.failed_line(13, 3, 1, "exit 3", 3)
    m = ranks.FAILED_RE.match(line)
    assert m and m.groups()[:4] == ("13", "3", "1", "exit 3")
    assert ranks.PREFIX_RE.match(ranks.prefix(13) + "hello").group(1) == "13"


def test_python_must_be_an_absolute_path_and_here_an_executable(tmp_path):
    import sys

    from tpulaunch.run.prepare import check_python

    with pytest.raises(LaunchError, match="is not an absolute path"):
        check_python("python3", emulated=False)
    with pytest.raises(LaunchError, match="is not an executable on this machine"):
        check_python(str(tmp_path / "nothing"), emulated=True)
    check_python(str(tmp_path / "on-the-hosts-only"), emulated=False)  # a real slice's path is the hosts' business
    check_python(sys.executable, emulated=True)

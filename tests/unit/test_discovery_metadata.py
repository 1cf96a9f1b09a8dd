"""Discovery on a TPU VM through the GCE metadata server (an HTTP fake of it)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from fakes import closed_port, cli_env, flat, invoke
from fakes.metadata_server import FakeMetadataServer, tpu_env_text
from fakes.tpu_api_server import FakeTpuApi

from tpulaunch import discover as discovery
from tpulaunch.discover import metadata
from tpulaunch.errors import ExitCode, MetadataError, SliceNotReadyError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("TPULAUNCH_METADATA_HOST", "GCE_METADATA_HOST", "TPULAUNCH_METADATA_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def md(monkeypatch):
    """Worker 1 of a v4-32 (2x2x4, 4 VMs) slice named my-v4."""
    with FakeMetadataServer.for_slice("v4-32", "2x2x4", worker=1) as server:
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", server.host)
        yield server


def test_local_slice_describes_the_slice_we_run_on(md):
    local = discovery.local_host()
    assert local is not None and local.worker_id == 1
    spec = local.spec
    assert (spec.name, spec.accelerator_type, spec.topology, spec.source) == ("my-v4", "v4-32", "2x2x4", "metadata")
    assert (spec.zone, spec.project) == ("us-central2-b", "p")
    assert spec.worker_ips == ("10.130.0.2", "10.130.0.3", "10.130.0.4", "10.130.0.5")
    assert [w.hostname for w in spec.workers] == [f"t1v-n-my-v4-w-{i}" for i in range(4)]
    assert spec.to_topology().num_hosts == 4
    assert spec.state is None and spec.slice_index == 0 and not spec.multislice_node
    assert spec.provenance["zone"] == "metadata instance/zone"
    assert local.tpu_env["HOST_BOUNDS"] == "1,1,4"
    assert discovery.local_slice() == spec
    assert discovery.check_ready(spec, force=False) == []  # metadata does not report state: not a blocker
    # Every request carried the header, and we read the documented keys.
    assert md.requests and all(flavor == "Google" for _, flavor in md.requests)
    paths = {p for p, _ in md.requests}
    for key in ("accelerator-type", "agent-worker-number", "worker-network-endpoints", "instance-id", "tpu-env"):
        assert f"/computeMetadata/v1/instance/attributes/{key}" in paths


def test_gce_metadata_host_is_honoured_and_ours_wins(monkeypatch):
    with FakeMetadataServer.for_slice("v6e-16", "4x4", name="gce-host") as a, \
            FakeMetadataServer.for_slice("v5litepod-16", "4x4", name="ours") as b:
        monkeypatch.setenv("GCE_METADATA_HOST", a.host)
        assert discovery.local_slice().name == "gce-host"
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", b.host)
        assert discovery.local_slice().name == "ours"


def test_single_vm_endpoints_may_be_a_bare_hostname(monkeypatch):
    with FakeMetadataServer.for_slice("v6e-1", "1x1", hosts=1, name="tiny") as server:
        server.values["instance/attributes/worker-network-endpoints"] = "t1v-n-tiny-w-0"
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", server.host)
        spec = discovery.local_slice()
    assert spec.workers[0].ip == "t1v-n-tiny-w-0" and spec.workers[0].hostname == "t1v-n-tiny-w-0"
    assert spec.to_topology().num_hosts == 1


def test_multislice_env_sets_slice_index(monkeypatch):
    with FakeMetadataServer.for_slice("v4-16", "2x2x2", hosts=2, worker=0, multislice=(1, 2)) as server:
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", server.host)
        spec = discovery.local_slice()
    assert spec.slice_index == 1 and spec.multislice_node


def test_topology_from_catalog_when_tpu_env_has_none(monkeypatch):
    with FakeMetadataServer.for_slice("v5litepod-16", "4x4") as server:
        server.values["instance/attributes/tpu-env"] = tpu_env_text({"ACCELERATOR_TYPE": "v5litepod-16"})
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", server.host)
        spec = discovery.local_slice()
    assert spec.topology == "4x4" and "catalog" in spec.provenance["topology"]


def test_preempted_vm_is_not_ready(monkeypatch):
    with FakeMetadataServer.for_slice(preempted=True) as server:
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", server.host)
        spec = discovery.local_slice()
    assert spec.state == "PREEMPTED"
    with pytest.raises(SliceNotReadyError, match="PREEMPTED"):
        discovery.check_ready(spec, force=False)


def test_gce_vm_without_tpu_attributes_is_none(monkeypatch):
    with FakeMetadataServer({"instance/zone": "projects/1/zones/us-central1-a", "project/project-id": "p"}) as server:
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", server.host)
        assert discovery.local_slice() is None
        assert len(server.requests) >= 1  # it did ask


def test_not_a_tpu_vm_returns_none_without_asking(monkeypatch):
    monkeypatch.setattr(metadata.glob, "glob", lambda pattern: [])
    assert metadata.looks_like_tpu_vm() is False
    assert discovery.local_slice() is None


def test_tpu_vm_detection(monkeypatch, tmp_path):
    accel = tmp_path / "accel0"
    accel.write_text("")
    monkeypatch.setattr(metadata.glob, "glob", lambda pattern: [str(accel)] if "accel" in pattern else [])
    assert metadata.looks_like_tpu_vm() is True
    monkeypatch.setattr(metadata.glob, "glob", lambda pattern: [])
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:1")
    assert metadata.looks_like_tpu_vm() is True


# -- failures -----------------------------------------------------------------------------------


def test_unreachable_metadata_server(monkeypatch):
    monkeypatch.setenv("TPULAUNCH_METADATA_HOST", f"127.0.0.1:{closed_port()}")
    with pytest.raises(MetadataError) as e:
        discovery.local_slice()
    assert e.value.exit_code == ExitCode.DISCOVERY == 3
    assert e.value.line().startswith("metadata server unreachable at 127.0.0.1:")
    assert "TPULAUNCH_METADATA_HOST" in e.value.line()


def test_silent_metadata_server_times_out(monkeypatch):
    with socket.socket() as s:  # accepts connections (backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", f"127.0.0.1:{s.getsockname()[1]}")
        monkeypatch.setenv("TPULAUNCH_METADATA_TIMEOUT", "0.5")
        start = time.monotonic()
        with pytest.raises(MetadataError, match="no answer within 0.5 s"):
            discovery.local_slice()
        assert time.monotonic() - start < 0.5 + 10


def test_a_server_that_is_not_a_metadata_server(monkeypatch):
    with FakeTpuApi() as api:  # answers, but without Metadata-Flavor: Google
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", api.url.removeprefix("http://"))
        with pytest.raises(MetadataError, match="not a metadata server"):
            discovery.local_slice()


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("instance/attributes/agent-worker-number", "one", "agent-worker-number is 'one'"),
        ("instance/attributes/agent-worker-number", "7", "agent-worker-number is 7 but worker-network-endpoints lists 4"),
        ("instance/attributes/worker-network-endpoints", "w0:1:10.0.0.2,w1:10.0.0.3", "'w1:10.0.0.3'"),
        ("instance/attributes/worker-network-endpoints", " ", "worker-network-endpoints is empty"),
        ("instance/attributes/tpu-env", "TOPOLOGY: 'two-by-two'\n", "TOPOLOGY 'two-by-two'"),
        ("instance/attributes/tpu-env", "ACCELERATOR_TYPE 'v4-32'\n", "tpu-env has a malformed line"),
        ("instance/attributes/tpu-env", "TOPOLOGY: '2x2x4'\nMEGASCALE_SLICE_ID: 'x'\n", "MEGASCALE_SLICE_ID is 'x'"),
    ],
)
def test_malformed_values_name_the_key_and_value(monkeypatch, key, value, needle):
    with FakeMetadataServer.for_slice() as server:
        server.values[key] = value
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", server.host)
        with pytest.raises(MetadataError) as e:
            discovery.local_slice()
    assert needle in e.value.line()
    assert e.value.exit_code == 3


def test_missing_worker_number_on_a_tpu_vm(monkeypatch):
    with FakeMetadataServer.for_slice() as server:
        del server.values["instance/attributes/agent-worker-number"]
        server.values["instance/attributes/tpu-env"] = tpu_env_text({"TOPOLOGY": "2x2x4"})
        monkeypatch.setenv("TPULAUNCH_METADATA_HOST", server.host)
        with pytest.raises(MetadataError, match="agent-worker-number is missing"):
            discovery.local_slice()


def test_parsers():
    env = metadata.parse_tpu_env("ACCELERATOR_TYPE: 'v4-32'\n\nTOPOLOGY: \"2x2x4\"\nWRAP: false,false,false\n")
    assert env == {"ACCELERATOR_TYPE": "v4-32", "TOPOLOGY": "2x2x4", "WRAP": "false,false,false"}
    ws = metadata.parse_worker_endpoints("h0:uid0:10.0.0.2,h1:uid1:10.0.0.3,")
    assert [(w.worker_id, w.ip, w.hostname) for w in ws] == [(0, "10.0.0.2", "h0"), (1, "10.0.0.3", "h1")]


# -- the fake itself -----------------------------------------------------------------------------


def test_fake_refuses_requests_without_the_flavor_header(md):
    url = f"http://{md.host}/computeMetadata/v1/instance/attributes/accelerator-type"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=5)
    assert e.value.code == 403 and "Metadata-Flavor" in e.value.read().decode()
    req = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.read().decode() == "v4-32"
    listing = urllib.request.Request(f"http://{md.host}/computeMetadata/v1/instance/", headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(listing, timeout=5) as resp:
        assert "attributes/" in resp.read().decode().split()


# -- through the CLI ----------------------------------------------------------------------------


def test_cli_describe_with_no_arguments_describes_this_slice(md, tmp_path):
    env = cli_env(tmp_path / "home", TPULAUNCH_METADATA_HOST=md.host)
    proc = invoke("slice", "describe", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "name: my-v4" in lines and "source: metadata" in lines and "topology: 2x2x4 (from tpu-env TOPOLOGY)" in lines
    assert "this_worker: 1" in lines
    assert "worker 1: 10.130.0.3 hostname t1v-n-my-v4-w-1 (this host)" in lines
    assert "worker 3: 10.130.0.5 hostname t1v-n-my-v4-w-3" in lines

    doc = json.loads(invoke("slice", "describe", "--json", env=env).stdout)
    assert doc["source"] == "metadata" and doc["this_worker"] == 1 and doc["generation"] == "v4"
    assert [w["ip"] for w in doc["workers"]] == ["10.130.0.2", "10.130.0.3", "10.130.0.4", "10.130.0.5"]
    assert doc["hosts"] == 4 and doc["project"] == "p" and doc["zone"] == "us-central2-b"


def test_cli_metadata_unreachable(tmp_path):
    env = cli_env(tmp_path / "home", TPULAUNCH_METADATA_HOST=f"127.0.0.1:{closed_port()}")
    proc = invoke("slice", "describe", env=env)
    assert proc.returncode == ExitCode.DISCOVERY
    assert "metadata server unreachable" in flat(proc.stderr)
    assert proc.stdout == ""


def test_cli_metadata_malformed(md, tmp_path):
    md.values["instance/attributes/worker-network-endpoints"] = "garbage:entry"
    proc = invoke("slice", "describe", env=cli_env(tmp_path / "home", TPULAUNCH_METADATA_HOST=md.host))
    assert proc.returncode == 3
    assert "worker-network-endpoints" in flat(proc.stderr) and "'garbage:entry'" in flat(proc.stderr)


def test_cli_preempted_vm_exits_4_unless_forced(tmp_path):
    with FakeMetadataServer.for_slice(preempted=True) as server:
        env = cli_env(tmp_path / "home", TPULAUNCH_METADATA_HOST=server.host)
        proc = invoke("slice", "describe", env=env)
        forced = invoke("slice", "describe", "--force", env=env)
    assert proc.returncode == ExitCode.NOT_READY
    assert "state: PREEMPTED" in proc.stdout.splitlines()
    assert "PREEMPTED" in flat(proc.stderr)
    assert forced.returncode == 0 and "warning:" in forced.stderr


def test_cli_describe_with_no_arguments_off_a_tpu_vm(tmp_path):
    proc = invoke("slice", "describe", env=cli_env(tmp_path / "home"))
    assert proc.returncode == ExitCode.USAGE
    assert "not a TPU VM" in flat(proc.stderr) and "tpulaunch slice describe NAME --zone ZONE" in flat(proc.stderr)

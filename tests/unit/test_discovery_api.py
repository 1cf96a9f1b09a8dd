"""Discovery through the Cloud TPU API: the real `tpu_v2.TpuClient` (REST) against an HTTP fake."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import pytest

from fakes import closed_port, hermetic_path
from fakes.tpu_api_server import FakeTpuApi, make_node, standard_nodes, standard_queued_resources

from tpulaunch.run.prepare import prepare
from tpulaunch import discover as discovery
from tpulaunch import cloud_tpu
from tpulaunch.errors import (
    ApiPermissionError,
    ApiUnreachableError,
    CredentialsError,
    DiscoveryError,
    ExitCode,
    NodeNotFoundError,
    SliceMismatchError,
    SliceNotReadyError,
    TopologyError,
    TpulaunchError,
)

C2 = "us-central2-b"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """No host project/zone/endpoint/gcloud leaks into these tests."""
    for key in list(os.environ):
        if key.startswith(("TPULAUNCH_", "CLOUDSDK_", "FAKE_GCLOUD_")) or key in (
            "GOOGLE_CLOUD_PROJECT", "GOOGLE_APPLICATION_CREDENTIALS",
        ):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", hermetic_path(gcloud=False))  # no gcloud (real or fake) unless a test adds the fake
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.fixture
def api():
    with FakeTpuApi(standard_nodes(), standard_queued_resources(), default_page_size=3) as fake:
        yield fake


def describe(api, name, zone=C2, **kw):
    return discovery.describe_node(name, zone=zone, project="p", endpoint=api.url, **kw)


# -- each generation's node shape ---------------------------------------------------------------


@pytest.mark.parametrize(
    "zone,name,acc,shape,hosts,gen",
    [
        (C2, "my-v4", "v4-32", "2x2x4", 4, "v4"),
        ("us-west4-a", "my-v5e", "v5litepod-16", "4x4", 4, "v5e"),  # acceleratorType only
        ("us-east5-a", "my-v5p", "v5p-32", "2x2x4", 4, "v5p"),  # acceleratorConfig only
        ("europe-west4-a", "my-v6e", "v6e-16", "4x4", 4, "v6e"),
        ("us-central1-c", "my-v7x", "tpu7x-16", "2x2x2", 2, "v7x"),  # enum string the client lacks
        ("us-central1-c", "v7x-int", "tpu7x-16", "2x2x2", 2, "v7x"),  # unknown enum int + type
        ("us-central1-c", "my-tpu7x", "tpu7x-16", "2x2x2", 2, "v7x"),  # acceleratorType only
    ],
)
def test_each_generation_normalizes_to_slicespec(api, zone, name, acc, shape, hosts, gen):
    spec = describe(api, name, zone=zone)
    assert (spec.name, spec.accelerator_type, spec.topology) == (name, acc, shape)
    assert (spec.zone, spec.project, spec.source) == (zone, "p", "tpu-api")
    assert len(spec.workers) == hosts
    topo = spec.to_topology()
    assert topo.generation.name == gen
    assert topo.num_hosts == hosts
    assert discovery.generation_of(spec) == gen
    assert api.rejected == []


def test_v4_details_workers_in_order(api):
    spec = describe(api, "my-v4")
    assert spec.state == "READY" and spec.health == "HEALTHY"
    assert [w.worker_id for w in spec.workers] == [0, 1, 2, 3]
    assert spec.worker_ips == ("10.130.0.2", "10.130.0.3", "10.130.0.4", "10.130.0.5")
    assert [w.external_ip for w in spec.workers] == ["34.27.1.10", "34.27.1.11", "34.27.1.12", "34.27.1.13"]
    assert spec.runtime_version == "tpu-ubuntu2204-base"
    assert not spec.spot and not spec.preemptible and spec.symptoms == ()
    assert spec.provenance == {"project": "--project flag", "zone": "--zone flag"}
    # It was the real REST path, unauthenticated because the endpoint is a local http URL.
    (req,) = api.calls("get_node")
    assert req["path"] == "/v2/projects/p/locations/us-central2-b/nodes/my-v4"
    assert req["authorization"] is None


def test_worker_order_is_endpoint_order_not_ip_order():
    node = make_node(C2, "shuffled", accelerator_type="v4-32", accelerator_config={"type": "V4", "topology": "2x2x4"},
                     ips=["10.0.0.9", "10.0.0.3", "10.0.0.7", "10.0.0.1"])
    with FakeTpuApi([node]) as fake:
        spec = discovery.describe_node("shuffled", zone=C2, project="p", endpoint=fake.url)
    assert spec.worker_ips == ("10.0.0.9", "10.0.0.3", "10.0.0.7", "10.0.0.1")


def test_catalog_fills_topology_when_only_accelerator_type(api):
    spec = describe(api, "my-v5e", zone="us-west4-a")
    assert spec.topology == "4x4"
    assert "catalog" in spec.provenance["topology"]


def test_v7x_enum_string_unknown_to_client_is_kept(api):
    spec = describe(api, "my-v7x", zone="us-central1-c")
    assert spec.accelerator_type == "tpu7x-16"
    assert "V7X" in spec.provenance["accelerator_type"]
    assert spec.to_topology().devices == 16  # 8 chips x 2 devices


def test_unknown_enum_number_alone_stays_visible_and_does_not_crash(api):
    spec = describe(api, "v7x-intonly", zone="us-central1-c")
    assert "12" in spec.accelerator_type
    assert spec.topology == "2x2x2"
    assert len(spec.workers) == 2
    with pytest.raises(TopologyError):
        spec.to_topology()


def test_int_enum_encoding_like_the_real_service():
    with FakeTpuApi(standard_nodes(), int_enums=True) as fake:
        spec = discovery.describe_node("v4-sick", zone=C2, project="p", endpoint=fake.url)
        (req,) = fake.calls("get_node")
    assert req["query"]["enum-encoding"] == ["int"]
    assert spec.state == "READY" and spec.health == "UNHEALTHY_TENSORFLOW"
    assert spec.symptoms[0].startswith("HBM_OUT_OF_MEMORY on worker 1")


def test_spot_unhealthy_and_creating_nodes(api):
    spot = describe(api, "spot-v5e", zone="us-west4-a")
    assert spot.spot and spot.accelerator_type == "v5litepod-8" and len(spot.workers) == 1
    sick = describe(api, "v4-sick")
    assert sick.health == "UNHEALTHY_TENSORFLOW"
    assert sick.health_description == "The TPU runtime on worker 1 is not responding"
    assert sick.symptoms == ("HBM_OUT_OF_MEMORY on worker 1: HBM usage at 100% on chip 3",)
    creating = describe(api, "v4-creating")
    assert creating.state == "CREATING" and creating.health is None and creating.workers == ()


def test_full_node_path_is_accepted(api):
    spec = discovery.describe_node("projects/p/locations/us-west4-a/nodes/my-v5e", endpoint=api.url)
    assert (spec.name, spec.zone, spec.project) == ("my-v5e", "us-west4-a", "p")
    with pytest.raises(TpulaunchError, match="contradicts"):
        discovery.describe_node("projects/p/locations/us-west4-a/nodes/my-v5e", zone=C2, endpoint=api.url)


# -- queued resources (multislice) -------------------------------------------------------------


def test_queued_resource_gives_one_spec_per_slice(api):
    specs = discovery.describe_queued_resource("ms-qr", zone=C2, project="p", endpoint=api.url)
    assert [s.name for s in specs] == ["ms-0", "ms-1"]
    assert [s.slice_index for s in specs] == [0, 1]
    assert all(s.multislice_node for s in specs)
    assert {s.queued_resource for s in specs} == {"projects/p/locations/us-central2-b/queuedResources/ms-qr"}
    assert specs[1].worker_ips == ("10.130.11.2", "10.130.11.3")
    assert specs[0].provenance["queued_resource_state"] == "ACTIVE"


def test_a_queued_resources_slices_on_a_real_cluster_read_their_metadata_server(api, monkeypatch, tmp_path):
    """A queued resource's nodes are TPU VMs: libtpu and torch_xla read the slice from the metadata
    server there (with its torus wraparound, which the plan does not hold), as on any real slice, so
    the plan tells no host to skip it."""
    from tpulaunch import run

    monkeypatch.setenv("TPULAUNCH_TPU_API_ENDPOINT", api.url)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("print(1)\n")
    req = run.LaunchRequest(script="t.py", framework="none", workdir=str(tmp_path),
                            slices=discovery.SliceRequest(queued_resource="ms-qr", zone=C2, project="p"))
    plan = prepare(req, run.Target(None), discovery.ClusterSlices(False), None).plan
    assert not plan.emulated and [s.name for s in plan.slices] == ["ms-0", "ms-1"]
    for h in plan.hosts:
        env = plan.env(h.process_index)
        assert not {"TPU_SKIP_MDS_QUERY", "TPU_TOPOLOGY", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS"} & set(env)
        assert env["MEGASCALE_NUM_SLICES"] == "2" and env["TPU_WORKER_HOSTNAMES"]


def test_queued_resource_still_waiting_is_not_ready(api):
    with pytest.raises(SliceNotReadyError) as e:
        discovery.describe_queued_resource("waiting-qr", zone=C2, project="p", endpoint=api.url)
    assert e.value.exit_code == ExitCode.NOT_READY == 4
    assert "WAITING_FOR_RESOURCES" in e.value.line()


def test_a_preempted_queued_resource_says_its_slice_will_not_come_back_by_itself(api):
    api.suspend_s = 0.0
    api.preempt("ms-0")  # its nodes deleted, the queued resource SUSPENDED
    with pytest.raises(SliceNotReadyError) as e:
        discovery.describe_queued_resource("ms-qr", zone=C2, project="p", endpoint=api.url)
    assert "queued resource 'ms-qr' is SUSPENDED: its node ms-0 is gone" in e.value.line()
    assert "delete it and create it again" in e.value.line() and "wait until" not in e.value.line()


def test_queued_resource_not_found(api):
    with pytest.raises(NodeNotFoundError, match="queued resource 'nope' not found"):
        discovery.describe_queued_resource("nope", zone=C2, project="p", endpoint=api.url)


# -- listing and paging -------------------------------------------------------------------------


def test_list_follows_next_page_token(api):
    specs = discovery.list_nodes(zone="us-east1-d", project="p", endpoint=api.url)
    assert [s.name for s in specs] == [f"busy-{i}" for i in range(7)]
    calls = api.calls("list_nodes")
    assert len(calls) == 3  # 7 nodes, 3 per page
    assert [c["query"].get("pageToken", [""])[0] for c in calls] == ["", "offset-3", "offset-6"]


def test_list_with_explicit_page_size(api):
    specs = discovery.list_nodes(zone="us-east1-d", project="p", endpoint=api.url, page_size=2)
    assert len(specs) == 7
    calls = api.calls("list_nodes")
    assert len(calls) == 4 and all(c["query"]["pageSize"] == ["2"] for c in calls)


def test_list_every_zone_with_dash(api):
    specs = discovery.list_nodes(zone="-", project="p", endpoint=api.url)
    assert {s.zone for s in specs} >= {C2, "us-west4-a", "us-east5-a", "europe-west4-a", "us-central1-c", "us-east1-d"}
    assert len(specs) == len(standard_nodes())


# -- failures -----------------------------------------------------------------------------------


def test_403_names_the_missing_permission_and_the_api(api):
    api.mode = "forbidden"
    with pytest.raises(ApiPermissionError) as e:
        describe(api, "my-v4")
    line = e.value.line()
    assert e.value.exit_code == ExitCode.DISCOVERY == 3
    assert "tpu.nodes.get" in line and "tpu.googleapis.com" in line
    with pytest.raises(ApiPermissionError, match="tpu.nodes.list"):
        discovery.list_nodes(zone=C2, project="p", endpoint=api.url)


def test_403_api_disabled_says_how_to_enable(api):
    api.mode = "disabled"
    with pytest.raises(ApiPermissionError) as e:
        describe(api, "my-v4")
    assert "gcloud services enable tpu.googleapis.com --project p" in e.value.line()


def test_404_lists_the_nodes_that_exist_in_the_zone(api):
    with pytest.raises(NodeNotFoundError) as e:
        describe(api, "my-v44")
    line = e.value.line()
    assert e.value.exit_code == 3
    assert "'my-v44' not found" in line
    for existing in ("my-v4", "v4-sick", "v4-creating", "ms-0", "ms-1"):
        assert existing in line
    assert "busy-0" not in line and "my-v5e" not in line  # other zones are not listed


def test_404_in_an_empty_zone(api):
    with pytest.raises(NodeNotFoundError, match="no TPU nodes in zone asia-east1-c"):
        describe(api, "my-v4", zone="asia-east1-c")


def test_404_when_listing_is_forbidden_too(api):
    api.denied = {"tpu.nodes.list"}
    with pytest.raises(NodeNotFoundError) as e:
        describe(api, "ghost")
    assert "'ghost' not found" in e.value.line() and "tpu.nodes.list" in e.value.line()


def test_unreachable_endpoint_fails_fast():
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(ApiUnreachableError) as e:
        discovery.describe_node("my-v4", zone=C2, project="p", endpoint=url, timeout=5)
    assert e.value.exit_code == 3
    assert "could not reach the Cloud TPU API" in e.value.line() and "connection refused" in e.value.line()


@pytest.mark.parametrize("mode", ["slow", "trickle"])
def test_slow_server_ends_within_the_timeout(mode):
    with FakeTpuApi(standard_nodes(), mode=mode, slow_seconds=60) as fake:
        start = time.monotonic()
        with pytest.raises(ApiUnreachableError) as e:
            discovery.describe_node("my-v4", zone=C2, project="p", endpoint=fake.url, timeout=1)
        elapsed = time.monotonic() - start
    assert "did not answer within 1 s" in e.value.line()
    assert elapsed < 1 + 10


def test_timeout_from_env(monkeypatch):
    monkeypatch.setenv("TPULAUNCH_API_TIMEOUT", "1.5")
    assert cloud_tpu.api_timeout(None) == 1.5
    assert cloud_tpu.api_timeout(3) == 3.0  # the argument wins
    with FakeTpuApi(standard_nodes(), mode="slow") as fake:
        with pytest.raises(ApiUnreachableError, match="within 1.5 s"):
            discovery.describe_node("my-v4", zone=C2, project="p", endpoint=fake.url)


def test_default_timeout_is_ten_seconds():
    assert cloud_tpu.api_timeout(None) == 10.0


@pytest.mark.parametrize("bad", ["soon", "-1", "0"])
def test_bad_timeout_is_a_usage_error(monkeypatch, bad):
    monkeypatch.setenv("TPULAUNCH_API_TIMEOUT", bad)
    with pytest.raises(TpulaunchError) as e:
        cloud_tpu.api_timeout(None)
    assert e.value.exit_code == ExitCode.USAGE


def test_missing_credentials_for_a_real_endpoint(monkeypatch, tmp_path):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    with pytest.raises(CredentialsError) as e:
        discovery.describe_node("my-v4", zone=C2, project="p", endpoint="https://tpu.example.invalid", timeout=5)
    assert e.value.exit_code == 3
    assert "gcloud auth application-default login" in e.value.line()


@pytest.mark.parametrize(
    "url,local",
    [
        ("http://127.0.0.1:8080", True),
        ("http://localhost:9", True),
        ("http://[::1]:9", True),
        ("https://127.0.0.1:8080", False),
        ("http://10.0.0.1:8080", False),
        ("http://127.0.0.1.example.com", False),
        ("tpu.googleapis.com", False),
        (None, False),
    ],
)
def test_anonymous_credentials_only_for_local_http(url, local):
    assert cloud_tpu.is_local_test_endpoint(url) is local


def test_endpoint_from_env(monkeypatch, api):
    monkeypatch.setenv("TPULAUNCH_TPU_API_ENDPOINT", api.url)
    spec = discovery.describe_node("my-v4", zone=C2, project="p")
    assert spec.accelerator_type == "v4-32"
    assert len(api.calls("get_node")) == 1


# -- project / zone -----------------------------------------------------------------------------


@pytest.mark.parametrize("env", ["GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT"])
def test_project_zone_from_env(monkeypatch, env):
    monkeypatch.setenv(env, "env-proj")
    monkeypatch.setenv("CLOUDSDK_COMPUTE_ZONE", "env-zone")
    p, z, prov = discovery.resolve_project_zone(None, None)
    assert (p, z) == ("env-proj", "env-zone")
    assert prov == {"project": f"env {env}", "zone": "env CLOUDSDK_COMPUTE_ZONE"}


def test_missing_project_is_one_clear_error(api):
    with pytest.raises(DiscoveryError) as e:
        discovery.describe_node("my-v4", zone=C2, endpoint=api.url)
    assert "no project" in e.value.line() and "--project" in e.value.line()
    assert api.requests == []  # nothing was sent


# -- check_matches / check_ready ----------------------------------------------------------------


def test_check_matches_accepts_consistent_flags(api):
    v4 = describe(api, "my-v4")
    discovery.check_matches(v4, "2x2x4", "v4")
    discovery.check_matches(v4, None, "v4-32")
    discovery.check_matches(v4, None, None)
    v5e = describe(api, "my-v5e", zone="us-west4-a")
    discovery.check_matches(v5e, "4x4", "v5e-16")  # alias of v5litepod-16
    discovery.check_matches(v5e, None, "v5e")
    v7 = describe(api, "my-v7x", zone="us-central1-c")
    discovery.check_matches(v7, "2x2x2", "v7x-16")


@pytest.mark.parametrize(
    "topology,accelerator,needle",
    [("2x2x2", None, "--topology 2x2x2"), (None, "v5p", "a v4 slice"), (None, "v4-16", "--accelerator v4-16")],
)
def test_check_matches_rejects_contradicting_flags(api, topology, accelerator, needle):
    v4 = describe(api, "my-v4")
    with pytest.raises(SliceMismatchError) as e:
        discovery.check_matches(v4, topology, accelerator)
    assert needle in e.value.line() and "v4-32" in e.value.line()
    assert e.value.exit_code == ExitCode.USAGE


def test_check_ready(api):
    assert discovery.check_ready(describe(api, "my-v4"), force=False) == []
    creating = describe(api, "v4-creating")
    with pytest.raises(SliceNotReadyError) as e:
        discovery.check_ready(creating, force=False)
    assert e.value.exit_code == 4 and "CREATING" in e.value.line() and "--force" in e.value.line()
    assert discovery.check_ready(creating, force=True) == ["state is CREATING, not READY"]
    sick = describe(api, "v4-sick")
    with pytest.raises(SliceNotReadyError) as e:
        discovery.check_ready(sick, force=False)
    assert "UNHEALTHY_TENSORFLOW" in e.value.line() and "HBM_OUT_OF_MEMORY" in e.value.line()


# -- the fake itself ------------------------------------------------------------------------------


def test_fake_rejects_paths_that_are_not_the_api(api):
    for path in ("/v1/projects/p/locations/z/nodes/n", "/v2/projects/p/nodes/n", "/v2/projects/p/locations/z/instances"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(api.url + path, timeout=5)
        body = json.loads(e.value.read())
        assert e.value.code == 404 and body["error"]["status"] == "NOT_FOUND"
    req = urllib.request.Request(api.url + "/v2/projects/p/locations/z/nodes/n:start", method="POST", data=b"{}")
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(req, timeout=5)
    assert len(api.rejected) == 4


def test_fake_error_format_is_googles(api):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(api.url + "/v2/projects/p/locations/us-central2-b/nodes/nope", timeout=5)
    assert json.loads(e.value.read()) == {
        "error": {"code": 404, "message": "Resource 'projects/p/locations/us-central2-b/nodes/nope' was not found",
                  "status": "NOT_FOUND"}
    }

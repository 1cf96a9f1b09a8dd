"""`tpulaunch slice describe|list`: the real command, in a subprocess, against the fake Cloud TPU API."""

from __future__ import annotations

import json
import time

import pytest

from fakes import closed_port, cli_env, flat, invoke
from fakes.tpu_api_server import FakeTpuApi, standard_nodes, standard_queued_resources

from tpulaunch.errors import ExitCode

C2 = ["--zone", "us-central2-b", "--project", "p"]


@pytest.fixture
def api():
    with FakeTpuApi(standard_nodes(), standard_queued_resources(), default_page_size=3) as fake:
        yield fake


@pytest.fixture
def env(api, tmp_path):
    return cli_env(tmp_path / "home", TPULAUNCH_TPU_API_ENDPOINT=api.url)


# -- must show --------------------------------------------------------------------------------------


def test_describe_v4_json(api, env):
    proc = invoke("slice", "describe", "my-v4", *C2, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # exactly one JSON document on stdout
    assert doc["generation"] == "v4"
    assert doc["topology"] == "2x2x4" and doc["accelerator_type"] == "v4-32"
    assert doc["state"] == "READY" and doc["health"] == "HEALTHY" and doc["ready"] is True
    assert [(w["worker_id"], w["ip"]) for w in doc["workers"]] == [
        (0, "10.130.0.2"), (1, "10.130.0.3"), (2, "10.130.0.4"), (3, "10.130.0.5"),
    ]
    assert [w["external_ip"] for w in doc["workers"]] == ["34.27.1.10", "34.27.1.11", "34.27.1.12", "34.27.1.13"]
    assert doc["hosts"] == 4 and doc["chips"] == 16
    assert doc["provenance"] == {"project": "--project flag", "zone": "--zone flag"}
    assert doc["schema"] == "tpulaunch.slice/v1" and doc["source"] == "tpu-api"
    if "mesh" in doc:  # present once tpulaunch.mesh is in the tree
        assert doc["mesh"]["num_devices"] == 16 and doc["mesh"]["num_processes"] == 4
    assert api.rejected == [] and len(api.calls("get_node")) == 1


def test_describe_404_lists_existing_nodes(env):
    proc = invoke("slice", "describe", "my-v44", *C2, env=env)
    assert proc.returncode == ExitCode.DISCOVERY == 3
    err = flat(proc.stderr)
    assert "TPU node 'my-v44' not found in zone us-central2-b of project p" in err
    assert "nodes there: ms-0, ms-1, my-v4, v4-creating, v4-sick" in err
    assert proc.stdout == ""


def test_describe_unreachable_ends_within_timeout(tmp_path):
    env = cli_env(tmp_path / "home", TPULAUNCH_TPU_API_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    proc = invoke("slice", "describe", "my-v4", *C2, env=env)
    assert proc.returncode == 3
    assert "could not reach the Cloud TPU API" in flat(proc.stderr) and "connection refused" in flat(proc.stderr)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_describe_slow_api_ends_within_timeout(tmp_path, how):
    with FakeTpuApi(standard_nodes(), mode="slow", slow_seconds=120) as slow:
        env = cli_env(tmp_path / "home", TPULAUNCH_TPU_API_ENDPOINT=slow.url)
        args = ["slice", "describe", "my-v4", *C2]
        if how == "flag":
            args += ["--timeout", "2"]
        else:
            env["TPULAUNCH_API_TIMEOUT"] = "2"
        start = time.monotonic()
        proc = invoke(*args, env=env, timeout=60)
        elapsed = time.monotonic() - start
    assert proc.returncode == ExitCode.DISCOVERY
    assert "did not answer within 2 s" in flat(proc.stderr)
    assert elapsed < 2 + 10


# -- failures ---------------------------------------------------------------------------------------


def test_describe_403_names_permission(api, env):
    api.mode = "forbidden"
    proc = invoke("slice", "describe", "my-v4", *C2, env=env)
    assert proc.returncode == 3
    err = flat(proc.stderr)
    assert "permission denied" in err and "tpu.nodes.get" in err and "tpu.googleapis.com" in err


def test_list_403_names_list_permission(api, env):
    api.mode = "forbidden"
    proc = invoke("slice", "list", *C2, env=env)
    assert proc.returncode == 3 and "tpu.nodes.list" in flat(proc.stderr)


def test_credentials_missing_for_a_real_endpoint(tmp_path):
    env = cli_env(
        tmp_path / "home",
        TPULAUNCH_TPU_API_ENDPOINT="https://tpu.example.invalid",
        GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "missing.json"),
        GCE_METADATA_HOST=f"127.0.0.1:{closed_port()}",
    )
    proc = invoke("slice", "describe", "my-v4", *C2, env=env, timeout=60)
    assert proc.returncode == 3
    assert "no Google Cloud credentials found" in flat(proc.stderr)
    assert "gcloud auth application-default login" in flat(proc.stderr)


def test_no_adc_at_all(tmp_path):
    # Default endpoint, empty HOME (no ADC file), no gcloud, GCE check off: google.auth.default() fails.
    env = cli_env(tmp_path / "home", GCE_METADATA_HOST=f"127.0.0.1:{closed_port()}")
    proc = invoke("slice", "describe", "my-v4", *C2, env=env, timeout=60)
    assert proc.returncode == 3
    assert "gcloud auth application-default login" in flat(proc.stderr)
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr  # one message, no traceback


def test_not_ready_exits_4_and_force_goes_on(env):
    proc = invoke("slice", "describe", "v4-creating", *C2, env=env)
    assert proc.returncode == ExitCode.NOT_READY == 4
    assert "state: CREATING" in proc.stdout.splitlines()
    assert "state is CREATING, not READY" in flat(proc.stderr) and "--force" in flat(proc.stderr)
    forced = invoke("slice", "describe", "v4-creating", *C2, "--force", env=env)
    assert forced.returncode == 0
    assert "state: CREATING" in forced.stdout.splitlines()
    assert "warning:" in forced.stderr and "CREATING" in forced.stderr


def test_unhealthy_with_symptoms(env):
    proc = invoke("slice", "describe", "v4-sick", *C2, "--json", env=env)
    assert proc.returncode == 4
    doc = json.loads(proc.stdout)  # still described, for scripts
    assert doc["health"] == "UNHEALTHY_TENSORFLOW" and doc["ready"] is False
    assert doc["symptoms"] == ["HBM_OUT_OF_MEMORY on worker 1: HBM usage at 100% on chip 3"]
    assert "UNHEALTHY_TENSORFLOW" in flat(proc.stderr) and "HBM_OUT_OF_MEMORY" in flat(proc.stderr)


def test_missing_project_and_zone(env):
    proc = invoke("slice", "describe", "my-v4", env=env)
    assert proc.returncode == 3
    err = flat(proc.stderr)
    assert "no project or zone" in err and "--project" in err and "--zone" in err


def test_name_and_queued_resource_together_is_usage_error(env):
    proc = invoke("slice", "describe", "my-v4", "--queued-resource", "ms-qr", *C2, env=env)
    assert proc.returncode == ExitCode.USAGE


# -- other shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,zone,acc,topology,gen,hosts",
    [
        ("my-v5e", "us-west4-a", "v5litepod-16", "4x4", "v5e", 4),
        ("my-v5p", "us-east5-a", "v5p-32", "2x2x4", "v5p", 4),
        ("my-v6e", "europe-west4-a", "v6e-16", "4x4", "v6e", 4),
        ("my-v7x", "us-central1-c", "tpu7x-16", "2x2x2", "v7x", 2),
    ],
)
def test_describe_other_generations(env, name, zone, acc, topology, gen, hosts):
    proc = invoke("slice", "describe", name, "--zone", zone, "--project", "p", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["accelerator_type"], doc["topology"], doc["generation"], doc["hosts"]) == (acc, topology, gen, hosts)
    assert len(doc["workers"]) == hosts


def test_describe_plain_lines(env):
    proc = invoke("slice", "describe", "my-v4", *C2, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for expected in (
        "name: my-v4", "project: p (from --project flag)", "zone: us-central2-b (from --zone flag)",
        "accelerator_type: v4-32", "generation: v4", "topology: 2x2x4", "state: READY", "health: HEALTHY",
        "worker 0: 10.130.0.2 external 34.27.1.10", "worker 3: 10.130.0.5 external 34.27.1.13",
    ):
        assert expected in lines
    assert lines.index("worker 0: 10.130.0.2 external 34.27.1.10") < lines.index("worker 3: 10.130.0.5 external 34.27.1.13")


def test_unknown_enum_number_is_shown_not_crashed(env):
    proc = invoke("slice", "describe", "v7x-intonly", "--zone", "us-central1-c", "--project", "p", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "12" in doc["accelerator_type"] and "topology_error" in doc and "mesh" not in doc


def test_queued_resource_multislice(env):
    proc = invoke("slice", "describe", "--queued-resource", "ms-qr", *C2, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["queued_resource_state"] == "ACTIVE"
    assert [(s["name"], s["slice_index"]) for s in doc["slices"]] == [("ms-0", 0), ("ms-1", 1)]
    if "mesh" in doc:
        assert doc["mesh"]["num_slices"] == 2


def test_queued_resource_waiting_exits_4(env):
    proc = invoke("slice", "describe", "--queued-resource", "waiting-qr", *C2, env=env)
    assert proc.returncode == 4 and "WAITING_FOR_RESOURCES" in flat(proc.stderr)


# -- project / zone provenance --------------------------------------------------------------------


def test_project_zone_from_env(env):
    env.update(GOOGLE_CLOUD_PROJECT="p", CLOUDSDK_COMPUTE_ZONE="us-central2-b")
    proc = invoke("slice", "describe", "my-v4", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "project: p (from env GOOGLE_CLOUD_PROJECT)" in lines
    assert "zone: us-central2-b (from env CLOUDSDK_COMPUTE_ZONE)" in lines


# -- list ---------------------------------------------------------------------------------------


def test_list_pages_through_a_busy_zone(api, env):
    proc = invoke("slice", "list", "--zone", "us-east1-d", "--project", "p", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["NAME", "TYPE", "TOPOLOGY", "STATE", "HEALTH", "WORKERS", "SPOT"]
    assert [ln.split()[0] for ln in lines[1:]] == [f"busy-{i}" for i in range(7)]
    assert lines[1].split() == ["busy-0", "v6e-8", "2x4", "READY", "HEALTHY", "1", "-"]
    assert len(api.calls("list_nodes")) == 3  # 7 nodes at 3 per page


def test_list_every_zone_shows_the_zone(env):
    proc = invoke("slice", "list", "--zone", "-", "--project", "p", env=env)
    assert proc.returncode == 0, proc.stderr
    rows = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines()[1:]}
    assert rows["my-v5e"][:3] == ["my-v5e", "us-west4-a", "v5litepod-16"]
    assert rows["spot-v5e"][-1] == "spot" and rows["v4-creating"][4] == "CREATING"
    assert len(rows) == len(standard_nodes())


def test_list_json(env):
    proc = invoke("slice", "list", *C2, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["project"], doc["zone"]) == ("p", "us-central2-b")
    by_name = {n["name"]: n for n in doc["nodes"]}
    assert sorted(by_name) == ["ms-0", "ms-1", "my-v4", "v4-creating", "v4-sick"]
    assert by_name["v4-creating"]["state"] == "CREATING" and by_name["v4-creating"]["ready"] is False
    assert by_name["ms-1"]["spot"] is True and by_name["my-v4"]["topology"] == "2x2x4"


def test_list_empty_zone(env):
    proc = invoke("slice", "list", "--zone", "asia-east1-c", "--project", "p", env=env)
    assert proc.returncode == 0
    assert proc.stdout == "" and "no TPU nodes in zone asia-east1-c of project p" in flat(proc.stderr)


def test_slice_help_lists_commands(tmp_path):
    proc = invoke("slice", "--help", env=cli_env(tmp_path / "home"))
    assert proc.returncode == 0
    assert "describe" in proc.stdout and "list" in proc.stdout


def test_rich_rendering_on_a_terminal(env):
    env["FORCE_COLOR"] = "1"  # rich treats stdout as a terminal: tables instead of key: value lines
    proc = invoke("slice", "describe", "my-v4", *C2, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "internal IP" in proc.stdout and "10.130.0.5" in proc.stdout and "name: my-v4" not in proc.stdout
    listed = invoke("slice", "list", *C2, env=env)
    assert listed.returncode == 0 and "TOPOLOGY" in listed.stdout and "v4-creating" in listed.stdout

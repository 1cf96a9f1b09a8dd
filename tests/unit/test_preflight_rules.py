"""The preflight's comparisons, over forged host reports (what `HostAgent.preflight` answers)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tpulaunch.host.protocol import PreflightReport
from tpulaunch.plan import topology as T
from tpulaunch.plan.launch import build_plan
from tpulaunch.plan.mesh import plan_mesh
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint
from tpulaunch.run.preflight import findings, ports, requests


def _plan(num_slices: int = 1, jax: bool = False):
    t = T.resolve(accelerator="v4-16")
    slices = [SliceSpec(name=f"s{i}", accelerator_type="v4-16", topology="2x2x2", source="ray",
                        workers=tuple(WorkerEndpoint(w, f"10.0.{i}.{w + 2}") for w in range(2)), slice_index=i)
              for i in range(num_slices)]
    return build_plan(slices=slices, mesh=plan_mesh(t, num_slices=num_slices), script="train.py", run_id="r",
                      coordinator_port=8476, group_port=8478, jax_coordinator_port=8477 if jax else None,
                      emulated=False, metadata_server=True, log_dir="/runs/r", workdir="/w",
                      framework="jax" if jax else "torch_xla")


def _report(plan, i: int, **probe) -> PreflightReport:
    h = plan.hosts[i]
    base = {"versions": {"python": "3.11.7", "tpulaunch": "0.1.0", "jax": "0.10.2", "jaxlib": "0.10.2"},
            "script_sha256": "aa" * 32, "workdir_sha256": "bb" * 32,
            "connect": [[plan.endpoints.host, p, w, "refused"] for p, w in ports(plan)] if i else [],
            "bind": [[p, w, True] for p, w in ports(plan)] if i == 0 else [],
            "disk_free": {"compile cache": 50 << 30, "log dir": 50 << 30}, "mem_available": 8 << 30}
    base.update(probe)
    return PreflightReport(i, base, str(h.worker_id), str(h.worker_id), h.slice_name)


def test_a_healthy_slice_has_no_findings():
    plan = _plan(2, jax=True)
    assert findings(plan, [_report(plan, i) for i in range(4)]) == []


def test_requests_send_every_other_host_to_process_0s_ports():
    plan = _plan(2, jax=True)
    reqs = requests(plan)
    assert reqs[0].connect == () and [p for p, _ in reqs[0].bind] == [8476, 8478, 8477, 8081]
    assert [(h, p) for h, p, _ in reqs[3].connect] == [("10.0.0.2", p) for p in (8476, 8478, 8477, 8081)]
    assert reqs[3].bind == ()


def test_another_version_on_one_host():
    plan = _plan()
    reports = [_report(plan, 0), _report(plan, 1, versions={"python": "3.11.7", "tpulaunch": "0.1.0", "jax": "0.9.0",
                                                              "jaxlib": "0.10.2"})]
    (f,) = findings(plan, reports)
    assert f.error and f.hosts == (1,)
    assert f.line() == "host 1 has jax 0.9.0, the others jax 0.10.2. install the same jax on every host"


def test_a_patch_version_apart_is_a_warning():
    plan = _plan()
    (f,) = findings(plan, [_report(plan, 0), _report(plan, 1, versions={"python": "3.11.9", "tpulaunch": "0.1.0",
                                                                        "jax": "0.10.2", "jaxlib": "0.10.2"})])
    assert not f.error and "host 1 has python 3.11.9, the others python 3.11.7 (a patch version apart)" in f.line()


def test_a_package_missing_on_one_host():
    plan = _plan()
    (f,) = findings(plan, [_report(plan, 0), _report(plan, 1, versions={"python": "3.11.7", "tpulaunch": "0.1.0",
                                                                        "jaxlib": "0.10.2"})])
    assert f.error and "host 1 has no jax, the others jax 0.10.2" in f.what


def test_another_script_on_one_host():
    plan = _plan()
    (f,) = findings(plan, [_report(plan, 0), _report(plan, 1, script_sha256="cc" * 32)])
    assert f.error and "host 1 would run other code than the others: the script train.py differs" in f.what


def test_a_blocked_port_names_the_hosts_and_the_port():
    plan = _plan(2, jax=True)
    reports = [_report(plan, 0)] + [_report(plan, i, connect=[[plan.endpoints.host, 8477, "the JAX coordinator", "timeout"]])
                                    for i in (1, 2, 3)]
    (f,) = findings(plan, reports)
    assert f.line().startswith("hosts 1,2,3 cannot reach host 0:8477 (the JAX coordinator): timeout. open the port")


def test_a_port_process_0_cannot_listen_on():
    plan = _plan()
    (f,) = findings(plan, [_report(plan, 0, bind=[[8476, "MASTER_PORT", False]]), _report(plan, 1)])
    assert f.error and f.what == "host 0 cannot listen on port 8476 (MASTER_PORT): something else holds it"


def test_a_held_tpu():
    plan = _plan()
    r1 = replace(_report(plan, 1), tpu_holders=("pid 77 (python old_train.py)",))
    (f,) = findings(plan, [_report(plan, 0), r1])
    assert f.line() == ("host 1's TPU is held: pid 77 (python old_train.py). rerun with --kill-stale, or"
                        " `tpulaunch cluster doctor --kill-stale` on that host")
    stale = replace(_report(plan, 1), stale_lockfile="/tmp/libtpu_lockfile")
    (w,) = findings(plan, [_report(plan, 0), stale])
    assert not w.error and w.what == "host 1 has a stale libtpu lockfile /tmp/libtpu_lockfile (no process holds it)"


@pytest.mark.parametrize("field, value, says", [
    ("label_worker_id", "0", "Ray label ray.io/tpu-worker-id says 0"),  # a duplicated worker id in the labels
    ("node_worker_id", "3", "node env TPU_WORKER_ID says 3"),
    ("metadata_worker_id", "0", "metadata agent-worker-number says 0"),
    ("label_slice", "other", "its Ray label says slice other"),
])
def test_identities_that_disagree_with_the_plan(field, value, says):
    plan = _plan()
    (f,) = findings(plan, [_report(plan, 0), replace(_report(plan, 1), **{field: value})])
    assert f.error and f.hosts == (1,) and "host 1 is planned as worker 1 of s0, but" in f.what and says in f.what


def test_low_disk_and_memory_are_warnings():
    plan = _plan()
    out = findings(plan, [_report(plan, 0, disk_free={"compile cache": 100 << 20, "log dir": None}),
                          _report(plan, 1, mem_available=200 << 20)])
    assert [(f.error, f.what) for f in out] == [
        (False, "host 0 has 100 MiB free under its compile cache"),
        (False, "host 1 has 200 MiB of memory available")]


def test_a_host_that_could_not_be_checked_is_an_error():
    plan = _plan()
    (f,) = findings(plan, [_report(plan, 0), replace(_report(plan, 1), error="the probe exited 1: boom", probe={})])
    assert f.error and f.what == "host 1 could not be checked: the probe exited 1: boom"


def test_the_probe_reads_versions_as_importlib_metadata_finds_them(tmp_path):
    """The probe reads METADATA itself (importlib.metadata's imports cost every host half its start):
    the same answer as `importlib.metadata.version`, first entry on the path first."""
    from importlib import metadata

    from tpulaunch.host import probe

    def dist(root, dirname, version, meta="METADATA"):
        d = root / dirname
        d.mkdir(parents=True)
        (d / meta).write_text(f"Metadata-Version: 2.1\nName: x\nVersion: {version}\n\nVersion: not this\n")

    first, second = tmp_path / "first", tmp_path / "second"
    dist(first, "torch-2.9.0+cpu.dist-info", "2.9.0+cpu")
    dist(second, "torch-2.8.0.dist-info", "2.8.0")
    dist(second, "torch_xla-2.9.0.dist-info", "2.9.0")
    dist(second, "libtpu_nightly-0.1.dev20251101.dist-info", "0.1.dev20251101")
    dist(second, "jax-0.4.38-py3.11.egg-info", "0.4.38", meta="PKG-INFO")
    dist(second, "jaxlib.egg-info", "0.4.38", meta="PKG-INFO")
    dist(second, "Ray-2.60.0.dist-info", "2.60.0")
    (second / "not-a-dist.txt").write_text("")
    path = [str(first), str(second), str(tmp_path / "missing")]

    got = probe.versions(path)

    def want(name):
        try:
            return next(iter(metadata.distributions(name=name, path=path))).version
        except StopIteration:
            return None

    expected = {n: want(n) for n in probe.PACKAGES if want(n) is not None}
    assert {k: v for k, v in got.items() if k != "python"} == expected
    assert got["torch"] == "2.9.0+cpu" and "libtpu" not in got and got["libtpu-nightly"] == "0.1.dev20251101"

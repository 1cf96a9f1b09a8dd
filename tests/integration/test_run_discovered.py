"""`tpulaunch run --tpu NAME` against the fake Cloud TPU API, with no TPU and no Ray cluster:
the discovered topology is emulated on this machine, and the output says so."""

from __future__ import annotations

import json
import textwrap

from fakes.tpu_api_server import FakeTpuApi, standard_nodes, standard_queued_resources

from support import cli_env, run_cli

SCRIPT = """
    import tpulaunch
    ctx = tpulaunch.context()
    print("on", ctx.slice_name, ctx.accelerator_type, ctx.topology, "host", ctx.process_index, "emulated", ctx.emulated)
"""


def _env(tmp_path, api):
    # project and zone are given as flags, so no gcloud is consulted
    return cli_env(TPULAUNCH_TPU_API_ENDPOINT=api.url, TPULAUNCH_HOME=str(tmp_path / "tpl"))


def test_discovered_slice_is_emulated_when_no_cluster_is_given(tmp_path):
    (tmp_path / "where.py").write_text(textwrap.dedent(SCRIPT))
    with FakeTpuApi(standard_nodes(), standard_queued_resources()) as api:
        env = _env(tmp_path, api)
        dry = run_cli("run", "where.py", "--tpu", "my-v4", "--zone", "us-central2-b", "--project", "p",
                      "--dry-run", "--json", cwd=tmp_path, env=env)
        assert dry.returncode == 0, dry.stderr
        plan = json.loads(dry.stdout)
        assert plan["emulated"] is True
        assert plan["topology"]["accelerator_type"] == "v4-32" and plan["topology"]["topology"] == "2x2x4"
        assert [h["env"]["TPU_NAME"] for h in plan["hosts"]] == ["my-v4"] * 4
        assert "emulating the discovered slice my-v4 (v4-32, 2x2x4)" in dry.stderr

        # run on the fake's 2-host slice (a 7x one, described by its acceleratorConfig alone)
        run = run_cli("run", "where.py", "--tpu", "my-v7x", "--zone", "us-central1-c", "--project", "p",
                      "--framework", "none", "--log-dir", str(tmp_path / "runs"), cwd=tmp_path, env=env, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "EMULATED slice" in run.stderr and "emulating the discovered slice my-v7x (tpu7x-16, 2x2x2)" in run.stderr
    for i in range(2):
        assert f"[host {i}] on my-v7x tpu7x-16 2x2x2 host {i} emulated True" in run.stdout, run.stdout


def test_flags_that_contradict_the_discovered_slice_are_an_error(tmp_path):
    (tmp_path / "where.py").write_text(textwrap.dedent(SCRIPT))
    with FakeTpuApi(standard_nodes(), standard_queued_resources()) as api:
        proc = run_cli("run", "where.py", "--tpu", "my-v4", "--zone", "us-central2-b", "--project", "p",
                       "--topology", "2x8", "--dry-run", cwd=tmp_path, env=_env(tmp_path, api))
    assert proc.returncode == 2, proc.stderr
    assert "my-v4" in proc.stderr and "2x8" in proc.stderr and "Traceback" not in proc.stderr

"""`tpulaunch run --tpu NAME` against the fake Cloud TPU API, with no TPU and no Ray cluster:
the discovered topology is emulated on this machine, and the output says so.

That cold run (its own emulated cluster) is started as a CI step would, leading its own process
group: it returns only once every process it started has exited, so a step that kills its group
right after sees nothing of it. Its script closes its stdout before a clean exit: the host's exit
code is still the script's, 0."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from fakes.tpu_api_server import FakeTpuApi, standard_nodes, standard_queued_resources

from support import cli_env, run_cli
from tpulaunch import procfs

SCRIPT = """
    import sys
    import tpulaunch
    ctx = tpulaunch.context()
    print("on", ctx.slice_name, ctx.accelerator_type, ctx.topology, "host", ctx.process_index, "emulated", ctx.emulated)
    sys.stdout.close()
"""


def _env(tmp_path, api):
    # project and zone are given as flags, so no gcloud is consulted
    return cli_env(TPULAUNCH_TPU_API_ENDPOINT=api.url, TPULAUNCH_HOME=str(tmp_path / "tpl"))


@pytest.mark.lifecycle
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
        run = subprocess.Popen([sys.executable, "-m", "tpulaunch", "run", "where.py", "--tpu", "my-v7x", "--zone",
                                "us-central1-c", "--project", "p", "--framework", "none", "--log-dir",
                                str(tmp_path / "runs")], cwd=tmp_path, env=env, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = run.communicate(timeout=400)
    assert run.returncode == 0, err[-3000:]
    assert _process_group(run.pid) == [], "left in the run's process group"
    assert "EMULATED slice" in err and "emulating the discovered slice my-v7x (tpu7x-16, 2x2x2)" in err
    for i in range(2):
        assert f"[host {i}] on my-v7x tpu7x-16 2x2x2 host {i} emulated True" in out, out


def _process_group(pgid: int) -> list[tuple[int, str, str]]:
    """Every process in the group `pgid`: (pid, state, name); zombies too, as a process not yet waited
    for is still in it."""
    return [(p.pid, p.state(), p.name()) for p in procfs.processes() if p.pgid() == pgid]


def test_flags_that_contradict_the_discovered_slice_are_an_error(tmp_path):
    (tmp_path / "where.py").write_text(textwrap.dedent(SCRIPT))
    with FakeTpuApi(standard_nodes(), standard_queued_resources()) as api:
        proc = run_cli("run", "where.py", "--tpu", "my-v4", "--zone", "us-central2-b", "--project", "p",
                       "--topology", "2x8", "--dry-run", cwd=tmp_path, env=_env(tmp_path, api))
    assert proc.returncode == 2, proc.stderr
    assert "my-v4" in proc.stderr and "2x8" in proc.stderr and "Traceback" not in proc.stderr

"""The Python client refuses what the CLI refuses, with the same line, before anything is submitted.

Both go through `run.runner.OnTheHead.check` (the request checked once, then what its recovery
needs of the cluster). The cluster is a recorded one whose head is elsewhere, so nothing here
connects anywhere: the refusals come before the job API is ever asked.
"""

from __future__ import annotations

import os

import pytest

import tpulaunch
from fakes import invoke
from support import cli_env, write_scripts
from tpulaunch.cluster.record import ClusterInfo, RemoteSpec, save_record
from tpulaunch.errors import ExitCode, TpulaunchError
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint

SLICE = SliceSpec(name="s", accelerator_type="v4-16", topology="2x2x2", source="tpu-api", zone="z", project="p",
                  workers=(WorkerEndpoint(0, "10.0.0.2"), WorkerEndpoint(1, "10.0.0.3")))
HEAD_ON_SLICE = ClusterInfo(address="10.0.0.2:6379", temp_dir=None, token_path=None, emulated=False, slices=[SLICE],
                            remote=RemoteSpec(("s",), "z", "p", 6379, "/tmp/ray", "python3"))
BY_ADDRESS = ClusterInfo(address="10.0.0.1:6379", temp_dir=None, token_path=None, emulated=False, slices=[SLICE])

CASES = [  # (cluster, CLI flags, client options, what the line says)
    (HEAD_ON_SLICE, ["--recreate", "--max-preemptions", "1"], {"recreate": True, "max_preemptions": 1}, "--head local"),
    (HEAD_ON_SLICE, ["--replace-hung"], {"replace_hung": True}, "--replace-hung without --max-restarts"),
    (BY_ADDRESS, ["--replace-hung", "--max-restarts", "1"], {"replace_hung": True, "max_restarts": 1},
     "no --min-slices lets the run drop a hung slice"),
    (BY_ADDRESS, ["--max-restarts", "-1"], {"max_restarts": -1}, "--max-restarts -1 is not a count from 0 to"),
    (BY_ADDRESS, ["--env", "1BAD=x"], {"env": {"1BAD": "x"}}, "1BAD"),
]


@pytest.mark.parametrize("cluster, flags, options, says", CASES, ids=[c[3][:30] for c in CASES])
def test_the_client_refuses_what_the_cli_refuses_with_the_same_line(tmp_path, monkeypatch, cluster, flags, options,
                                                                     says):
    (tmp_path / "work").mkdir()
    work = write_scripts(tmp_path / "work", {"train.py": "print('never runs')\n"})
    home = tmp_path / "home"
    home.mkdir()
    save_record(cluster, home / "cluster.json")
    env = cli_env(TPULAUNCH_HOME=str(home))
    env.pop("RAY_ADDRESS", None)
    proc = invoke("run", "train.py", "--address", "auto", *flags, cwd=work, env=env)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == ExitCode.USAGE and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert says in errors[0], errors[0]

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(work)
    opts = dict(options)
    with pytest.raises(TpulaunchError) as e:
        tpulaunch.Client("auto").submit("train.py", **opts)
    assert e.value.exit_code == ExitCode.USAGE
    assert errors[0] == f"error: {e.value.line()}"
    assert os.listdir(home) == ["cluster.json"]  # nothing submitted, nothing written

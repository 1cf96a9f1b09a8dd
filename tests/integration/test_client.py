"""The control plane from outside: a detached run's secret is seen nowhere but in its hosts, and the
Python client (`tpulaunch.Client`, `tpulaunch.launch`) drives runs on an emulated slice (conftest.py
`side_cluster`) as a notebook would (submit, status, follow logs, wait, stop, list), from a process
of its own.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support import SHARED, SHARED_HOSTS, run_cli, status_doc, write_scripts
from tpulaunch.cluster.jobs import JobApi
from tpulaunch.cluster.emulated import ray_temp_dir
from tpulaunch.run import detached

SCRIPTS = {
    "probe.py": """
        import hashlib, os, sys, time, tpulaunch
        ctx = tpulaunch.context()
        value = os.environ.get("TL_PROBE_SECRET", "")
        print(f"host {ctx.process_index} has the secret: sha256 {hashlib.sha256(value.encode()).hexdigest()}", flush=True)
        for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 0):
            tpulaunch.heartbeat(step=i)
            print(f"step {i}", flush=True)
            time.sleep(0.5)
    """,
}

CLIENT = """
    import json, sys
    import tpulaunch

    client = tpulaunch.Client("auto")
    out = {}
    run = client.submit("probe.py", topology="2x2x2", accelerator="v5p", args=["3"], env={"TL_PROBE_SECRET": "notebook"}, framework="none")
    out["id"] = run.id
    out["first_state"] = str(run.status().state)
    out["lines"] = [line for line in run.logs(follow=True)]
    out["code"] = run.wait(timeout=300)
    out["final"] = run.status().to_dict()
    long = client.submit("probe.py", topology="2x2x2", accelerator="v5p", args=["600"], framework="none")
    import time
    while long.status().state is not tpulaunch.RunState.RUNNING:
        time.sleep(0.3)
    stopped = long.stop()
    out["stopped"] = [str(stopped.state), stopped.exit_code, long.wait()]
    out["runs"] = [r.id for r in client.runs()][:2]
    try:
        client.submit("probe.py", topology="2x2x2", accelerator="v5p", env={"1BAD": "x"})
    except tpulaunch.TpulaunchError as e:
        out["bad"] = [type(e).__name__, e.exit_code, e.line()]
    summary = tpulaunch.launch("probe.py", topology="2x2x2", accelerator="v5p", args=["1"], address="auto", framework="none")
    out["launch"] = [type(summary).__name__, summary.exit_code, len(summary.hosts)]
    ended = client.run(out["id"]).summary()  # the first run's summary.json, read back from the head
    out["summary"] = [ended.exit_code, str(ended.outcome), [str(a.outcome) for a in ended.attempts],
                      sorted(h.exit_code for h in ended.hosts)]
    print("CLIENT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("client"), SCRIPTS)


def _api(side_cluster) -> JobApi:
    info = side_cluster["info"]
    return JobApi("http://" + info["dashboard"] if "://" not in info["dashboard"] else info["dashboard"],
                  Path(info["token_path"]).read_text().strip())


@pytest.mark.cluster
def test_a_detached_runs_env_values_reach_its_hosts_and_nothing_else(side_cluster, work):
    secret = "tlsecret-" + secrets.token_hex(12)
    digest = hashlib.sha256(secret.encode()).hexdigest()
    sub = run_cli("run", "probe.py", *SHARED, "--address", "auto", "--framework", "none", "--detach",
                  "--env", f"TL_PROBE_SECRET={secret}", "--", "600", cwd=work, env=side_cluster["env"])
    assert sub.returncode == 0, sub.stderr
    run_id = sub.stdout.strip().splitlines()[-1]
    assert secret not in sub.stdout + sub.stderr
    api = _api(side_cluster)
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # while it runs: every process's command line
        status = status_doc(side_cluster["env"], run_id)
        if status["state"] == "running" and any(h["step"] for h in status["hosts"]):
            break
        time.sleep(0.5)
    seen["ps"] = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    seen["job list"] = api._request("GET", "/api/jobs/").decode()
    seen["job info"] = api._request("GET", f"/api/jobs/{run_id}").decode()
    seen["runs --json"] = run_cli("runs", "--json", env=side_cluster["env"]).stdout
    seen["status --json"] = run_cli("status", run_id, "--json", env=side_cluster["env"]).stdout
    seen["logs"] = run_cli("logs", run_id, env=side_cluster["env"]).stdout
    assert "step" in seen["logs"] and f"sha256 {digest}" in seen["logs"]  # the hosts got it
    job = api.info(run_id)
    assert job is not None and job.status == "RUNNING" and "supervise --request" in job.entrypoint
    # the request was read once and is gone from the cluster's store
    with pytest.raises(Exception, match="404"):
        api._request("GET", "/api/packages/gcs/" + detached.request_uri(run_id).removeprefix("gcs://"))
    stop = run_cli("stop", run_id, env=side_cluster["env"], timeout=200)  # its files are written as it ends
    assert stop.returncode == 0, stop.stderr
    temp = Path(side_cluster["info"]["token_path"]).parent  # the head is this machine: the run's files
    status_file = Path(ray_temp_dir(str(temp))) / "session_latest" / "logs" / detached.RUNS_SUBDIR / run_id / "status.json"
    seen["status.json"] = status_file.read_text()
    seen["summary.json"] = (status_file.parent / "summary.json").read_text()
    for where, text in seen.items():
        assert secret not in text, f"the secret shows in {where}"
    assert digest in seen["logs"]


@pytest.mark.cluster
def test_the_python_client_drives_runs_as_a_notebook_would(side_cluster, work, tmp_path):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CLIENT)], cwd=work, env=side_cluster["env"],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("CLIENT "))
    out = json.loads(line.removeprefix("CLIENT "))
    assert out["first_state"] in ("pending", "running")
    for host in range(SHARED_HOSTS):
        assert f"[host {host}] step 2" in out["lines"]
    assert out["code"] == 0
    final = out["final"]
    assert final["state"] == "succeeded" and final["exit_code"] == 0 and len(final["hosts"]) == SHARED_HOSTS
    assert out["stopped"][0] == "stopped" and out["stopped"][1:] == [143, 143]
    assert out["runs"][1] == out["id"]  # newest first: the stopped run, then the first
    assert out["bad"] == ["LaunchError", 2, "--env '1BAD=x' is not KEY=VALUE. write it as --env NAME=value"]
    assert out["launch"] == ["RunSummary", 0, SHARED_HOSTS]
    assert out["summary"] == [0, "ok", ["ok"], [0] * SHARED_HOSTS]

"""Preempted slices come back by themselves: `slice create`, `cluster up --tpu --head local --setup`,
a detached run with `--max-preemptions --recreate`, and Google Cloud's preemption played by the fake
Cloud TPU API (node PREEMPTED, its VMs' processes killed and disks wiped, the queued resource
SUSPENDED) while the fake gcloud runs every worker on this machine. Ray is real; the product talks
to the fakes with its production client code.

In order: on a one-slice cluster, a preemption the run survives (re-created, set up, rejoined,
resumed from its checkpoint, exit 0), and a run stopped in preflight by a process holding the libtpu
lockfile; then a cluster of two slices (`cluster up --tpu A --tpu B
--head local`), where a multislice run loses one slice and only that one is made again, then the
other with the budget spent (exit 75); then, A made again by hand and joined, an elastic run
(`--min-slices 1`) that goes on on A while B is re-created, then grows back to both; last, on the
cluster it leaves, a stockout on re-create (exit 75: still waiting for capacity); the slice it left
waiting, and one a stopped run was making again, brought back by `cluster repair`; and `cluster down`
leaves nothing behind.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest

from fakes import closed_port, cli_env, run_cli
from fakes.tpu_api_server import FakeTpuApi
from support import live_processes, status_doc
from tpulaunch.errors import ExitCode
from tpulaunch.host.tpu_holders import LOCKFILE

from test_cluster_remote import _cmdline, end_leftovers, procs_of, ssh_commands

ZONE = "us-central2-b"
NAME = "rs-v4"
WORKERS = 2
SCRIPT = """\
import json, os, time
import tpulaunch

ctx = tpulaunch.context()
ckpt = os.path.join(os.environ["CKPT_DIR"], f"host-{ctx.process_index}.json")
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
print(f"attempt {ctx.restart_count} host {ctx.process_index} starts at step {step}", flush=True)
print(f"host {ctx.process_index} is slice {os.environ.get('MEGASCALE_SLICE_ID', '-')}"
      f" of {os.environ.get('MEGASCALE_NUM_SLICES', '1')}", flush=True)
print(f"host {ctx.process_index} attempt {ctx.restart_count} is a {ctx.attempt_reason} on {ctx.num_slices}"
      f" of {ctx.full_num_slices} slices", flush=True)
# the first attempt, and one on fewer slices (it is stopped to grow back), run until stopped
stop = step + int(os.environ.get("STEPS_AFTER_RESUME", "6")) if step and ctx.attempt_reason != "shrink" else 10_000
while step < stop:
    time.sleep(0.3)
    step += 1
    if step % 2 == 0:  # a checkpoint every 2 steps, on storage every VM sees (a bucket, in real life)
        with open(ckpt + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(ckpt + ".tmp", ckpt)
        tpulaunch.heartbeat(step=step, checkpoint=True)
        print(f"step {step} saved", flush=True)
print(f"host {ctx.process_index} done at step {step}", flush=True)
"""


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    """The fake Cloud TPU API (no slices yet) and the fake gcloud reading the VMs it makes."""
    base = tmp_path_factory.mktemp("recreate")
    slices = base / "slices.json"
    temp_dir = f"/tmp/tplr-{uuid.uuid4().hex[:8]}"
    with FakeTpuApi(wait_s=0.2, provision_s=0.3, suspend_s=0.5, gcloud_slices=str(slices)) as api:
        env = cli_env(base / "home", gcloud=True, TPULAUNCH_HOME=str(base / "tplhome"),
                      TPULAUNCH_TPU_API_ENDPOINT=api.url, FAKE_GCLOUD_LOG=str(base / "gcloud.log"),
                      FAKE_GCLOUD_SLICES=str(slices),
                      # Ray's own knob, as a deployment may set it: the head declares a dead VM's node
                      # dead after 3 missed 1 s health checks (default 5 x 3 s), so each loss is seen sooner
                      RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")
        ctx = {"api": api, "env": env, "base": base, "temp_dir": temp_dir, "port": closed_port(),
               "log": base / "gcloud.log", "ckpt": base / "ckpt"}
        try:
            yield ctx
        finally:
            rec = Path(env["TPULAUNCH_HOME"]) / "cluster.json"
            dirs = [temp_dir] + ([json.loads(rec.read_text())["temp_dir"]] if rec.exists() else [])
            if rec.exists():  # a test failed before its `cluster down`
                run_cli("cluster", "down", env=env, timeout=120)
            left = end_leftovers(dirs)
            assert not left, f"cluster processes left behind: {left}"


def cli(cloud, *args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return run_cli(*args, env={**cloud["env"], **env}, cwd=cloud["base"], timeout=timeout)


def wait_for_end(cloud, run_id: str, timeout: float) -> subprocess.CompletedProcess:
    """`tpulaunch wait RUN --json`; a run still going after `timeout` fails the test with the run's
    own output (read while the head is still up: the module's `cluster down` removes it)."""
    try:
        return cli(cloud, "wait", run_id, "--json", timeout=timeout)
    except subprocess.TimeoutExpired:
        status = cli(cloud, "status", run_id, timeout=60).stdout
        lines = cli(cloud, "logs", run_id, timeout=60).stdout.splitlines()
        ours = "\n".join(ln for ln in lines if ln.startswith("tpulaunch:"))  # the launcher's, not the steps
        cli(cloud, "stop", run_id, timeout=120)  # its hosts free for the next test
        pytest.fail(f"run {run_id} still going after {timeout:g} s\n{status}\n--- tpulaunch's lines ---\n{ours}\n"
                    f"--- the last of its output ---\n" + "\n".join(lines[-20:]) + "\n" + vm_ray_logs(cloud))


def vm_ray_logs(cloud) -> str:
    """The end of every fake VM's raylet logs, each session's (the fake keeps a VM's /tmp at
    `<path>-vm<slice>-<worker>` here; `cluster down` removes them), without Ray's periodic state
    dumps, which would crowd out the lines that say why a raylet ended."""
    out = []
    vms = Path(cloud["temp_dir"])
    for log in sorted(vms.parent.glob(vms.name + "-vm*/session_2*/logs/raylet.*")):
        if log.suffix in (".out", ".err") and log.stat().st_size:
            said = [ln for ln in log.read_text(errors="replace").splitlines() if not ln.startswith("[state-dump]")]
            out.append(f"--- {log} ---\n" + "\n".join(said[-25:]))
    return "\n".join(out)


def preempt(cloud, node: str, shutdown_s: float = 0.0) -> None:
    """What Google Cloud does to a spot slice, through the fake's test-only control endpoint; with
    `shutdown_s` its VMs' scripts die that long before their agents and raylets (a soft-off)."""
    doc = {"node": node, "shutdown_s": shutdown_s}
    req = urllib.request.Request(cloud["api"].url + "/_fake/preempt", data=json.dumps(doc).encode(), method="POST")
    urllib.request.urlopen(req, timeout=30).read()


def submit(cloud, *more: str) -> str:
    (cloud["base"] / "train.py").write_text(SCRIPT)
    cloud["ckpt"].mkdir(exist_ok=True)
    for f in cloud["ckpt"].iterdir():
        f.unlink()
    sub = cli(cloud, "run", "train.py", "--address", "auto", "--framework", "none", "--detach", "--recreate",
              "--env", f"CKPT_DIR={cloud['ckpt']}", *more, timeout=120)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip()


def wait_for_checkpoints(cloud, run_id: str, step: int = 4, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    files = [cloud["ckpt"] / f"host-{w}.json" for w in range(WORKERS)]
    while not all(f.exists() and json.loads(f.read_text())["step"] >= step for f in files):
        assert time.monotonic() < end, "no checkpoints: " + cli(cloud, "logs", run_id, timeout=60).stdout[-3000:]
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(cloud):
    """`slice create --spot --wait`, then `cluster up --tpu --head local --setup-script`: the head
    here, the workers set up and joined to it."""
    made = cli(cloud, "slice", "create", NAME, "--accelerator", "v4-16", "--spot", "--wait", "--zone", ZONE,
               "--project", "p")
    assert made.returncode == 0, made.stderr
    # (a test makes the set-up slow with a flag file, to preempt a slice while it is being set up)
    setup = (f"echo \"setup worker $TPU_WORKER_ID\" >> {cloud['base']}/setup-runs.txt\n"
             f"if [ -e {cloud['base']}/slow-setup ]; then sleep 5; fi\necho ready\n")
    (cloud["base"] / "setup.sh").write_text(setup)
    up = cli(cloud, "cluster", "up", "--tpu", NAME, "--zone", ZONE, "--project", "p", "--head", "local",
             "--head-ip", "127.0.0.2", "--port", str(cloud["port"]), "--ray-temp-dir", cloud["temp_dir"],
             "--setup-script", str(cloud["base"] / "setup.sh"), "--json")
    assert up.returncode == 0, up.stderr
    cloud["head_dir"] = json.loads((Path(cloud["env"]["TPULAUNCH_HOME"]) / "cluster.json").read_text())["temp_dir"]
    return {**cloud, "up": json.loads(up.stdout), "setup": setup}


def test_a_preempted_slice_is_recreated_rejoined_and_the_run_resumes(cluster):
    cloud, api, doc = cluster, cluster["api"], cluster["up"]
    assert doc["remote"]["head"] == "local" and doc["remote"]["setup"] == cluster["setup"]
    starts = [(w, c) for w, c in ssh_commands(cloud["log"]) if "tpulaunch-ray-start" in c]
    assert sorted(w for w, _ in starts) == list(range(WORKERS))
    assert all("--head" not in c and f"--address 127.0.0.2:{cloud['port']}" in c for _, c in starts)
    assert procs_of(cloud["head_dir"]), "the head does not run here"
    assert sorted((cloud["base"] / "setup-runs.txt").read_text().splitlines()) == ["setup worker 0", "setup worker 1"]

    run_id = submit(cloud, "--max-preemptions", "1", "--preemption-wait", "240")
    wait_for_checkpoints(cloud, run_id)
    t0 = time.monotonic()
    preempt(cloud, NAME)
    saved = {w: json.loads((cloud["ckpt"] / f"host-{w}.json").read_text())["step"] for w in range(WORKERS)}
    while status_doc(cloud["env"], run_id)["state"] == "running":
        assert time.monotonic() - t0 < 120, "the loss was never noticed"
        time.sleep(0.5)
    noticed = time.monotonic() - t0
    wait = wait_for_end(cloud, run_id, 400)
    print(f"preemption noticed after {noticed:.1f} s; the run ended {time.monotonic() - t0:.1f} s after it")
    log = cli(cloud, "logs", run_id, timeout=60).stdout
    print("\n--- the run's output, from the loss to the relaunch ---\n" + log)
    assert wait.returncode == 0, wait.stdout + wait.stderr + log[-4000:]
    final = json.loads(wait.stdout)
    assert [a["outcome"] for a in final["attempts"]] == ["preempted", "ok"]
    summary = json.loads((Path(final["attempts"][0]["log_dir"]).parent / "summary.json").read_text())
    assert [a["outcome"] for a in summary["attempts"]] == ["preempted", "ok"] and summary["exit_code"] == 0
    assert summary["attempts"][0]["recreated"] == final["attempts"][0]["recreated"]
    (rec,) = final["attempts"][0]["recreated"]
    print("re-created:", json.dumps(rec))
    assert rec["slice"] == NAME and rec["queued_resource"] == NAME
    assert "SUSPEND" in rec["why"] or "PREEMPTED" in rec["why"] or "gone" in rec["why"]
    assert set(rec["steps"]) == {"delete_s", "create_s", "provision_s", "setup_join_s", "ray_whole_s"}
    # the fake's request log: after the preemption, one delete and one create of the queued resource
    assert api.events == [f"create {NAME}", f"preempt {NAME}", f"delete {NAME}", f"create {NAME}"]
    assert [c["body"] for c in api.calls("create_qr")][0] == [c["body"] for c in api.calls("create_qr")][1]
    assert len(api.calls("delete_qr")) == 1
    # the new VMs were set up (again: their disks are new) and joined the same head
    assert_setups(cloud, {"setup worker 0": 2, "setup worker 1": 2}, rec)
    for w in range(WORKERS):  # resumed from its own checkpoint, in attempt 1, and finished
        assert f"attempt 1 host {w} starts at step {saved[w]}" in log or any(
            f"attempt 1 host {w} starts at step {s}" in log for s in range(saved[w], saved[w] + 3))
        assert f"host {w} done at step" in log
    for k in (0, 1):  # every host's log of every attempt is kept
        for w in range(WORKERS):
            one = cli(cloud, "logs", run_id, "--host", str(w), "--attempt", str(k), timeout=60)
            assert one.returncode == 0 and f"attempt {k} host {w}" in one.stdout
    assert "re-creating it" in log and "ACTIVE again" in log


def test_a_process_holding_the_libtpu_lockfile_stops_the_run_in_preflight(cluster):
    """A leftover process on each worker holds the libtpu lockfile: preflight names it (by its pid
    on that worker) on every host and no script starts (exit 78). (The holders are started over
    the fake gcloud, so each runs on its worker; the file itself is this machine's one
    /tmp/libtpu_lockfile, where a slice has one per VM. Emulated hosts hold no TPU and do not look,
    so the shared cluster's runs beside this one are not stopped by it.)"""
    lock = Path("/") / LOCKFILE
    assert not lock.exists(), f"{lock} exists on this machine: this test will not touch another user's TPU lock"

    def on_worker(w: int, command: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(["gcloud", "compute", "tpus", "tpu-vm", "ssh", NAME, "--zone", ZONE, "--project", "p",
                                 f"--worker={w}", "--command", command], env=cluster["env"], text=True, **kw)

    # `cd /tmp` first: the fake moves every /tmp/... path it is given onto the worker's own copy
    holders = [on_worker(w, "cd /tmp && exec 3>libtpu_lockfile && echo $$ && exec sleep 300", stdout=subprocess.PIPE)
               for w in range(WORKERS)]
    pids: list[int] = []
    try:
        pids += [int(h.stdout.readline()) for h in holders]
        run_id = submit(cluster, "--max-preemptions", "1")
        wait = wait_for_end(cluster, run_id, 200)
    finally:
        for w, pid in enumerate(pids):
            on_worker(w, f"kill {pid}").wait(timeout=60)
        for h in holders:
            h.kill()
            h.wait()
        lock.unlink(missing_ok=True)
    log = cli(cluster, "logs", run_id, timeout=60).stdout
    assert wait.returncode == ExitCode.PREFLIGHT, wait.stdout + wait.stderr + log[-3000:]
    for w in range(WORKERS):
        assert f"preflight: host {w}'s TPU is held: pid {pids[w]} (sleep 300)" in log, log[-3000:]
    assert "starts at step" not in log and not list(cluster["ckpt"].iterdir()), "no script may start"


MS = ("ms-a", "ms-b")  # two one-host spot slices, each made by its own queued resource


def up_two_slices(cloud) -> subprocess.CompletedProcess:
    return cli(cloud, "cluster", "up", "--tpu", MS[0], "--tpu", MS[1], "--zone", ZONE, "--project", "p", "--head",
               "local", "--head-ip", "127.0.0.2", "--port", str(cloud["port"]), "--ray-temp-dir", cloud["temp_dir"],
               "--setup-script", str(cloud["base"] / "setup.sh"), "--json")


def wait_for_attempt_1(cloud, run_id: str) -> None:
    end = time.monotonic() + 300
    while True:  # the slice is back and the next attempt runs
        d = status_doc(cloud["env"], run_id)
        if d.get("attempt") == 1 and d["state"] == "running" and all(
                (h.get("last_line") or "").startswith(("attempt 1", "step", "host")) for h in d["hosts"]):
            return
        if d["state"] not in ("running", "restarting") or time.monotonic() >= end:  # the run's own words say why
            pytest.fail(f"{d}\n--- the run's output ---\n" + cli(cloud, "logs", run_id, timeout=60).stdout[-6000:])
        time.sleep(1)


def test_a_multislice_run_recreates_only_the_preempted_slice_and_the_budget_counts_it(cluster):
    """Two slices under one head; a run on both loses ms-b: only ms-b is made again (ms-a's VM and
    Ray node untouched) and the run goes on on both; then ms-a goes too, with --max-preemptions 1
    spent: exit 75 saying so."""
    cloud, api = cluster, cluster["api"]
    down = cli(cloud, "cluster", "down", "--json", timeout=120)  # the one-slice cluster of the test before
    assert down.returncode == 0, down.stderr
    assert cli(cloud, "slice", "delete", NAME, "--zone", ZONE, "--project", "p").returncode == 0
    for name in MS:
        made = cli(cloud, "slice", "create", name, "--accelerator", "v4-8", "--spot", "--wait", "--zone", ZONE,
                   "--project", "p")
        assert made.returncode == 0, made.stderr
    (cloud["base"] / "setup-runs.txt").unlink()
    up = up_two_slices(cloud)
    assert up.returncode == 0, up.stderr
    doc = json.loads(up.stdout)
    assert doc["remote"]["tpus"] == list(MS) and [s["name"] for s in doc["slices"]] == list(MS)
    cloud["head_dir"] = json.loads((Path(cloud["env"]["TPULAUNCH_HOME"]) / "cluster.json").read_text())["temp_dir"]
    status = json.loads(cli(cloud, "cluster", "status", "--json").stdout)
    assert sorted(s["name"] for s in status["slices"]) == list(MS)
    a_raylet = _raylets(cloud["temp_dir"] + f"-vm{_vm_tag(MS[0])}-0")
    assert len(a_raylet) == 1, "slice ms-a's VM runs no raylet"

    run_id = submit(cloud, "--num-slices", "2", "--max-preemptions", "1", "--preemption-wait", "240",
                    "--env", "STEPS_AFTER_RESUME=100000")
    wait_for_checkpoints(cloud, run_id)
    mark = len(api.events)
    # the VM's script dies a second before its agent and raylet: its agent reports `killed by signal
    # 9` first, and the supervisor must still see a preempted slice, not the script's failure
    preempt(cloud, MS[1], shutdown_s=1.0)
    wait_for_attempt_1(cloud, run_id)
    # only ms-b was deleted and made again; ms-a's VM and its Ray node were left alone
    assert api.events[mark:] == [f"preempt {MS[1]}", f"delete {MS[1]}", f"create {MS[1]}"]
    assert _raylets(cloud["temp_dir"] + f"-vm{_vm_tag(MS[0])}-0") == a_raylet
    preempt(cloud, MS[0])
    wait = wait_for_end(cloud, run_id, 300)
    log = cli(cloud, "logs", run_id, timeout=60).stdout
    print("\n--- the run's output ---\n" + log)
    assert wait.returncode == 75, wait.stdout + wait.stderr + log[-4000:]
    final = json.loads(wait.stdout)
    assert [a["outcome"] for a in final["attempts"]] == ["preempted", "lost"]
    (rec,) = final["attempts"][0]["recreated"]
    print("re-created:", json.dumps(rec))
    assert rec["slice"] == MS[1] and rec["queued_resource"] == MS[1] and not final["attempts"][1].get("recreated")
    assert_setups(cloud, {"setup worker 0": 3}, rec)  # ms-a and ms-b by `cluster up`, ms-b's new VM
    assert "preemption budget" in final["note"] or "--max-preemptions" in final["note"], final["note"]
    for w in (0, 1):  # a two-slice run, both attempts, each host resumed from its own checkpoint
        assert f"host {w} is slice {w} of 2" in log and f"attempt 1 host {w} starts at step" in log
    assert f"slice {MS[1]}: ACTIVE again" in log and f"slice {MS[0]}: ACTIVE again" not in log


def assert_setups(cloud, expected: dict[str, int], rec: dict) -> None:
    """The set-up script ran `expected` times per worker: by `cluster up`, and once on the new VMs,
    plus once more for each set-up or join of them that failed and was tried again (a VM slow to
    start Ray on a loaded machine: the re-creation's `join_failures`)."""
    ran = Counter((cloud["base"] / "setup-runs.txt").read_text().splitlines())
    again = len(rec["join_failures"])
    assert set(ran) == set(expected) and all(n <= ran[w] <= n + again for w, n in expected.items()), (ran, rec)


def _raylets(temp_dir: str) -> list[int]:
    """The raylets of the cluster's processes on one VM (their argv or open files name its temp dir)."""
    return sorted(pid for pid, p in live_processes().items() if p["cmdline"].split(b"\0")[0].endswith(b"/raylet")
                  and temp_dir.encode() in p["cmdline"] + p["fds"])


def _vm_tag(name: str) -> str:
    """The fake gcloud's per-VM suffix of /tmp paths (tests/fakes/bin/gcloud `vm_tmp`)."""
    import zlib

    return f"{zlib.crc32(name.encode()) & 0xFFFF:04x}"


def test_an_elastic_run_goes_on_on_a_while_b_is_recreated_then_grows_back(cluster):
    """`--min-slices 1`: preempting ms-b does not stop the run; the next attempt starts at once on
    ms-a while ms-b is made again in the background, and the run grows back to both slices at the
    first checkpoint after ms-b is back in Ray. ms-b is preempted a second time while its new VM is
    being set up: the fake gcloud cannot reach it any more, so the set-up fails, and it is made
    again (a second preemption, counted)."""
    cloud, api = cluster, cluster["api"]
    # the run before ended with ms-a preempted: bring it back by hand, as a person would; `cluster up`
    # again sees its new VM and joins it (ms-b, made again by that run, is still in the cluster)
    for args in (["slice", "delete", MS[0]], ["slice", "create", MS[0], "--accelerator", "v4-8", "--spot", "--wait"]):
        done = cli(cloud, *args, "--zone", ZONE, "--project", "p")
        assert done.returncode == 0, done.stderr
    again = up_two_slices(cloud)
    assert again.returncode == 0, again.stderr
    run_id = submit(cloud, "--num-slices", "2", "--dcn", "data=2", "--min-slices", "1", "--max-preemptions", "3",
                    "--preemption-wait", "240")
    wait_for_checkpoints(cloud, run_id)
    mark = len(api.events)
    slow = cloud["base"] / "slow-setup"
    slow.write_text("")
    preempt(cloud, MS[1])
    end = time.monotonic() + 120
    while api.events[mark:].count(f"create {MS[1]}") < 1:  # made again: its new VM is being set up (slowly)
        assert time.monotonic() < end, api.events[mark:]
        time.sleep(0.1)
    time.sleep(1.0)
    preempt(cloud, MS[1])
    slow.unlink()
    while True:  # the run goes on on ms-a alone, before ms-b is back
        d = status_doc(cloud["env"], run_id)
        if d.get("attempt") == 1 and d["state"] == "running" and len(d["hosts"]) == 1:
            break
        assert d["state"] in ("running", "restarting") and time.monotonic() < end, d
        time.sleep(0.5)
    wait = wait_for_end(cloud, run_id, 400)
    log = cli(cloud, "logs", run_id, timeout=60).stdout
    print("\n--- the run's output ---\n" + log)
    assert wait.returncode == 0, wait.stdout + wait.stderr + log[-4000:]
    final = json.loads(wait.stdout)
    summary = json.loads((Path(final["attempts"][0]["log_dir"]).parent / "summary.json").read_text())
    a = summary["attempts"]
    assert [x["reason"] for x in a] == ["first", "shrink", "grow"], [(x["reason"], x["outcome"]) for x in a]
    assert a[0]["outcome"] in ("lost", "preempted") and [x["outcome"] for x in a[1:]] == ["grown", "ok"]
    assert (a[0]["slices"], a[1]["slices"], a[2]["slices"]) == (list(MS), [MS[0]], list(MS))
    assert summary["preemptions"] == 2 and summary["restarts"] == 0  # the shrink, and ms-b lost again
    first, second = a[1]["recreated"]  # made again twice while attempt 1 ran on ms-a
    assert all(r["slice"] == MS[1] and r["queued_resource"] == MS[1] for r in (first, second))
    assert "PREEMPTED" in first["join_failures"][-1]  # its VM could not be reached any more
    # (the second may have failed a join too, a VM slow to start Ray on a loaded machine: joined again)
    assert api.events[mark:] == [f"preempt {MS[1]}", f"delete {MS[1]}", f"create {MS[1]}"] * 2
    assert "lost again while being brought back" in log
    assert "host 0 attempt 1 is a shrink on 1 of 2 slices" in log
    for w in (0, 1):
        assert f"host {w} attempt 2 is a grow on 2 of 2 slices" in log and f"host {w} done at step" in log
    assert "growing back after the checkpoint of step" in log


def test_a_stockout_on_recreate_ends_the_run_saying_it_is_still_waiting_for_capacity(cluster):
    cloud = cluster  # on the two slices the elastic run before grew back to, still up
    again = up_two_slices(cloud)  # (both are in Ray already, unless the test before failed)
    assert again.returncode == 0, again.stderr
    run_id = submit(cloud, "--num-slices", "2", "--max-preemptions", "1", "--preemption-wait", "4")
    wait_for_checkpoints(cloud, run_id, step=2)
    cloud["api"].set_capacity(stockout=True)
    preempt(cloud, MS[0])
    wait = wait_for_end(cloud, run_id, 300)
    assert wait.returncode == 75, wait.stdout + wait.stderr
    final = json.loads(wait.stdout)
    assert f"queued resource '{MS[0]}' is still WAITING_FOR_RESOURCES" in final["note"], final["note"]
    assert "--preemption-wait 4" in final["note"] and "the zone has no capacity for it now" in final["note"]
    creates_after = [e for e in cloud["api"].events[cloud["api"].events.index("stockout True"):] if e.startswith("create")]
    assert creates_after == [f"create {MS[0]}"]  # made again once, and left waiting; ms-b left alone


def test_a_slice_a_stopped_run_was_making_again_is_repaired_and_the_next_run_finds_it_whole(cluster):
    """A re-creation belongs to the cluster: ms-a's queued resource, asked again by the run before and
    left waiting for capacity, is `not_whole` in `cluster status` (with `cluster repair` named), a
    multislice run is refused meanwhile; `cluster repair` waits for it, sets it up and joins it. Then
    the same after `tpulaunch stop` ends a run while it makes ms-b again (exit 143): repaired, and the
    next run starts on both slices at once."""
    cloud, api = cluster, cluster["api"]
    st = json.loads(cli(cloud, "cluster", "status", "--json").stdout)
    assert MS[0] in st["not_whole"] and MS[1] not in st["not_whole"], st
    plain = cli(cloud, "cluster", "status")
    assert f"slice {MS[0]}: " in plain.stderr and "`tpulaunch cluster repair` brings it back" in plain.stderr
    refused = cli(cloud, "run", "train.py", "--address", "auto", "--framework", "none", "--num-slices", "2",
                  "--detach", timeout=120)
    assert refused.returncode != 0 and "cluster repair" in refused.stderr, refused.stderr
    api.set_capacity(stockout=False)
    fixed = cli(cloud, "cluster", "repair", "--timeout", "240", "--json", timeout=300)
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["repaired"] == [MS[0]]
    assert json.loads(cli(cloud, "cluster", "status", "--json").stdout)["not_whole"] == {}

    run_id = submit(cloud, "--num-slices", "2", "--max-preemptions", "1", "--preemption-wait", "240")
    wait_for_checkpoints(cloud, run_id, step=2)
    api.set_capacity(stockout=True)
    mark = len(api.events)
    preempt(cloud, MS[1])
    end = time.monotonic() + 120
    while f"create {MS[1]}" not in api.events[mark:]:  # the run asked for ms-b again, and waits for capacity
        assert time.monotonic() < end, api.events[mark:]
        time.sleep(0.2)
    stop = cli(cloud, "stop", run_id, timeout=120)
    assert stop.returncode == 0, stop.stderr
    assert wait_for_end(cloud, run_id, 120).returncode == ExitCode.TERMINATED
    st = json.loads(cli(cloud, "cluster", "status", "--json").stdout)
    assert list(st["not_whole"]) == [MS[1]], st
    api.set_capacity(stockout=False)
    fixed = cli(cloud, "cluster", "repair", "--timeout", "240", "--json", timeout=300)
    assert fixed.returncode == 0 and json.loads(fixed.stdout)["repaired"] == [MS[1]], fixed.stderr
    assert api.events[mark:].count(f"create {MS[1]}") == 1  # the queued resource the run asked for, not another
    run_id = submit(cloud, "--num-slices", "2", "--max-preemptions", "1")  # runs on both slices at once
    wait_for_checkpoints(cloud, run_id, step=2)  # (a first attempt runs until stopped)
    assert status_doc(cloud["env"], run_id)["attempt"] == 0
    assert cli(cloud, "stop", run_id, timeout=120).returncode == 0


def test_cluster_down_leaves_nothing_behind_with_a_slice_gone(cluster):
    cloud = cluster
    preempt(cloud, MS[0])  # no run to bring it back: down still ends ms-b and the head
    down = cli(cloud, "cluster", "down", "--json", timeout=120)
    assert down.returncode == 0, down.stderr
    hosts = json.loads(down.stdout)["hosts"]
    assert hosts[f"{MS[0]}/0"]["gone"] and not hosts[f"{MS[1]}/0"].get("gone") and hosts[f"{MS[1]}/0"]["stopped"] > 0
    # (on this one machine ms-b's stop, which ends every process carrying the cluster's id, also
    # reaches the head's: what matters is that the head's stop ran and nothing is left)
    assert "head" in hosts and hosts["head"]["left"] == []
    left = [(pid, _cmdline(pid)) for pid in procs_of(cloud["temp_dir"]) + procs_of(cloud["head_dir"])]
    assert left == [] and not Path(cloud["head_dir"]).exists()

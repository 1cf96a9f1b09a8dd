"""TPU slices on GKE, end to end, against the fake GKE (tests/fakes/gke): its Kubernetes API over
HTTPS, KubeRay's controller and TPU webhook, GKE's TPU device plugin, and kubelets running every pod
in a network, PID and mount namespace of its own on this machine. Ray, JAX and torch_xla are real;
tpulaunch talks to the API with the client it uses in production.

In order, on one fake cluster (3 spot v5p 2x2x2 node pools, one of them autoscaling from zero, and
others that do not fit): Debian's kubectl reads it; `cluster up --gke --autoscaler --spare-slices 1`
brings Ray up on 2 slices of 2 hosts and a spare, GKE's autoscaler making one pool's nodes; the JAX and torch_xla
recipes train there as on an emulated cluster of that shape; a detached run is followed and
stopped; a node is preempted mid-run, the spare takes its slice's place and the run comes back from
its checkpoint, and the lost slice, made again, is the spare; an image of another
tpulaunch is refused and nothing of it is left; `cluster down` leaves no object and no process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fakes import cli_env, run_cli
from fakes.gke import FakeGke, NodePool, tpu_pool
from fakes.gke.kubelet import OWNER_ENV
from support import REPO, live_processes, status_doc, write_scripts
from tpulaunch.cluster.record import QUIET_RAY
from tpulaunch.errors import ExitCode

pytestmark = pytest.mark.lifecycle

KUBECTL = REPO / ".venv" / "kubernetes-client" / "usr" / "bin" / "kubectl"
NAME = "tpl-e2e"
IMAGE = "example.com/tpulaunch:test"
POOLS = [
    NodePool("default-pool", nodes=1),
    tpu_pool("v5p-a", "tpu-v5p-slice", "2x2x2", spot=True),
    tpu_pool("v5p-b", "tpu-v5p-slice", "2x2x2", spot=True, autoscaled=True),  # no nodes until GKE's autoscaler makes them
    tpu_pool("v5p-c", "tpu-v5p-slice", "2x2x2", spot=True),  # the spare slice's
    tpu_pool("v6e-16", "tpu-v6e-slice", "4x4"),  # neither fits the run's shape
    tpu_pool("v5e-8t", "tpu-v5-lite-podslice", "2x4", chips=8),
]
UP = ("cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--num-slices", "2", "--spot",
      "--image", IMAGE, "--name", NAME, "--autoscaler", "--spare-slices", "1")
CKPT_SCRIPT = """\
import json, os, time
import tpulaunch

ctx = tpulaunch.context()
d = os.environ["CKPT_DIR"]
os.makedirs(d, exist_ok=True)
ckpt = os.path.join(d, f"host-{ctx.process_index}.json")
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
print(f"attempt {ctx.restart_count} host {ctx.process_index} starts at step {step}", flush=True)
stop = step + 6 if step else 10_000
while step < stop:
    time.sleep(0.3)
    step += 1
    tpulaunch.heartbeat(step=step, checkpoint=step % 2 == 0)
    if step % 2 == 0:  # on storage every pod sees (a bucket, or Filestore, in real life)
        with open(ckpt + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(ckpt + ".tmp", ckpt)
print(f"host {ctx.process_index} done at step {step}", flush=True)
"""


def _old_tpulaunch(root: Path) -> Path:
    """An image's site-packages with another tpulaunch (0.0.1): what the version check must refuse."""
    pkg = root / "old-image" / "tpulaunch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.0.1"\n')
    return pkg.parent


@pytest.fixture(scope="module")
def gke(tmp_path_factory):
    shared = Path(tempfile.mkdtemp(prefix="tplt-gke-shared-", dir="/var/tmp"))  # not /tmp: a pod's /tmp is its own
    old = _old_tpulaunch(shared)
    # The test images carry what an image for one machine would (Dockerfile ENV): every pod is a Ray
    # node on this one machine, so Ray's per-node background work is kept as low as on an emulated
    # cluster (QUIET_RAY: each node's reporter would otherwise walk every process here every 5 s), and
    # XLA compiles for the CPU as every process of the suite does (conftest.py: XLA_FLAGS).
    image = {**QUIET_RAY, "XLA_FLAGS": os.environ["XLA_FLAGS"]}
    fake = FakeGke(POOLS, shared_dirs=[str(shared)], comeback_s=6.0,
                   image_env={IMAGE: image, "example.com/tpulaunch:old": {**image, "PYTHONPATH": str(old)}}).start()
    home = tmp_path_factory.mktemp("gke-home")
    work = tmp_path_factory.mktemp("gke-work")
    env = cli_env(home, KUBECONFIG=fake.kubeconfig, TPULAUNCH_HOME=str(home / "state"))
    try:
        yield SimpleNamespace(fake=fake, env=env, home=home, work=work, shared=shared)
    finally:
        run_cli("cluster", "down", env=env, timeout=240)
        fake.stop()
        shutil.rmtree(shared, ignore_errors=True)
        assert not fake.errors(), fake.errors()[-3:]


def cli(gke, *args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_cli(*args, env=gke.env, timeout=timeout, cwd=cwd or gke.work)


def kubectl(gke, *args: str) -> subprocess.CompletedProcess:
    if not KUBECTL.exists():
        pytest.fail(f"Debian's kubectl is not at {KUBECTL}: ./scripts/setup unpacks it (apt-get download kubernetes-client)")
    return subprocess.run([str(KUBECTL), "--kubeconfig", gke.fake.kubeconfig, "--cache-dir", str(gke.home / "kcache"),
                           *args], capture_output=True, text=True, timeout=60)


def pod_processes() -> list[int]:
    """Live processes of any fake GKE pod of this test process."""
    mark = f"{OWNER_ENV}={os.getpid()}/".encode()
    return [pid for pid, p in live_processes().items() if mark in p["environ"]]


def test_cluster_up_brings_every_host_of_every_slice_into_ray_and_kubectl_sees_it(gke):
    up = cli(gke, *UP, "--json", timeout=600)
    assert up.returncode == 0, up.stderr
    doc = json.loads(up.stdout)
    assert doc["gke"]["name"] == NAME and doc["gke"]["owned"] is True and doc["spares"] == ["tpu-2"]
    assert [(s["name"], s["accelerator_type"], len(s["workers"])) for s in doc["slices"]] == [
        ("tpu-0", "v5p-16", 2), ("tpu-1", "v5p-16", 2), ("tpu-2", "v5p-16", 2)]
    assert "in Ray: tpu-0: 2/2  tpu-1: 2/2  tpu-2: 2/2" in up.stderr and "checking the image's tpulaunch" in up.stderr
    # two slices on v5p-a and v5p-c, there from the start; the third on v5p-b, which GKE's autoscaler made
    assert "v5p-a, v5p-c; the rest from GKE's cluster autoscaler" in up.stderr, up.stderr
    assert re.search(r"tpu-[012]: autoscaler: pod triggered scale-up: gke-fake-v5p-b-grp 0->2 \(max: 2\)", up.stderr), \
        up.stderr
    st = json.loads(cli(gke, "cluster", "status", "--json").stdout)
    assert [[h["alive"] for h in s["hosts"]] for s in st["slices"]] == [[True, True]] * 3
    assert st["gke"]["head_ready"] and {s["node_pool"] for s in st["slices"]} == {"v5p-a", "v5p-b", "v5p-c"}
    assert st["spares"] == ["tpu-2"] and [s["spare"] for s in st["slices"]] == [False, False, True]
    # Debian's kubectl (1.20) against the fake: the protocol, not a mock of tpulaunch's own calls
    nodes = kubectl(gke, "get", "nodes")
    assert nodes.returncode == 0, nodes.stderr
    assert sum(1 for line in nodes.stdout.splitlines()[1:] if "Ready" in line) == 1 + 2 + 2 + 2 + 4 + 1
    rcs = kubectl(gke, "get", "rayclusters", "-o", "json")
    assert rcs.returncode == 0, rcs.stderr
    rc = json.loads(rcs.stdout)["items"]
    assert [r["metadata"]["name"] for r in rc] == [NAME] and rc[0]["status"]["state"] == "ready"
    assert rc[0]["status"]["readyWorkerReplicas"] == 6
    pods = kubectl(gke, "get", "pods", "-l", f"ray.io/cluster={NAME}")
    assert pods.returncode == 0, pods.stderr
    assert len([ln for ln in pods.stdout.splitlines()[1:] if "Running" in ln]) == 7, pods.stdout


def _final_losses(text: str) -> dict[int, str]:
    """host -> its last `loss` value, from a run's output."""
    out = {}
    for m in re.finditer(r"host (\d+) step \d+ loss ([\d.]+)", text):
        out[int(m.group(1))] = m.group(2)
    return out


# JAX's transformer with its 2-D sharding, and torch_xla's data-parallel MLP over the whole mesh (its
# transformer's 2-D sharding runs on the shared cluster, test_run.py: twice the CPU of the MLP here).
# The emulated run is also the suite's emulated multislice run from nothing (`run --topology
# --num-slices 2`: two slices gang-scheduled on a cluster made for the run; one runtime of 4 processes,
# the data axis over DCN).
@pytest.mark.parametrize("recipe,framework", [("jax_transformer.py", "jax"), ("mlp_dp.py", "torch_xla")])
def test_the_recipes_train_on_gke_as_on_an_emulated_cluster_of_that_shape(gke, recipe, framework):
    args = ("--num-slices", "2", "--dcn", "data=2", "--framework", framework)
    on_gke = cli(gke, "run", recipe, "--address", "auto", "--cpu-devices", *args, "--", "--steps", "3",
                 cwd=REPO / "recipes", timeout=600)
    assert on_gke.returncode == 0, on_gke.stdout[-3000:] + on_gke.stderr[-2000:]
    logs = gke.home / f"emulated-{framework}-runs"
    emulated = run_cli("run", recipe, "--topology", "2x2x2", "--accelerator", "v5p", *args, "--log-dir", str(logs),
                       "--json", "--", "--steps", "3", env=cli_env(gke.home / "emulated"), cwd=REPO / "recipes",
                       timeout=600)
    assert emulated.returncode == 0, emulated.stdout[-3000:] + emulated.stderr[-2000:]
    summary = json.loads(emulated.stdout)
    assert [(h["slice_index"], h["worker_id"]) for h in summary["hosts"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s["name"] for s in summary["slices"]] == ["emulated-0", "emulated-1"]
    assert summary["mesh"]["dcn_shape"][0] == 2
    host_logs = [Path(h["log"]).read_text() for h in summary["hosts"]]
    got, want = _final_losses(on_gke.stdout + on_gke.stderr), _final_losses("".join(host_logs))
    assert sorted(got) == [0, 1, 2, 3] and got == want, (got, want)
    for h, log in zip(summary["hosts"], host_logs):  # each host's loss fell (steps 0 and 2)
        losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", log)]
        assert len(losses) == 2 and losses[-1] < losses[0], (h["process_index"], losses)
    assert "CPU devices stand in for the chips" in on_gke.stdout + on_gke.stderr


def test_a_detached_run_is_followed_with_logs_and_stopped(gke):
    write_scripts(gke.work, {"forever.py": """\
        import time
        for i in range(100000):
            print("tick", i, flush=True)
            time.sleep(0.5)
        """})
    sub = cli(gke, "run", "forever.py", "--address", "auto", "--framework", "none", "--detach")
    assert sub.returncode == 0, sub.stderr
    run_id = sub.stdout.strip()
    follow = subprocess.Popen([sys.executable, "-m", "tpulaunch", "logs", run_id, "--follow"], env=gke.env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=gke.work)
    try:
        seen = []
        end = time.monotonic() + 120
        for line in follow.stdout:
            seen.append(line)
            if "tick 3" in line or time.monotonic() > end:
                break
        assert any("tick 3" in s for s in seen), "".join(seen[-20:])
        stop = cli(gke, "stop", run_id)
        assert stop.returncode == 0, stop.stderr
        rest, _ = follow.communicate(timeout=120)  # the follow ends with the run (`wait` gives its code)
        assert follow.returncode == 0 and "received SIGTERM: stopping every host" in rest, rest[-2000:]
    finally:
        if follow.poll() is None:
            follow.kill()
    waited = cli(gke, "wait", run_id)
    assert waited.returncode == ExitCode.TERMINATED, waited.stderr
    assert status_doc(gke.env, run_id)["state"] == "stopped"


def test_a_preempted_node_takes_its_slice_the_spare_steps_in_and_the_lost_one_is_the_spare_after(gke):
    write_scripts(gke.work, {"ckpt.py": CKPT_SCRIPT})
    ckpt = gke.shared / "ckpt"
    sub = cli(gke, "run", "ckpt.py", "--address", "auto", "--framework", "none", "--num-slices", "2", "--detach",
              "--recreate", "--max-preemptions", "1", "--preemption-wait", "300", "--env", f"CKPT_DIR={ckpt}")
    assert sub.returncode == 0, sub.stderr
    run_id = sub.stdout.strip()
    end = time.monotonic() + 180
    while not (ckpt / "host-3.json").exists() or json.loads((ckpt / "host-3.json").read_text())["step"] < 4:
        assert time.monotonic() < end, "the run did not reach step 4"
        time.sleep(0.5)
    victim = next(p for p in gke.fake.pods(f"ray.io/cluster={NAME},ray.io/worker-group-replica-index=1")
                  if p["metadata"]["labels"].get("ray.io/replica-host-index") == "0")
    gke.fake.preempt(victim["spec"]["nodeName"])  # a spot preemption: the whole v5p pool of slice tpu-1 goes
    waited = cli(gke, "wait", run_id, timeout=400)
    assert waited.returncode == 0, waited.stderr
    st = status_doc(gke.env, run_id)
    a0 = st["attempts"][0]
    assert a0["outcome"] == "preempted" and a0["exit_code"] == ExitCode.HOST_LOST, a0
    # the spare replica takes its place at once (no wait for GKE to make the pool again)
    assert [(r["slice"], r["how"]) for r in a0["replaced"]] == [("tpu-1", "spare tpu-2")], a0
    assert st["attempts"][1]["slices"] == ["tpu-0", "tpu-2"], st["attempts"][1]
    assert st["attempts"][1]["outcome"] == "ok" and st["exit_code"] == 0
    logs = cli(gke, "logs", run_id).stdout
    resumed = [int(m) for m in re.findall(r"attempt 1 host \d starts at step (\d+)", logs)]
    assert len(resumed) == 4 and min(resumed) >= 4, logs[-3000:]  # from the checkpoint, not from 0
    good = json.loads(cli(gke, "goodput", run_id, "--json").stdout)
    assert good["buckets"].get("recovery", 0) > 0, good
    end = time.monotonic() + 180
    while True:  # KubeRay makes tpu-1's replica again once GKE has its pool back: it is the spare now
        got = cli(gke, "cluster", "status", "--json")
        cs = json.loads(got.stdout) if got.returncode == 0 else {"spares": None, "slices": [], "error": got.stderr}
        if cs["spares"] == ["tpu-1"] and cs["slices"] and all(h["alive"] for sl in cs["slices"] for h in sl["hosts"]):
            break
        assert time.monotonic() < end, cs
        time.sleep(1)


def test_an_image_of_another_tpulaunch_is_refused_and_nothing_of_it_is_left(gke):
    up = cli(gke, "cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--image",
             "example.com/tpulaunch:old", "--name", "old-image", timeout=600)
    # the recorded cluster (tpl-e2e) is up: a second is refused first ...
    assert up.returncode == ExitCode.CLUSTER and "is recorded as up" in up.stderr, up.stderr
    other = cli_env(gke.home / "other", KUBECONFIG=gke.fake.kubeconfig)
    up = run_cli("cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--spot", "--image",
                 "example.com/tpulaunch:old", "--name", "old-image", env=other, timeout=600)
    # ... and from another home: its head runs, says its tpulaunch is another, and what was made goes
    assert up.returncode == ExitCode.CLUSTER, up.stderr
    last = up.stderr.strip().splitlines()[-1]
    assert "carries tpulaunch 0.0.1" in last and "build the image with tpulaunch 0.1.0" in last, up.stderr
    assert "Traceback" not in up.stderr
    assert gke.fake.store.get("rayclusters", "default", "old-image") is None
    end = time.monotonic() + 60
    while gke.fake.pods("ray.io/cluster=old-image"):
        assert time.monotonic() < end, "the refused cluster's pods stay"
        time.sleep(0.5)
    assert not (gke.home / "other" / ".cache" / "tpulaunch" / "cluster.json").exists()


def test_a_joined_cluster_is_used_and_left_standing(gke):
    other = cli_env(gke.home / "joiner", KUBECONFIG=gke.fake.kubeconfig)
    join = run_cli("cluster", "up", "--gke", "--join", NAME, "--json", env=other, timeout=120)
    assert join.returncode == 0, join.stderr
    doc = json.loads(join.stdout)
    assert doc["gke"]["owned"] is False and [s["name"] for s in doc["slices"]] == ["tpu-0", "tpu-1", "tpu-2"]
    assert doc["spares"] == ["tpu-1"]  # the annotation's (tpu-1 the spare since the preemption above)
    st = run_cli("cluster", "status", "--json", env=other, timeout=120)  # with the token its Secret holds
    assert st.returncode == 0, st.stderr
    assert all(h["alive"] for s in json.loads(st.stdout)["slices"] for h in s["hosts"])
    down = run_cli("cluster", "down", env=other, timeout=120)
    assert down.returncode == 0 and "is left standing" in down.stdout, down.stdout + down.stderr
    assert gke.fake.store.get("rayclusters", "default", NAME) is not None


def test_cluster_down_deletes_what_it_made_and_leaves_no_process(gke):
    down = cli(gke, "cluster", "down", "--json", timeout=300)
    assert down.returncode == 0, down.stderr
    assert "RayCluster/tpl-e2e" in json.loads(down.stdout)["deleted"]
    store = gke.fake.store
    for plural in ("rayclusters", "pods", "services", "secrets", "serviceaccounts", "roles", "rolebindings"):
        assert store.list(plural, "default")[0] == [], plural
    assert not [r for r in store.list("clusterroles", None)[0] if "tpulaunch" in r["metadata"]["name"]]
    end = time.monotonic() + 60
    while pod_processes():
        assert time.monotonic() < end, f"pod processes left: {pod_processes()}"
        time.sleep(0.5)
    assert not list((gke.home / "state").glob("ray_token-*")), "the cluster's token file is removed"


def test_run_gke_brings_a_cluster_up_for_the_run_and_deletes_it_after(gke):
    write_scripts(gke.work, {"where.py": """\
        import os
        print("on", os.uname().nodename, "slice", os.environ["TPU_NAME"], "worker", os.environ["TPU_WORKER_ID"], flush=True)
        """})
    run = cli(gke, "run", "where.py", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--spot", "--image", IMAGE,
              "--framework", "none", timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = run.stdout + run.stderr
    assert "slice tpu-0 worker 0" in out and "slice tpu-0 worker 1" in out
    made = re.search(r"RayCluster (tpl-run-[0-9a-f]{6})", out).group(1)
    assert f"deleted RayCluster {made}" in out
    assert gke.fake.store.get("rayclusters", "default", made) is None
    assert not (gke.home / "state" / "cluster.json").exists()

"""Real-slice bring-up (`cluster up --tpu`, `status`, `down`, `join`, `doctor`) against the fakes.

The fake Cloud TPU API serves a v4-16 (2x2x2, 2 workers); the fake `gcloud` runs each worker's
command on this machine with that worker's TPU env (see tests/fakes/bin/gcloud for how workers
share one machine). Ray itself is real: a raylet per worker, token auth on. The head runs on
worker 0, or (`--head local`) here, off the slice.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fakes import FAKE_BIN, closed_port, cli_env, hermetic_path, run_cli
from fakes.metadata_server import FakeMetadataServer
from fakes.tpu_api_server import FakeTpuApi, end_vms, make_node, standard_nodes

from tpulaunch import gcloud, procfs
from tpulaunch.errors import ExitCode
from tpulaunch.cluster import worker_commands
from tpulaunch.host import tpu_holders
from tpulaunch.plan import topology

ZONE = "us-central2-b"
# The slice these tests bring Ray up on: 2 TPU VMs (a v4-32 would only take longer to start).
SLICE = make_node(ZONE, "my-v4-16", accelerator_type="v4-16", accelerator_config={"type": "V4", "topology": "2x2x2"},
                  ips=["10.130.5.2", "10.130.5.3"], spot=True)
WORKERS = 2


def slices_json(nodes: list[dict]) -> dict:
    """What the fake gcloud needs, from the same fixture the fake API serves."""
    out = {}
    for n in nodes:
        _, project, _, zone, _, name = n["name"].split("/")
        acc = n.get("acceleratorType") or ""
        topo = (n.get("acceleratorConfig") or {}).get("topology") or ""
        if not acc or not topo or not n.get("networkEndpoints"):
            continue
        out[f"{project}/{zone}/{name}"] = {
            "accelerator_type": acc, "topology": topo,
            "chips_per_host": topology.resolve(topology=topo, accelerator=acc).chips_per_host,
            "worker_ips": [e["ipAddress"] for e in n["networkEndpoints"]],
        }
    return out


def recorded(log: Path) -> list[list[str]]:
    return [json.loads(line)["argv"] for line in log.read_text().splitlines()] if log.exists() else []


def ssh_commands(log: Path) -> list[tuple[int, str]]:
    """(worker, command) of every recorded `tpu-vm ssh`."""
    out = []
    for argv in recorded(log):
        if argv[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
            w = next(a for a in argv if a.startswith("--worker="))
            out.append((int(w.split("=")[1]), argv[argv.index("--command") + 1]))
    return out


def procs_of(temp_dir: str) -> list[int]:
    """Live processes naming the cluster's temp dir in argv or holding a file open in it (or in a
    worker's copy of it: the fake gcloud gives each worker its own /tmp, `/tmp/tplt-x-vm<h>-<N>`)."""
    return [p.pid for p in procfs.processes(skip_self=False) if procfs.alive(p.pid)
            and (temp_dir.encode() in p.cmdline() or any(temp_dir in f for f in p.open_files()))]


def _cmdline(pid: int) -> str:
    """A process left behind, in one line for a failure message."""
    p = procfs.Process(pid)
    if not procfs.alive(pid):
        return "(gone)"
    env = [e for e in p.environ().split(b"\0") if b"TPULAUNCH" in e or b"TPU_W" in e]
    return (p.cmdline().replace(b"\0", b" ").decode(errors="replace")[:60].strip()
            + f" ppid={p.ppid()} env={env} files={[f for f in p.open_files() if f.startswith('/')][:6]}")


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """Fake API + fake gcloud env, a fresh TPULAUNCH_HOME/HOME; the Ray cluster is stopped at the end."""
    base = tmp_path_factory.mktemp("remote")
    nodes = standard_nodes() + [SLICE]
    sl = base / "slices.json"
    sl.write_text(json.dumps(slices_json(nodes)))
    temp_dir = f"/tmp/tplt-{uuid.uuid4().hex[:8]}"
    port = closed_port()
    with FakeTpuApi(nodes) as api:
        env = cli_env(base / "home", gcloud=True, TPULAUNCH_HOME=str(base / "tplhome"),
                      TPULAUNCH_TPU_API_ENDPOINT=api.url, FAKE_GCLOUD_LOG=str(base / "gcloud.log"),
                      FAKE_GCLOUD_SLICES=str(sl))
        ctx = {"env": env, "log": base / "gcloud.log", "temp_dir": temp_dir, "port": port, "base": base}
        try:
            yield ctx
        finally:
            left = end_leftovers([temp_dir])
            assert not left, f"cluster processes left behind: {left}"


def end_leftovers(dirs: list[str]) -> list[tuple[int, str]]:
    """After a module's cluster: what still runs in (or names) one of `dirs`, then ended, and the
    dirs (and each fake worker's copy of them) removed. A test asserts the list is empty."""
    left = [(pid, _cmdline(pid)) for d in dirs for pid in procs_of(d)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [p for d in dirs for p in procs_of(d)]:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        time.sleep(1)
    subprocess.run(["rm", "-rf", *dirs, *[c for d in dirs for c in glob.glob(d + "-vm*")]], check=False)
    return left


def up_args(ctx, *more: str) -> list[str]:
    return ["cluster", "up", "--tpu", "my-v4-16", "--zone", ZONE, "--project", "p",
            "--port", str(ctx["port"]), "--ray-temp-dir", ctx["temp_dir"], "--json", *more]


def test_up_status_idempotent_down(remote):
    env, log, tdir = remote["env"], remote["log"], remote["temp_dir"]
    t0 = time.monotonic()
    p = run_cli(*up_args(remote), env=env, timeout=240)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["address"] == f"10.130.5.2:{remote['port']}" and doc["emulated"] is False
    assert doc["remote"]["tpu"] == "my-v4-16" and doc["remote"]["head"] == "worker-0"
    # Piped: one plain progress line per host state change.
    for w in range(WORKERS):
        assert f"worker {w}: " in p.stderr
    assert "worker 0: head up" in p.stderr and "worker 1: joined" in p.stderr

    cmds = ssh_commands(log)
    starts = [(w, c) for w, c in cmds if "tpulaunch-ray-start" in c]
    assert sorted(w for w, _ in starts) == list(range(WORKERS))
    token = Path(doc["token_path"]).read_text().strip()
    assert len(token) == 64
    assert stat.S_IMODE(os.stat(doc["token_path"]).st_mode) == 0o600
    cid = json.loads((Path(env["TPULAUNCH_HOME"]) / "cluster.json").read_text())["cluster_id"]
    for w, c in starts:
        assert "RAY_AUTH_MODE=token" in c and "RAY_AUTH_TOKEN_PATH=" in c
        assert f"TPULAUNCH_CLUSTER_ID={cid}" in c and "tpulaunch-cluster" in c  # its processes and temp dir are marked
        assert "cat > " in c and "umask 077" in c
        assert token not in c  # the secret went over stdin, never argv
        assert f"--node-ip-address 10.130.5.{w + 2}" in c  # the worker's internal IP from the API
        assert "--dashboard-agent-listen-port 0" in c
        if w == 0:
            assert "--head" in c and f"--port {remote['port']}" in c and "--dashboard-host 127.0.0.1" in c
        else:
            assert f"--address 10.130.5.2:{remote['port']}" in c
    assert all(token not in " ".join(a) for a in recorded(log))
    remote_tok = Path(env["HOME"]) / ".tpulaunch" / "ray_token"
    assert remote_tok.read_text().strip() == token
    assert stat.S_IMODE(remote_tok.stat().st_mode) == 0o600

    # status --json: the alive hosts of one slice, asked of the head through worker 0.
    s = run_cli("cluster", "status", "--json", env=env, timeout=120)
    assert s.returncode == 0, s.stderr
    st = json.loads(s.stdout)
    assert [sl["name"] for sl in st["slices"]] == ["my-v4-16"]
    hosts = st["slices"][0]["hosts"]
    assert [(h["worker_id"], h["alive"]) for h in hosts] == [(w, True) for w in range(WORKERS)]
    assert st["slices"][0]["pod_type"] == "v4-16" and st["slices"][0]["topology"] == "2x2x2"
    # the agents' ports `ray start` leaves to them (0): each VM's raylet was given them ahead
    # (worker_start), below the ephemeral range, and the dashboard agent serves on those (its log
    # says so once it does)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    vm_dirs = glob.glob(tdir + "-vm*")
    assert len(vm_dirs) == WORKERS
    for vm_dir in vm_dirs:
        written = {}
        for name in ("dashboard_agent_listen_port", "metrics_agent_port", "metrics_export_port", "runtime_env_agent_port"):
            (written[name],) = [int(Path(f).read_text()) for f in glob.glob(f"{vm_dir}/session_latest/{name}_*")]
        assert all(10000 <= p < low for p in written.values()) and len(set(written.values())) == 4, written
        agent_log = Path(vm_dir, "session_latest", "logs", "dashboard_agent.log")
        end = time.monotonic() + 180  # a wait for a state, not a speed: slow CI machines
        while "Dashboard agent http address" not in agent_log.read_text() and time.monotonic() < end:
            time.sleep(0.5)
        said = agent_log.read_text()
        assert re.search(rf"Dashboard agent http address: \S+:{written['dashboard_agent_listen_port']}\n", said), written
        assert re.search(rf"Dashboard agent grpc address: \S+:{written['metrics_agent_port']}\n", said), written
        # ... and waits 100 s for its runtime-env agent, not Ray's 30 s (worker_start.patient_agents)
        (raylet,) = [p for p in procs_of(vm_dir)
                     if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/raylet")]
        assert b"RAY_agent_register_timeout_ms=100000" in Path(f"/proc/{raylet}/environ").read_bytes().split(b"\0")
    # a run with a preemption budget is told, in one line, that the head shares the slice's fate (and
    # from here, outside the slice's network, that the head at worker 0's internal IP is out of reach)
    (remote["base"] / "t.py").write_text("print('x')\n")
    warn = run_cli("run", "t.py", "--address", "auto", "--max-preemptions", "1", "--dry-run",
                   env={**env, "TPULAUNCH_CONNECT_TIMEOUT": "2"}, cwd=remote["base"], timeout=120)
    assert "the Ray head runs on worker 0 of TPU 'my-v4-16': a preemption of that worker ends the run" in warn.stderr
    assert warn.returncode == 5 and "Ray at 10.130.5.2" in warn.stderr, warn.stderr

    # Without the token, Ray refuses the connection (with it, status above got in).
    no_tok = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    probe = subprocess.Popen(
        [sys.executable, "-c", "import ray; ray.init(address='127.0.0.2:%d', logging_level='ERROR'); print('CONNECTED')"
         % remote["port"]], env=no_tok, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = []  # Ray retries a refused token for a long while: its first refusal is the answer
    assert probe.stdout is not None
    for line in probe.stdout:
        said.append(line)
        if "InvalidAuthToken" in line or "CONNECTED" in line:
            break
    probe.kill()
    probe.wait(timeout=30)
    assert any("InvalidAuthToken" in line for line in said) and not any("CONNECTED" in line for line in said), said

    # A second `up` leaves every host alone: no new `ray start`.
    n_before = len(ssh_commands(log))
    p2 = run_cli(*up_args(remote), env=env, timeout=120)
    assert p2.returncode == 0, p2.stderr
    new = ssh_commands(log)[n_before:]
    assert new and not any("tpulaunch-ray-start" in c for _, c in new)
    assert [w for w, _ in new] == [0]  # just the question to the head
    assert p2.stderr.count("already in the cluster") == WORKERS

    assert procs_of(tdir)
    d = run_cli("cluster", "down", "--json", env=env, timeout=120)
    assert d.returncode == 0, d.stderr
    dd = json.loads(d.stdout)
    assert dd["processes_stopped"] > 0 and sorted(dd["hosts"]) == [str(w) for w in range(WORKERS)]
    stops = [w for w, c in ssh_commands(log) if "tpulaunch-stop" in c]
    assert sorted(stops) == list(range(WORKERS))
    assert procs_of(tdir) == []
    assert glob.glob(tdir + "*") == []  # each worker's temp dir, marked as ours, is gone
    assert not Path(doc["token_path"]).exists()
    assert run_cli("cluster", "status", "--json", env=env, timeout=60).returncode != 0  # nothing recorded now
    print(f"lifecycle took {time.monotonic() - t0:.1f}s")


# -- quoting ------------------------------------------------------------------------------------

HOSTILE = ["a b", "it's", '"dq"', "; touch PWNED1", "$(touch PWNED2)", "`touch PWNED3`", "x\ny", "*", "--worker=3"]


def test_a_setup_that_exits_255_fails_the_bring_up(remote):
    """gcloud runs an ssh that exits 255 again, up to 10 times, on the stdin the first run has read
    (the fake gcloud too; FAKE_GCLOUD_SSH_RETRY_S shortens its 5 s pauses): a set-up script's 255
    would come back as an empty script's 0, and the worker would join unset-up."""
    env = {**remote["env"], "FAKE_GCLOUD_SSH_RETRY_S": "0.1"}
    p = run_cli(*up_args(remote, "--setup", "echo set-up ran; exit 255"), env=env, timeout=120)
    assert p.returncode == ExitCode.CLUSTER, p.stdout + p.stderr
    assert "the setup failed on worker 0 (exit 254)" in p.stderr and "reported as 254" in p.stderr, p.stderr
    assert procs_of(remote["temp_dir"]) == []  # no Ray was started
    assert not (Path(remote["env"]["TPULAUNCH_HOME"]) / "cluster.json").exists()


def test_ssh_quoting_with_hostile_strings(tmp_path, monkeypatch):
    name, zone, project = "evil tpu'; touch PWNED0 #", "us central'\"", "p; rm -rf x"
    home = tmp_path / "home"
    home.mkdir()
    sl = tmp_path / "slices.json"
    sl.write_text(json.dumps({f"{project}/{zone}/{name}": {
        "accelerator_type": "v4-8", "topology": "2x2x1", "chips_per_host": 4, "worker_ips": ["10.0.0.2"]}}))
    log = tmp_path / "gcloud.log"
    monkeypatch.setenv("PATH", hermetic_path(gcloud=True))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("FAKE_GCLOUD_LOG", str(log))
    monkeypatch.setenv("FAKE_GCLOUD_SLICES", str(sl))

    command = gcloud.shell_words(["printf", "%s|", *HOSTILE]) + " && " + gcloud.env_assignments(
        {"V": "$(touch PWNED4); 'q'"}) + ' /bin/sh -c \'printf "%s" "$V"\''
    proc = gcloud.tpu_vm_ssh(name, zone=zone, project=project, worker=0, command=command, stdin="")
    end_vms(sl)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "|".join(HOSTILE) + "|" + "$(touch PWNED4); 'q'"
    (argv,) = recorded(log)
    assert argv == ["compute", "tpus", "tpu-vm", "ssh", name, "--zone", zone, "--project", project,
                    "--worker=0", "--command", command]
    assert not list(home.glob("PWNED*")) and not list(tmp_path.glob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))

    # The product's remote `ray start` line splits back into exactly its words.
    import shlex

    words = worker_commands.ray_start_words(python="/opt/my py/bin/python3", node_ip="10.0.0.2", temp_dir="/tmp/a b;c",
                                       port=6379, head=False, head_ip="10.0.0.1")
    line = worker_commands.start_command(words, "/tmp/a b;c", "abc123")
    # after the token and the marker: the 3 auth words, the cluster id, then exactly the words
    assert shlex.split(line.rsplit(" && ", 1)[1])[3:] == ["TPULAUNCH_CLUSTER_ID=abc123", *words]
    with pytest.raises(ValueError):
        gcloud.env_assignments({"A;B": "x"})
    with pytest.raises(Exception, match="not a TPU name"):
        gcloud.tpu_vm_ssh_argv("--zone=evil", zone="z", project="p", worker=0, command="true")


@pytest.fixture
def fake_vm(tmp_path):
    """`run(command, worker=0)` over the fake gcloud on the two workers of slice p/z/t; their VMs
    (each an init and what runs under it) are ended afterwards, as the fake API ends a deleted node's."""
    sl = tmp_path / "slices.json"
    sl.write_text(json.dumps({"p/z/t": {"accelerator_type": "v4-16", "topology": "2x2x2", "chips_per_host": 4,
                                        "worker_ips": ["10.0.0.2", "10.0.0.3"]}}))
    env = {**os.environ, "PATH": hermetic_path(gcloud=True), "FAKE_GCLOUD_SLICES": str(sl), "HOME": str(tmp_path)}

    def run(command: str, worker: int = 0) -> subprocess.CompletedProcess:
        return subprocess.run([str(FAKE_BIN / "gcloud"), "compute", "tpus", "tpu-vm", "ssh", "t", "--zone", "z",
                               "--project", "p", f"--worker={worker}", "--command", command],
                              env=env, capture_output=True, text=True, timeout=30)
    yield run
    assert end_vms(sl) >= 1, "the workers' commands ran under an init of their own"


def test_fake_gcloud_refuses_non_loopback_addresses(fake_vm):
    ok = fake_vm("echo 10.0.0.2 $TPU_WORKER_ID $TPU_NAME")
    assert ok.returncode == 0 and ok.stdout.strip() == "127.0.0.2 0 t"
    bad = fake_vm("echo 10.0.0.9")
    assert bad.returncode == 255 and "refusing" in bad.stderr


def test_fake_gcloud_shows_each_worker_only_its_own_processes(fake_vm):
    """As on separate VMs: what one worker leaves running is seen (and can be stopped) by a later
    command on that worker, never by the other worker, and this machine's processes are not
    theirs (a stop by environment on a worker must never reach the head running here)."""
    started = fake_vm("sleep 300 >/dev/null 2>&1 & echo $!")
    assert started.returncode == 0, started.stderr
    pid = started.stdout.strip()
    mine = fake_vm("ps -e -o pid=,args=")
    assert f"{pid} sleep 300" in [" ".join(line.split()) for line in mine.stdout.splitlines()], mine.stdout
    assert str(os.getpid()) not in mine.stdout.split(), "a worker sees this machine's processes"
    other = fake_vm("ps -e -o args=", worker=1)
    assert "sleep 300" not in other.stdout and "pytest" not in other.stdout, other.stdout
    assert fake_vm(f"kill {pid} && while kill -0 {pid} 2>/dev/null; do sleep 0.05; done").returncode == 0
    assert "sleep 300" not in fake_vm("ps -e -o args=").stdout


# -- cluster join (on a TPU VM) ------------------------------------------------------------------


def test_join_gives_up_when_head_never_answers(tmp_path):
    # Loopback worker IPs: the join may only ever knock on this machine.
    with FakeMetadataServer.for_slice(worker=1, ip_prefix="127.0.0") as md:
        env = cli_env(tmp_path / "home", TPULAUNCH_HOME=str(tmp_path / "tpl"), TPULAUNCH_METADATA_HOST=md.host)
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "tpulaunch", "cluster", "join", "--token-stdin", "--timeout", "3",
                            "--port", str(closed_port())], env=env, input="s3cret\n", capture_output=True, text=True,
                           timeout=60, cwd=str(Path(__file__).parents[1]))
    assert p.returncode == 5, p.stderr
    assert "did not answer within 3s" in p.stderr and "127.0.0.2" in p.stderr
    assert time.monotonic() - t0 < 30
    tok = tmp_path / "home" / ".tpulaunch" / "ray_token"
    assert tok.read_text() == "s3cret" and stat.S_IMODE(tok.stat().st_mode) == 0o600


# -- TPU holders ----------------------------------------------------------------------------------


@pytest.fixture
def fake_root(tmp_path):
    root = tmp_path / "root"
    (root / "dev" / "vfio").mkdir(parents=True)
    (root / "tmp").mkdir()
    for p in ("dev/accel0", "dev/accel1", "dev/vfio/3", "dev/vfio/vfio"):
        (root / p).write_text("")
    (root / "dev" / "accel").mkdir()  # NVIDIA 570+ makes a /dev/accel/ directory: not a TPU
    return root


def test_holders_finds_the_process_holding_the_tpu_and_clears_it(fake_root, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; fs=[open(p) for p in sys.argv[1:]]; print('ready', flush=True); time.sleep(120)",
         str(fake_root / "dev/accel0"), str(fake_root / "dev/vfio/3")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        (fake_root / "tmp" / "libtpu_lockfile").write_text("")
        rep = tpu_holders.scan(fake_root)
        assert rep.devices == [str(fake_root / p) for p in ("dev/accel0", "dev/accel1", "dev/vfio/3")]
        assert [(h.pid, h.paths) for h in rep.holders] == [
            (holder.pid, [str(fake_root / "dev/accel0"), str(fake_root / "dev/vfio/3")])]
        assert "time.sleep" in rep.holders[0].cmdline
        assert rep.lockfile and not rep.lockfile_stale and not rep.clean

        env = cli_env(tmp_path / "home", TPULAUNCH_HOME=str(tmp_path / "tpl"))
        p = run_cli("cluster", "doctor", "--root", str(fake_root), "--json", env=env)
        assert p.returncode == 5
        assert [h["pid"] for h in json.loads(p.stdout)["holders"]] == [holder.pid]

        p = run_cli("cluster", "doctor", "--root", str(fake_root), "--kill-stale", env=env)
        assert p.returncode == 0, p.stderr
        assert f"held by pid {holder.pid}" in p.stdout and f"killed: {holder.pid}" in p.stdout
        assert holder.wait(timeout=10) == -signal.SIGTERM
        assert not (fake_root / "tmp" / "libtpu_lockfile").exists()
        assert tpu_holders.scan(fake_root).clean
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_holders_stale_lockfile_alone(fake_root, tmp_path):
    assert tpu_holders.scan(fake_root).clean
    (fake_root / "tmp" / "libtpu_lockfile").write_text("")
    rep = tpu_holders.scan(fake_root)
    assert rep.holders == [] and rep.lockfile_stale and not rep.clean
    res = tpu_holders.clear(rep)
    assert res == {"killed": [], "failed": {}, "lockfile_removed": True}
    assert tpu_holders.scan(fake_root).clean

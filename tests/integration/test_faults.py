"""The fault table: every fault injected for real on emulated slices (real Ray, real processes).

Each row asserts what the user sees: the exit code, the host blamed and why, that every host's
log of every attempt is on disk, and that no host process (or Ray process of a cluster the run
started) is left behind. Faults that do not damage the cluster run on the shared warm slice;
killing Ray nodes needs a cluster of its own.

The scripts boot no framework (`--framework none`): what is under test is the supervision (blame,
budgets, stops, logs), which is the same whatever the script imports, and a host without torch
starts in a fraction of a second. The framework adapters' own failures are tested in test_run.py
and test_jax.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support import SHARED, SHARED_HOSTS, cli_env, live_processes, processes_mentioning, run_cli, write_scripts
from fakes.metadata_server import FakeMetadataServer
from tpulaunch.procfs import Process

HOSTS = SHARED_HOSTS

SCRIPTS = {
    "crash.py": """
        import atexit, sys, time, tpulaunch
        if tpulaunch.context().process_index == 1:
            print("host 1 giving up", flush=True)
            def on_exit():  # runs, as at a plain exit, but never ends: the failed host leaves anyway
                print("host 1 exit handler", flush=True)
                time.sleep(600)
            atexit.register(on_exit)
            sys.exit(3)
        print("sleeping", flush=True)
        time.sleep(600)
    """,
    "sleepy.py": """
        import os, time, tpulaunch
        print("ready", tpulaunch.context().process_index, "attempt", os.environ["TPULAUNCH_RESTART_COUNT"], flush=True)
        if os.environ["TPULAUNCH_RESTART_COUNT"] == "0":
            time.sleep(600)
        print("finished", flush=True)
    """,
    "slow_to_stop.py": """
        import os, signal, time, tpulaunch
        def on_term(signum, frame):  # a checkpoint that takes longer than the grace it is given
            print("saving on SIGTERM", flush=True)
            time.sleep(60)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", tpulaunch.context().process_index, "attempt", os.environ["TPULAUNCH_RESTART_COUNT"], flush=True)
        time.sleep(600)
    """,
    "hang.py": """
        import os, time, tpulaunch

        def wait_forever():
            while True:
                time.sleep(1)

        def barrier():  # the others wait for host 1, as in the next collective of a training step
            while not os.path.exists("never"):
                time.sleep(1)

        print("started", flush=True)
        if tpulaunch.context().process_index == 1:
            wait_forever()
        barrier()
    """,
    "flaky.py": """
        import os, sys, tpulaunch
        ctx = tpulaunch.context()
        print(f"attempt {os.environ['TPULAUNCH_RESTART_COUNT']} restart_count {ctx.restart_count}", flush=True)
        if ctx.process_index == 1 and (ctx.restart_count == 0 or os.environ.get("ALWAYS") == "1"):
            sys.exit(3)
    """,
    "preemptible.py": """
        import os, signal, sys, time, tpulaunch
        ctx = tpulaunch.context()
        def on_term(signum, frame):
            print(f"saving checkpoint on {signal.Signals(signum).name}", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", ctx.process_index, "restart", ctx.restart_count, flush=True)
        if ctx.restart_count == 0:
            time.sleep(600)
        print("resumed and done", flush=True)
    """,
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("faults"), SCRIPTS)


# -- helpers ------------------------------------------------------------------------------------


def _pids_with_env(*needles: str) -> list[int]:
    return [pid for pid, info in live_processes().items() if all(n.encode() in info["environ"] for n in needles)]


def _host_pid(run_id: str, index: int) -> int:
    """The host process of run `run_id` with process index `index` (a spare shows its run by the
    run-named file it holds open, a fresh process by its environment)."""
    (pid,) = [int(line.split(":")[0]) for line in processes_mentioning([f"TPULAUNCH_RUN_ID={run_id}", f"tpulaunch-run-{run_id}-"])
              if f"TPULAUNCH_PROCESS_INDEX={index}\0".encode() in Path(f"/proc/{line.split(':')[0]}/environ").read_bytes()]
    return pid


class Launch:
    """A `tpulaunch run` in the background whose output the test reads as it comes."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "tpulaunch", "run", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.err: list[str] = []
        self._t = threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True)
        self._t.start()
        self._e = threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)
        self._e.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:  # noqa: ANN001
        for line in stream:
            into.append(line)

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 240) -> None:
        """Until `count` lines of the output (host lines: stdout, or stderr with --json) match."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if sum(bool(re.search(pattern, line)) for line in list(self.lines) + list(self.err)) >= count:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"never saw {count} x {pattern!r}:\n" + "".join(self.lines)[-3000:] + "".join(self.err)[-3000:])

    def finish(self, timeout: float = 300) -> tuple[int, dict]:
        rc = self.proc.wait(timeout=timeout)
        self._t.join(10)
        self._e.join(10)
        return rc, json.loads("".join(self.lines)) if "--json" in self.proc.args else {}


def _summary(log_root: Path) -> dict:
    (run,) = [p for p in log_root.iterdir() if p.is_dir()]
    return json.loads((run / "summary.json").read_text())


def _run_id(log_root: Path, timeout: float = 120) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        runs = [p.name for p in log_root.iterdir()] if log_root.exists() else []
        if runs:
            return runs[0]
        time.sleep(0.2)
    raise AssertionError("the run never made its log directory")


def _assert_logs(summary: dict, attempts: int) -> None:
    """Every host's log of every attempt is on disk, where the summary says."""
    assert len(summary["attempts"]) == attempts, summary["attempts"]
    for a in summary["attempts"]:
        assert Path(a["log_dir"]).name == f"attempt-{a['index']}"
        for h in a["hosts"]:
            assert Path(h["log"]).is_file() and Path(h["log"]).parent == Path(a["log_dir"]), h
    assert (Path(summary["log_dir"]) / "summary.json").is_file()


def _assert_nothing_left(run_id: str, cluster_dirs: list[str] = ()) -> None:
    deadline = time.monotonic() + 60  # a wait for a state, not a speed: slow CI machines
    while time.monotonic() < deadline:
        left = processes_mentioning([f"TPULAUNCH_RUN_ID={run_id}", f"tpulaunch-run-{run_id}-", *cluster_dirs])
        if not left:
            return
        time.sleep(0.5)
    raise AssertionError(f"processes left behind: {left}")


def _shared(shared_cluster, workdir, tmp_path, script, *flags, env_extra=None):
    env = dict(shared_cluster["env"], **(env_extra or {}))
    return Launch([script, *SHARED, "--address", "auto", "--log-dir", str(tmp_path), "--json",
                   "--framework", "none", *flags], workdir, env)


# -- faults of one host's process (shared cluster) -----------------------------------------------


@pytest.mark.cluster
def test_host_script_crash_blames_that_host(shared_cluster, workdir, tmp_path):
    rc, s = _shared(shared_cluster, workdir, tmp_path, "crash.py", "--no-dist",
                    "--env", "TPULAUNCH_EXIT_HANDLERS_TIMEOUT=2").finish()
    assert rc == 3 and s["exit_code"] == 3
    f = s["first_failure"]
    assert (f["process_index"], f["reason"]) == (1, "exit 3")
    assert all(h["stopped_by_tpulaunch"] and h["exit_code"] == 143 for h in s["hosts"] if h["process_index"] != 1)
    _assert_logs(s, 1)
    log = Path(f["log"]).read_text()
    assert "host 1 giving up" in log and "host 1 exit handler" in log
    assert ("tpulaunch: host 1: the script's exit handlers and threads were still running 2 s after it failed"
            " (TPULAUNCH_EXIT_HANDLERS_TIMEOUT); leaving") in log
    _assert_nothing_left(s["run_id"])
    # the slice is free again for the next run
    status = json.loads(run_cli("cluster", "status", "--json", env=shared_cluster["env"]).stdout)
    assert not any(h["busy"] for h in status["slices"][0]["hosts"])


@pytest.mark.cluster
def test_host_process_sigkill(shared_cluster, workdir, tmp_path):
    launch = _shared(shared_cluster, workdir, tmp_path, "sleepy.py", "--no-dist")
    launch.wait_for(r"\] ready \d attempt 0", HOSTS)
    run_id = _run_id(tmp_path)
    pid = _host_pid(run_id, 1)
    os.kill(pid, signal.SIGKILL)
    rc, s = launch.finish()
    assert rc == 137
    assert (s["first_failure"]["process_index"], s["first_failure"]["reason"]) == (1, "killed by signal 9 (SIGKILL)")
    _assert_logs(s, 1)
    _assert_nothing_left(run_id)


@pytest.mark.cluster
@pytest.mark.replaces_agents
def test_host_agent_killed_is_a_lost_host(shared_cluster, workdir, tmp_path):
    launch = _shared(shared_cluster, workdir, tmp_path, "sleepy.py", "--no-dist")
    launch.wait_for(r"\] ready \d attempt 0", HOSTS)
    run_id = _run_id(tmp_path)
    pid = _host_pid(run_id, 1)
    agent = Process(pid).ppid()  # its parent: the HostAgent actor
    # the run's file the host holds open: an agent killed cannot remove it, so it must be where
    # `cluster down` removes everything (the cluster's temp dir), not loose in /tmp
    held = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir() if f"tpulaunch-run-{run_id}-" in os.readlink(f)]
    os.kill(agent, signal.SIGKILL)
    rc, s = launch.finish()
    assert rc == 75 and s["outcome"] == "lost"
    assert (s["first_failure"]["process_index"], s["first_failure"]["reason"]) == (1, "agent died")
    _assert_logs(s, 1)
    _assert_nothing_left(run_id)
    cluster_dir = os.path.dirname(shared_cluster["info"]["token_path"])
    assert held and all(h.startswith(cluster_dir + "/") for h in held), (held, cluster_dir)


@pytest.mark.cluster
def test_stall_dumps_every_hosts_stack_and_names_where_it_hangs(shared_cluster, workdir, tmp_path):
    launch = _shared(shared_cluster, workdir, tmp_path, "hang.py", "--stall-timeout", "8")
    launch.wait_for(r"\] started", HOSTS)
    stalled_at = time.monotonic()
    rc, s = launch.finish()
    assert rc == 124 and s["outcome"] == "stalled"
    assert time.monotonic() - stalled_at < 40, "exit 124 within seconds of the stall timeout"
    assert "no output or heartbeat from any host for 8 s" in s["note"]
    assert "host 0: in barrier (hang.py:10); host 1: in wait_forever (hang.py:6)" in s["note"]
    for h in s["hosts"]:
        stacks = Path(h["stacks"]).read_text()
        assert Path(h["stacks"]).parent == Path(s["attempts"][0]["log_dir"])
        assert ("wait_forever" in stacks) == (h["process_index"] == 1), stacks
    _assert_logs(s, 1)
    _assert_nothing_left(s["run_id"])


@pytest.mark.cluster
def test_wall_timeout(shared_cluster, workdir, tmp_path):
    rc, s = _shared(shared_cluster, workdir, tmp_path, "sleepy.py", "--no-dist", "--timeout", "6").finish()
    assert rc == 124 and s["outcome"] == "timeout"
    assert "the run reached its --timeout" in s["note"] and "sleepy.py" in s["note"]
    for h in s["hosts"]:
        stacks = Path(h["stacks"]).read_text()
        assert "Thread" in stacks, stacks  # py-spy read every host's process
        if "ready" in Path(h["log"]).read_text():  # a host still booting when the clock ran out is not in it yet
            assert "sleepy.py" in stacks, stacks
    assert any("ready" in Path(h["log"]).read_text() for h in s["hosts"])
    _assert_logs(s, 1)
    _assert_nothing_left(s["run_id"])


# -- restarts -------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_restart_succeeds(shared_cluster, workdir, tmp_path):
    rc, s = _shared(shared_cluster, workdir, tmp_path, "flaky.py", "--max-restarts", "1").finish()
    assert rc == 0 and s["exit_code"] == 0 and s["restarts"] == 1
    a0, a1 = s["attempts"]
    assert a0["outcome"] == "failed" and a0["first_failure"]["process_index"] == 1 and a0["first_failure"]["reason"] == "exit 3"
    assert a1["outcome"] == "ok"
    _assert_logs(s, 2)
    for a in (a0, a1):
        for h in a["hosts"]:
            text = Path(h["log"]).read_text()
            # attempt 0 ends as host 1 fails: a host stopped before its first line has none to show
            if a is a1 or h["process_index"] == 1 or "restart_count" in text:
                assert f"attempt {a['index']} restart_count {a['index']}" in text
    _assert_nothing_left(s["run_id"])


@pytest.mark.cluster
def test_restart_budget_exhausted(shared_cluster, workdir, tmp_path):
    launch = _shared(shared_cluster, workdir, tmp_path, "flaky.py", "--max-restarts", "1", "--env", "ALWAYS=1")
    rc, s = launch.finish()
    assert rc == 3 and s["restarts"] == 1 and s["note"] == "--max-restarts 1 spent"
    assert [a["outcome"] for a in s["attempts"]] == ["failed", "failed"]
    assert all(a["first_failure"]["process_index"] == 1 for a in s["attempts"])
    _assert_logs(s, 2)
    _assert_nothing_left(s["run_id"])


# -- preemption -----------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("how", ["metadata notice", "SIGTERM to the host"])
def test_preemption_gives_the_script_its_grace_and_relaunches(shared_cluster, workdir, tmp_path, how):
    with FakeMetadataServer.for_slice("v5p-16", "2x2x2", worker=0) as md:
        md.values["instance/maintenance-event"] = "NONE"
        launch = _shared(shared_cluster, workdir, tmp_path, "preemptible.py", "--no-dist", "--max-preemptions", "1",
                         "--preemption-grace", "15", "--env", f"TPULAUNCH_METADATA_HOST={md.host}")
        launch.wait_for(r"\] ready \d restart 0", HOSTS)
        run_id = _run_id(tmp_path)
        if how == "metadata notice":
            md.values["instance/preempted"] = "TRUE"
            launch.wait_for("saving checkpoint on SIGTERM", 1)
            md.values["instance/preempted"] = "FALSE"  # the VM is back
        else:
            pid = _host_pid(run_id, 1)
            agent = Process(pid).ppid()
            os.kill(agent, signal.SIGTERM)
        rc, s = launch.finish()
    assert rc == 0 and s["preemptions"] == 1 and s["restarts"] == 0, s["attempts"][0]["first_failure"]
    a0 = s["attempts"][0]
    assert a0["outcome"] == "preempted"
    reason = a0["first_failure"]["reason"]
    if how == "metadata notice":
        assert "preemption notice (instance/preempted=TRUE)" in reason
    else:
        assert a0["first_failure"]["process_index"] == 1 and "got SIGTERM" in reason
    blamed = Path(a0["first_failure"]["log"]).read_text()
    assert "saving checkpoint on SIGTERM" in blamed  # the script had its grace to save
    _assert_logs(s, 2)
    assert all("resumed and done" in Path(h["log"]).read_text() for h in s["attempts"][1]["hosts"])
    _assert_nothing_left(run_id)


# -- the launcher ----------------------------------------------------------------------------------


def test_dead_address_fails_fast(workdir):
    for extra in (["--dry-run"], []):
        t0 = time.monotonic()
        proc = run_cli("run", "sleepy.py", *SHARED, "--address", "127.0.0.1:1", *extra, cwd=workdir,
                       timeout=60)
        assert proc.returncode == 5 and time.monotonic() - t0 < 20
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert lines == ["error: cannot reach Ray at 127.0.0.1:1: connection refused. check --address, and that the"
                         " cluster is up (`tpulaunch cluster status`)"], proc.stderr


@pytest.mark.cluster
def test_launcher_sigterm_during_the_run(shared_cluster, workdir, tmp_path):
    """The hosts get SIGTERM and their grace (this script outlasts it: SIGKILL), the launcher keeps
    every log, writes the summary and exits 143. Ray, once connected, would abort the launcher
    (SIGABRT) 3 s after its SIGTERM, before the grace was over (cluster/connect.py take_back_sigterm)."""
    launch = _shared(shared_cluster, workdir, tmp_path, "slow_to_stop.py", "--no-dist")
    launch.wait_for(r"\] ready \d attempt 0", HOSTS)
    run_id = _run_id(tmp_path)
    t0 = time.monotonic()
    launch.proc.send_signal(signal.SIGTERM)
    rc, s = launch.finish()
    assert rc == 143 and time.monotonic() - t0 < 20, "".join(launch.err)[-3000:]
    assert s["interrupted"] == "SIGTERM" and s["outcome"] == "interrupted"
    assert all(h["stopped_by_tpulaunch"] for h in s["hosts"])
    assert all("saving on SIGTERM" in Path(h["log"]).read_text() for h in s["hosts"])
    _assert_logs(s, 1)
    _assert_nothing_left(run_id)


@pytest.mark.lifecycle
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_launcher_signal_while_the_cluster_starts(workdir, tmp_path, sig, code):
    env = cli_env(TPULAUNCH_HOME=str(tmp_path / "home"))
    launch = Launch(["sleepy.py", "--accelerator", "v4-16", "--framework", "none", "--log-dir", str(tmp_path / "runs")],
                    workdir, env)
    end = time.monotonic() + 240  # the bound wait_for has: CI's machines can be this slow
    while not _cluster_dirs(env["TPULAUNCH_HOME"]) and launch.proc.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
    ours = _cluster_dirs(env["TPULAUNCH_HOME"])
    assert ours, f"the cluster never started (launcher exit code {launch.proc.poll()}):\n" + "".join(launch.err)[-3000:]
    time.sleep(1.0)  # while the first hosts start
    t0 = time.monotonic()
    launch.proc.send_signal(sig)
    rc, _ = launch.finish(timeout=60)
    assert rc == code and time.monotonic() - t0 < 15, "".join(launch.err)
    assert ("interrupted" in "".join(launch.err))
    _assert_nothing_left("no-run-id-here", ours)


# -- lost Ray nodes (a cluster of the run's own) ---------------------------------------------------


def _raylet_of(cluster_dir: str, worker: int) -> list[int]:
    """The raylet (and the head's GCS, for worker 0) of one emulated host, by the env it got."""
    out = []
    for pid in _pids_with_env(f"TPU_WORKER_ID={worker}\0"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cluster_dir.encode() in argv and (b"/raylet" in argv or b"gcs_server" in argv):
            out.append(pid)
    return out


def _own_cluster_launch(workdir, tmp_path, *flags):
    """A run on a cluster of its own: a 2-host v4-16 (what is lost is a node, not a slice size)."""
    env = cli_env(TPULAUNCH_HOME=str(tmp_path / "home"))
    launch = Launch(["sleepy.py", "--accelerator", "v4-16", "--framework", "none", "--log-dir", str(tmp_path / "runs"),
                     "--json", *flags], workdir, env)
    launch.wait_for(r"\] ready \d attempt 0", 2)
    (cluster_dir,) = _cluster_dirs(env["TPULAUNCH_HOME"])
    return launch, cluster_dir


def _cluster_dirs(home: str) -> list[str]:
    """The temp dirs (/tmp/tpl-*) of the clusters runs under this TPULAUNCH_HOME started: their Ray
    processes inherit it (other tests may start clusters of their own at the same time)."""
    found: set[bytes] = set()
    for info in live_processes().values():
        if f"TPULAUNCH_HOME={home}\0".encode() in info["environ"]:
            found |= set(re.findall(rb"/tmp/tpl-[A-Za-z0-9_]+", info["cmdline"] + info["fds"]))
    return sorted(d.decode() for d in found)


@pytest.mark.cluster
@pytest.mark.replaces_agents
def test_node_lost_is_blamed_and_the_slice_relaunched_on_a_restarted_node(shared_cluster, workdir, tmp_path):
    """The raylet of host 1 of the shared cluster dies; tpulaunch starts that host again (the cluster
    heals for the tests after this one) and relaunches the slice."""
    cluster_dir = os.path.dirname(shared_cluster["info"]["token_path"])
    launch = _shared(shared_cluster, workdir, tmp_path, "sleepy.py", "--no-dist", "--max-preemptions", "1",
                     "--preemption-wait", "120")
    launch.wait_for(r"\] ready \d attempt 0", HOSTS)
    run_id = _run_id(tmp_path)
    pids = _raylet_of(cluster_dir, 1)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    rc, s = launch.finish()
    assert rc == 0 and s["preemptions"] == 1, json.dumps(s["attempts"][0]["first_failure"])
    a0, a1 = s["attempts"]
    assert a0["outcome"] == "lost" and a0["exit_code"] == 75
    assert (a0["first_failure"]["process_index"], a0["first_failure"]["reason"]) == (1, "node lost")
    assert a1["outcome"] == "ok"
    _assert_logs(s, 2)
    err = "".join(launch.err)
    assert "starting the lost emulated host(s) again: emulated worker 1" in err, err
    assert "raylet" not in err and "A worker died" not in err, "Ray's own output stays in ray.log"
    _assert_nothing_left(run_id)
    status = json.loads(run_cli("cluster", "status", "--json", env=shared_cluster["env"]).stdout)
    assert all(h["alive"] and not h["busy"] for h in status["slices"][0]["hosts"]), status


_SERVICES = {"Ray Client server": b"ray.util.client.server", "autoscaler monitor": b"autoscaler/_private/monitor.py",
             "log monitor": b"log_monitor.py"}


def _services_of(cluster_dir: str) -> set[str]:
    """Which of Ray's optional head/node services run in the cluster living in `cluster_dir`."""
    found = set()
    for info in live_processes().values():
        blob = info["cmdline"] + info["environ"] + info["fds"]
        if cluster_dir.encode() in blob:
            found |= {name for name, needle in _SERVICES.items() if needle in info["cmdline"]}
    return found


@pytest.mark.cluster
def test_a_cluster_left_up_runs_the_services_other_drivers_use(shared_cluster):
    cluster_dir = os.path.dirname(shared_cluster["info"]["token_path"])
    assert _services_of(cluster_dir) == set(_SERVICES)


@pytest.mark.lifecycle
def test_head_node_lost(workdir, tmp_path):
    launch, cluster_dir = _own_cluster_launch(workdir, tmp_path)
    assert _services_of(cluster_dir) == set(), "a run's own cluster serves no other driver"
    run_id = _run_id(tmp_path / "runs")
    for pid in _raylet_of(cluster_dir, 0):
        os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    rc, s = launch.finish()
    assert rc == 75 and time.monotonic() - t0 < 60
    f = s["first_failure"]
    assert f["process_index"] == 0 and f["reason"].startswith("head node lost")
    _assert_logs(s, 1)
    assert (Path(s["log_dir"]) / "ray.log").is_file()
    _assert_nothing_left(run_id, [cluster_dir])

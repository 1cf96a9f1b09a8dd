"""Hostile inputs that need real Ray to be seen: a bring-up that fails after its nodes started leaves
nothing behind; an emulated cluster listens on loopback only; a token ending in a newline works on
the Ray and the dashboard paths; `ray-driver.log` that is a directory; `logs` of a run whose files
were removed. The rules that need no cluster are in tests/unit/test_hostile_inputs.py.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from support import SHARED, cli_env, live_processes, processes_mentioning, read_only, run_cli
from tpulaunch.cluster import ownership
from tpulaunch.cluster.emulated import ray_temp_dir
from tpulaunch.errors import ExitCode


def one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert "internal error" not in lines[0], lines[0]
    return lines[0]


def left_behind(needles: list[str]) -> list[str]:
    """Live processes whose argv, environment or open files name any needle (`support.live_processes`)."""
    return processes_mentioning(needles)


# -- 8. an emulated cluster listens on loopback only ---------------------------------------------------


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words, each in this machine's byte order."""
    raw = bytes.fromhex(hex_addr)
    words = [raw[i:i + 4] for i in range(0, len(raw), 4)]
    return ipaddress.ip_address(b"".join(w[::-1] if sys.byteorder == "little" else w for w in words))


def _is_loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a v4 socket seen through a v6 one
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def listening_sockets(pids: list[int]) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, int]]:
    """(address, port, pid) of every listening TCP socket the processes `pids` hold."""
    owner: dict[str, int] = {}
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            fds = list(fd_dir.iterdir())
        except OSError:  # gone since it was listed
            continue
        for fd in fds:
            try:
                target = str(fd.readlink())
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[len("socket:["):-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in owner:  # 0A: TCP_LISTEN
                addr, port = local.split(":")
                found.append((_address(addr), int(port, 16), owner[inode]))
    return found


@pytest.mark.cluster
def test_an_emulated_cluster_listens_on_loopback_only(side_cluster):
    """Before: the GCS, raylets, workers and the dashboard agent's gRPC listened on every interface, and
    the autoscaler monitor's and the dashboard's metrics (44217, 44227) answered /metrics on 0.0.0.0
    without the token. Every Ray component of the cluster is looked at, none skipped."""
    rec = side_cluster["record"]
    pids = ownership.cluster_pids(rec["cluster_id"], rec["temp_dir"])
    sockets = listening_sockets(pids)
    ports = {port for _ip, port, _pid in sockets}
    gcs_port = int(rec["address"].rpartition(":")[2])
    dashboard_port = int(rec["dashboard"].rpartition(":")[2])
    assert {gcs_port, dashboard_port} <= ports, f"the GCS or the dashboard is not among {sorted(ports)}: wrong processes?"
    procs = live_processes()

    def who(pid: int) -> str:  # Ray's agents rename themselves: their argv[0] says which one
        argv = procs.get(pid, {}).get("cmdline", b"").split(b"\0")
        return " ".join(a.decode(errors="replace") for a in argv[:2])[:100]

    outside = [f"{ip}:{port} (pid {pid}: {who(pid)})" for ip, port, pid in sockets if not _is_loopback(ip)]
    assert not outside, "listening beyond loopback: " + "; ".join(outside)


# -- 3. a token file ending in a newline ---------------------------------------------------------------


@pytest.mark.cluster
def test_a_token_file_ending_in_a_newline_works_and_one_with_inner_whitespace_is_refused(side_cluster, tmp_path):
    rec = side_cluster["record"]
    token = Path(rec["token_path"]).read_text()
    assert token == token.strip()

    def with_token(content: str) -> dict[str, str]:
        path = tmp_path / f"token-{len(list(tmp_path.iterdir()))}"
        path.write_text(content)
        path.chmod(0o600)
        return cli_env(TPULAUNCH_HOME=str(tmp_path / "elsewhere"), RAY_AUTH_TOKEN_PATH=str(path))

    for content in (token + "\n", token + "\r\n", token + " \n\n"):
        ray_path = run_cli("cluster", "status", "--address", rec["address"], "--json", env=with_token(content))
        assert ray_path.returncode == 0, ray_path.stderr  # ray.init with the file: Ray reads it itself
        assert all(h["alive"] for s in json.loads(ray_path.stdout)["slices"] for h in s["hosts"])
        dashboard_path = run_cli("runs", "--address", f"http://{rec['dashboard']}", "--json", env=with_token(content))
        assert dashboard_path.returncode == 0, dashboard_path.stderr  # the job API, with tpulaunch's header
    in_env = run_cli("runs", "--address", f"http://{rec['dashboard']}", "--json",
                     env=cli_env(TPULAUNCH_HOME=str(tmp_path / "elsewhere"), RAY_AUTH_TOKEN=token + "\n"))
    assert in_env.returncode == 0, in_env.stderr

    split = token[:32] + " " + token[32:] + "\n"
    for args in (["cluster", "status", "--address", rec["address"]], ["runs", "--address", f"http://{rec['dashboard']}"]):
        proc = run_cli(*args, env=with_token(split))
        assert proc.returncode == ExitCode.STATE, proc.stderr
        assert "does not hold a token (expected one word of printable characters)" in one_error_line(proc)


# -- 5. ray-driver.log that is a directory ---------------------------------------------------------------


@pytest.mark.cluster
def test_ray_driver_log_that_is_a_directory_is_one_line_naming_it(side_cluster, tmp_path):
    """Before: IsADirectoryError, exit 70, as the command connected to Ray."""
    rec = side_cluster["record"]
    home = tmp_path / "home"
    (home / "ray-driver.log").mkdir(parents=True)
    home.chmod(0o700)
    proc = run_cli("cluster", "status", "--address", rec["address"],
                   env=cli_env(TPULAUNCH_HOME=str(home), RAY_AUTH_TOKEN_PATH=rec["token_path"]))
    assert proc.returncode == ExitCode.STATE, proc.stderr
    line = one_error_line(proc)
    assert f"tpulaunch's log of Ray's own messages {home / 'ray-driver.log'} is a directory" in line, line


# -- 2. a failed bring-up leaves nothing behind -------------------------------------------------------------




def _marked_for(temp_dir: Path, home: Path) -> bool:
    """The temp dir's marker names `home` (another's cluster may come and go meanwhile: not ours)."""
    try:
        return json.loads((temp_dir / ownership.MARKER).read_text()).get("home") == str(home.resolve())
    except (OSError, ValueError, AttributeError):
        return False


@pytest.mark.lifecycle
def test_a_home_that_cannot_be_written_starts_nothing(tmp_path):
    """Before: the nodes started, the record could not be written (exit 70), and the cluster's ~10 Ray
    processes and its temp dir were left behind."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    before = set(ownership.temp_root().glob(f"{ownership.PREFIX}*"))
    with read_only(home):
        proc = run_cli("cluster", "up", "--topology", "2x2x2", "--accelerator", "v4", "--prewarm", "none",
                       env=cli_env(TPULAUNCH_HOME=str(home)), timeout=300)
    assert proc.returncode == ExitCode.STATE, proc.stderr
    assert f"tpulaunch's state directory {home} cannot be written" in one_error_line(proc)
    ours = [d for d in set(ownership.temp_root().glob(f"{ownership.PREFIX}*")) - before if _marked_for(d, home)]
    assert not ours, f"a temp dir was made: {ours}"
    assert not left_behind([str(home)]), "a process was started"


@pytest.mark.lifecycle
def test_a_bring_up_that_fails_after_its_nodes_started_leaves_nothing(tmp_path):
    """The record cannot be written once the nodes are up (its temporary file is a directory here):
    one line naming it, exit 6, and the processes and temp dir of the cluster it started are gone."""
    home = tmp_path / "home"
    (home / "cluster.json.tmp").mkdir(parents=True)
    home.chmod(0o700)
    proc = run_cli("cluster", "up", "--topology", "2x2x2", "--accelerator", "v4", "--prewarm", "none",
                   env=cli_env(TPULAUNCH_HOME=str(home)), timeout=300)
    assert proc.returncode == ExitCode.STATE, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert f"the cluster record {home / 'cluster.json'} cannot be written: Is a directory" in line, line
    m = re.search(r"the cluster it started \((/\S+)\) was stopped", line)
    assert m, line
    temp_dir = m.group(1)
    assert not Path(temp_dir).exists()
    assert not left_behind([temp_dir, str(home)]), "the failed bring-up left processes behind"
    assert not (home / "cluster.json").exists() and (home / "cluster.json.tmp").is_dir()


# -- 7. `logs` of a run whose files were removed ---------------------------------------------------------


@pytest.mark.cluster
def test_logs_of_a_run_whose_files_were_removed_says_so(side_cluster, tmp_path):
    """Before: `logs RUN` (and --follow, and --host N --follow) printed nothing and exited 0."""
    (tmp_path / "hello.py").write_text("import tpulaunch\nprint('hello from', tpulaunch.context().process_index)\n")
    sub = run_cli("run", "hello.py", *SHARED, "--address", "auto", "--framework", "none", "--detach",
                  cwd=tmp_path, env=side_cluster["env"])
    assert sub.returncode == 0, sub.stderr
    run_id = sub.stdout.strip()
    waited = run_cli("wait", run_id, env=side_cluster["env"], timeout=300)
    assert waited.returncode == 0, waited.stderr
    logs = run_cli("logs", run_id, env=side_cluster["env"])
    assert logs.returncode == 0 and "[host 0] hello from 0" in logs.stdout, logs.stderr  # there, before

    # the head is this machine: its Ray log directory holds the job's log and the run's own files
    head_logs = Path(ray_temp_dir(str(Path(side_cluster["info"]["token_path"]).parent))) / "session_latest" / "logs"
    (head_logs / f"job-driver-{run_id}.log").unlink()
    shutil.rmtree(head_logs / "tpulaunch" / "runs" / run_id)
    for args in ([], ["--follow"], ["--host", "0"], ["--host", "0", "--follow"]):
        proc = run_cli("logs", run_id, *args, env=side_cluster["env"], timeout=120)
        assert proc.returncode == ExitCode.USAGE, (args, proc.returncode, proc.stdout, proc.stderr)
        line = one_error_line(proc)
        assert f"run {run_id} has no log" in line, (args, line)

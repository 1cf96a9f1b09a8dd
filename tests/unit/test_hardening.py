"""Hostile and broken state, one class of it per test (issue: hardening): planted or copied records
touch nothing, state files are read only when they are regular files of a bounded size, never
through a symlink, and a job API that answers junk, the wrong shape or a byte at a time is one line."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from pathlib import Path

import pytest

from fakes import closed_port, invoke
from support import cli_env
from tpulaunch.cluster import jobs
from tpulaunch.cluster.record import check_token_file, load_record
from tpulaunch.discover import ray_labels
from tpulaunch.errors import ClusterError, ExitCode, StateError

REMOTE = {"tpu": "x", "zone": "z", "project": "p", "port": 6379, "temp_dir": "/tmp/ray-x", "python": "python3"}


def _home(tmp_path: Path, record: object) -> Path:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "cluster.json").write_text(record if isinstance(record, str) else json.dumps(record))
    return home


def test_a_planted_record_of_a_real_cluster_deletes_nothing(tmp_path):
    decoy = tmp_path / "precious.txt"
    decoy.write_text("keep me")
    home = _home(tmp_path, {"address": "10.0.0.1:6379", "temp_dir": None, "token_path": str(decoy), "emulated": False,
                            "remote": REMOTE, "slices": []})
    proc = invoke("cluster", "down", env=cli_env(TPULAUNCH_HOME=str(home)))
    assert proc.returncode == ExitCode.STATE and "a cluster on TPUs with no slices" in proc.stderr
    assert decoy.read_text() == "keep me"


def test_only_tpulaunchs_own_token_files_are_ever_deleted(tmp_path, monkeypatch):
    from tpulaunch.cluster.tokens import is_ours as _our_token_file

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("TPULAUNCH_HOME", str(home))
    ours = home / "ray_token-abc"
    ours.write_text("t")
    link = home / "ray_token-link"
    link.symlink_to(tmp_path / "elsewhere")
    assert _our_token_file(str(ours))
    assert not _our_token_file(str(tmp_path / "ray_token-abc"))  # another directory
    assert not _our_token_file(str(home / "cluster.json"))  # another name
    assert not _our_token_file(str(link))  # a link


def test_a_symlinked_token_is_refused_and_never_read(tmp_path):
    target = tmp_path / "secret"
    target.write_text("abcdef")
    target.chmod(0o600)
    link = tmp_path / "token"
    link.symlink_to(target)
    with pytest.raises(StateError) as e:
        check_token_file(str(link))
    assert "is a symbolic link" in e.value.line() and "abcdef" not in e.value.line()


@pytest.mark.parametrize("kind, words", [
    ("fifo", "is not a regular file"),
    ("deep", "nested too deep"),
    ("bytes", "is not UTF-8 text"),
    ("huge", "larger than 1048576 bytes"),
    ("link", "a symbolic link (not followed)"),
])
def test_a_record_that_is_no_file_of_ours_is_one_line(tmp_path, kind, words):
    p = tmp_path / "cluster.json"
    if kind == "fifo":
        os.mkfifo(p)  # a read would wait for a writer forever
    elif kind == "deep":
        p.write_text("[" * 100_000)
    elif kind == "bytes":
        p.write_bytes(b'{"address": "\xff\xfe"}')
    elif kind == "huge":
        p.write_text(json.dumps({"address": "x" * (2 << 20)}))
    else:
        (tmp_path / "real.json").write_text("{}")
        p.symlink_to(tmp_path / "real.json")
    t0 = time.monotonic()
    with pytest.raises(StateError) as e:
        load_record(p)
    assert words in e.value.line() and time.monotonic() - t0 < 5
    assert e.value.exit_code == ExitCode.STATE


class _Junk(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):  # noqa: N802 - the stdlib's name
        if self.path.startswith("/api/jobs/trickle"):
            self.send_response(200)
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.1)
            return
        body = {"/api/jobs/": b"[1, 2, 3]", "/api/jobs/html": b"<html><body>login</body></html>",
                "/api/jobs/list": b'["a"]'}.get(self.path, b'{"submission_id": 5, "metadata": [1]}')
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def junk_api():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Junk)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield jobs.JobApi(f"http://127.0.0.1:{server.server_address[1]}", None, timeout=1.0)
    server.shutdown()


def test_a_job_api_that_answers_junk_is_one_line(junk_api):
    with pytest.raises(ClusterError, match="with something that is not JSON") as e:
        junk_api.info("html")
    assert e.value.exit_code == ExitCode.CLUSTER
    with pytest.raises(ClusterError, match="answered /api/jobs/ with a list, not what Ray's job API gives"):
        junk_api.list()
    info = junk_api.info("odd")  # fields of the wrong types read as unknown
    assert info is not None and info.submission_id == "" and info.metadata == {}


def test_a_job_api_that_trickles_is_cut_off_by_its_total_bound(junk_api):
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="took longer than 1 s"):
        junk_api.info("trickle")
    assert time.monotonic() - t0 < 3


class _Version(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):  # noqa: N802 - the stdlib's name
        refuse = self.server.refuse  # type: ignore[attr-defined]
        self.send_response(401 if refuse else 200)
        self.end_headers()
        self.wfile.write(b"no" if refuse else b'{"ray_version": "2.60.0"}')


def _serve_later(port: int, delay: float, refuse: bool) -> list[http.server.ThreadingHTTPServer]:
    started: list[http.server.ThreadingHTTPServer] = []

    def start() -> None:
        time.sleep(delay)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Version)
        server.refuse = refuse  # type: ignore[attr-defined]
        started.append(server)
        server.serve_forever()

    threading.Thread(target=start, daemon=True).start()
    return started


def test_a_dashboard_that_answers_late_is_waited_for_and_a_refusal_is_not():
    unused_port = closed_port()
    # a head pod is ready before its dashboard answers (KubeRay's probe asks the dashboard agent)
    api = jobs.JobApi(f"http://127.0.0.1:{unused_port}", None, timeout=1.0)
    with pytest.raises(jobs.Unreachable):
        api.version()  # nothing listens yet
    started = _serve_later(unused_port, 0.5, refuse=False)
    assert api.wait_answering(30)["ray_version"] == "2.60.0"
    started[0].shutdown()
    started[0].server_close()
    with pytest.raises(jobs.Unreachable):
        api.wait_answering(0.5)  # gone: waited for, then one line
    refusing = _serve_later(unused_port, 0, refuse=True)
    for _ in range(200):
        if refusing:
            break
        time.sleep(0.05)
    with pytest.raises(ClusterError, match="refused no token") as e:
        api.wait_answering(30)
    assert not isinstance(e.value, jobs.Unreachable)
    refusing[0].shutdown()
    refusing[0].server_close()


class _SlowNodes(http.server.BaseHTTPRequestHandler):
    """Ray's node list, the first two times only after the client's bound (a head loaded by the hosts
    joining it)."""

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.server.asked += 1  # type: ignore[attr-defined]
        if self.server.asked <= 2:  # type: ignore[attr-defined]
            time.sleep(0.6)
        node = {"state": "ALIVE", "labels": {ray_labels.SLICE: "tpu-0", ray_labels.WORKER: "0"}}
        body = json.dumps({"data": {"result": {"result": [node]}}}).encode()
        try:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up on this one
            pass


def test_bring_up_asks_a_head_that_answered_too_late_again_until_its_bound():
    from tpulaunch.providers.gke import wait_ray

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowNodes)
    server.asked = 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = jobs.JobApi(f"http://127.0.0.1:{server.server_address[1]}", None, timeout=0.3)
        said: list[str] = []
        wait_ray(api, ["tpu-0"], 1, 60, said.append)
        assert said == ["in Ray: tpu-0: 1/1"] and server.asked == 3  # type: ignore[attr-defined]
        server.asked = 0  # type: ignore[attr-defined]
        with pytest.raises(jobs.Unreachable):
            wait_ray(api, ["tpu-0"], 1, 0, said.append)  # past its bound: the one line
    finally:
        server.shutdown()
        server.server_close()

"""The cluster record (`cluster/record.py`): typed, versioned, and read from older tpulaunch.

A record written before the schema (v1: no `schema`, `remote` an untyped dict with "tpu", slices as
dicts) is still read into the typed record; a record from a newer tpulaunch is refused in one
line naming both versions (exit 6), as is a `remote` entry that is not a cluster on TPUs.
"""

from __future__ import annotations

import json
import os

import pytest

from fakes import invoke
from support import cli_env
from tpulaunch.cluster.record import CLUSTER_SCHEMA, ClusterInfo, RemoteSpec, load_record, save_record
from tpulaunch.errors import ExitCode, StateError
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint

SLICE = SliceSpec(name="my-v4", accelerator_type="v4-16", topology="2x2x2", source="tpu-api", zone="z", project="p",
                  workers=(WorkerEndpoint(0, "10.0.0.2"), WorkerEndpoint(1, "10.0.0.3")))

# what `cluster up --tpu my-v4 --head local` wrote before the schema (tpulaunch at b8cae68)
V1_REMOTE = {
    "address": "10.0.0.9:6380", "temp_dir": "/tmp/tpl-abc", "token_path": "/h/tokens/x.token", "emulated": False,
    "slices": [SLICE.to_dict()], "created": 1764000000.0,
    "remote": {"tpu": "my-v4", "zone": "z", "project": "p", "port": 6380, "temp_dir": "/tmp/ray-tpl", "python": "python3",
               "head": "local", "setup": None, "head_ip": "10.0.0.9", "dashboard_port": 8265, "head_python": "/v/bin/python",
               "tpus": ["my-v4"]},
    "kept": False, "idle_timeout": None, "log_monitor": False, "cluster_id": "c0ffee", "dashboard": "10.0.0.9:8265",
}


def test_a_record_round_trips_typed_with_its_schema(tmp_path):
    info = ClusterInfo(address="10.0.0.9:6380", temp_dir="/tmp/tpl-abc", token_path=None, emulated=False,
                       slices=[SLICE], remote=RemoteSpec(("my-v4",), "z", "p", 6380, "/tmp/ray", "python3"),
                       cluster_id="c0ffee")
    path = tmp_path / "cluster.json"
    save_record(info, path)
    doc = json.loads(path.read_text())
    assert doc["schema"] == CLUSTER_SCHEMA == "tpulaunch.cluster/v2"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    back = load_record(path)
    assert back == info
    assert isinstance(back.slices[0], SliceSpec) and back.remote.tpu == "my-v4" and not back.remote.head_here


def test_a_record_from_before_the_schema_is_read(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(V1_REMOTE))
    info = load_record(path)
    assert info.slices == [SLICE]
    r = info.remote
    assert (r.tpus, r.zone, r.head, r.head_ip, r.dashboard_port, r.head_python) == (
        ("my-v4",), "z", "local", "10.0.0.9", 8265, "/v/bin/python")
    one = dict(V1_REMOTE, remote={k: v for k, v in V1_REMOTE["remote"].items() if k != "tpus"})  # one TPU: "tpu" only
    path.write_text(json.dumps(one))
    assert load_record(path).remote.tpus == ("my-v4",)
    save_record(info, path)  # written back in the new form
    assert json.loads(path.read_text())["schema"] == CLUSTER_SCHEMA


def test_a_record_from_a_newer_tpulaunch_is_refused_naming_both(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({**V1_REMOTE, "schema": "tpulaunch.cluster/v3"}))
    with pytest.raises(StateError) as e:
        load_record(path)
    assert e.value.exit_code == ExitCode.STATE
    assert e.value.line().startswith(f"cluster record {path} is 'tpulaunch.cluster/v3', from another tpulaunch;"
                                     " this one reads tpulaunch.cluster/v2 (and tpulaunch.cluster/v1)")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "cluster.json").write_text(path.read_text())
    proc = invoke("cluster", "status", env=cli_env(TPULAUNCH_HOME=str(home)))
    assert proc.returncode == ExitCode.STATE and "tpulaunch.cluster/v3" in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1


@pytest.mark.parametrize("remote, words", [
    ({"tpu": "x"}, "KeyError"),
    ({**V1_REMOTE["remote"], "port": "6380"}, "not an integer"),
    ({**V1_REMOTE["remote"], "head": "elsewhere"}, "ValueError: head"),
    ({**V1_REMOTE["remote"], "head_ip": None}, "a local head with no address"),
    ({**{k: v for k, v in V1_REMOTE["remote"].items() if k != "tpu"}, "tpus": []}, "KeyError"),
    ([1, 2], "field 'remote' is [1, 2], not a dict"),
])
def test_a_remote_entry_that_is_no_cluster_on_tpus_is_one_line(tmp_path, remote, words):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({**V1_REMOTE, "remote": remote}))
    with pytest.raises(StateError) as e:
        load_record(path)
    assert words in e.value.line() and "cluster down --force" in e.value.line()


def test_junk_slices_are_one_line(tmp_path):
    path = tmp_path / "cluster.json"
    for junk in ([{"name": "x"}], [{"name": "x", "accelerator_type": "v4-8", "topology": "2x2x1", "source": "t",
                                   "workers": [{"ip": 1}]}]):
        path.write_text(json.dumps({**V1_REMOTE, "slices": junk}))
        with pytest.raises(StateError, match="'slices' holds something other than slices"):
            load_record(path)


def test_a_cluster_that_could_not_start_keeps_its_logs_where_the_error_says(tmp_path, monkeypatch):
    """Its temp dir goes with it (`stop_cluster`); every node's logs and the helpers' are copied out first."""
    from tpulaunch.cluster.emulated import keep_logs

    monkeypatch.setenv("TPULAUNCH_HOME", str(tmp_path / "home"))
    temp = tmp_path / "tpl-x"
    files = {"ray/session_1/logs/raylet.out": "Check failed: Timed out waiting for file",
             "s0w1/session_1/logs/dashboard_agent.log": "agent", "nodes.log": "helper",
             "ray/session_1/sockets/raylet": "", "ray/session_1/ports_by_node.json": "{}", "tpulaunch-cluster": "{}"}
    for rel, text in files.items():
        (temp / rel).parent.mkdir(parents=True, exist_ok=True)
        (temp / rel).write_text(text)
    (temp / "ray" / "session_latest").symlink_to(temp / "ray" / "session_1")
    kept = keep_logs(ClusterInfo(address="", temp_dir=str(temp), token_path=None, emulated=True, cluster_id="c0ffee"))
    assert kept == str(tmp_path / "home" / "failed-starts" / "c0ffee")
    got = sorted(str(p.relative_to(kept)) for p in tmp_path.joinpath(kept).rglob("*") if p.is_file())
    assert got == ["nodes.log", "ray/session_1/logs/raylet.out", "s0w1/session_1/logs/dashboard_agent.log"]
    assert (tmp_path / kept / "ray/session_1/logs/raylet.out").read_text().startswith("Check failed")
    empty = tmp_path / "tpl-empty"
    empty.mkdir()
    assert keep_logs(ClusterInfo(address="", temp_dir=str(empty), token_path=None, emulated=True, cluster_id="c1")) is None

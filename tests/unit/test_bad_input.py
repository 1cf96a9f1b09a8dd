"""Every bad value and every unusable piece of state: one line, the documented exit code, nothing
started, nothing touched. In this process (the commands fail before Ray or any host is involved).

Processes that must survive (a decoy named by a hostile record) and clusters that are really
running are in tests/integration/test_broken_state.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fakes import invoke
from support import cli_env, one_line, write_scripts
from tpulaunch.cluster import ownership
from tpulaunch.errors import ExitCode, StateError


@pytest.fixture
def work(tmp_path):
    (tmp_path / "work").mkdir()
    return write_scripts(tmp_path / "work", {"train.py": "import tpulaunch\n"})


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


def run(work, home, *args, env_extra=None):
    return invoke("run", "train.py", *args, cwd=work, env=cli_env(TPULAUNCH_HOME=str(home), **(env_extra or {})))


# -- numbers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value, says", [
    ("--preemption-grace", "nan", "--preemption-grace nan is not a number of 0 or more"),
    ("--preemption-wait", "nan", "--preemption-wait nan is not a number of 0 or more"),
    ("--preemption-wait", "inf", "--preemption-wait inf is not a number of 0 or more"),
    ("--preemption-grace", "-1", "--preemption-grace -1 is not a number of 0 or more"),
    ("--timeout", "nan", "--timeout nan is not a positive number"),
    ("--stall-timeout", "inf", "--stall-timeout inf is not a positive number"),
    ("--schedule-timeout", "nan", "--schedule-timeout nan is not a positive number"),
    ("--idle-timeout", "-inf", "--idle-timeout -inf is not a positive number"),
    ("--max-upload-mb", "nan", "--max-upload-mb nan is not a positive number"),
    ("--straggler-ratio", "nan", "--straggler-ratio nan is not a fraction below 1"),
    ("--straggler-ratio", "1", "--straggler-ratio 1 is not a fraction below 1"),
    ("--straggler-ratio", "-0.5", "--straggler-ratio -0.5 is not a fraction below 1"),
    ("--coordinator-port", "0", "--coordinator-port 0 is not a TCP port"),
    ("--coordinator-port", "65535", "--coordinator-port 65535 is not a TCP port"),
])
def test_numbers_out_of_their_range_are_refused(work, home, flag, value, says):
    assert says in one_line(run(work, home, "--topology", "2x8", flag, value), ExitCode.USAGE)


@pytest.mark.parametrize("args, says", [
    (["--topology", "2x8", "--num-slices", "10000"], "--num-slices 10000 is more slices than a multislice job can have (1024)"),
    (["--accelerator", "v3-32", "--num-slices", "2"], "v3 slices do not form a multislice"),
    (["--topology", "2x8", "--num-slices", "300"], "emulating 1200 hosts needs 1200 Ray nodes on this machine"),
    (["--topology", "2x8", "--mesh", "None=4,model=4"], "--mesh axis name 'None' is reserved"),
    (["--topology", "2x8", "--dcn", "_=2", "--num-slices", "2"], "--dcn axis name '_' is reserved"),
])
def test_counts_a_slice_cannot_have_and_reserved_names(work, home, args, says):
    assert says in one_line(run(work, home, *args), ExitCode.USAGE)


@pytest.mark.parametrize("hosts, says", [
    ("7", "--hosts 7: the run has hosts 0-3"),
    ("-1", "--hosts -1: the run has hosts 0-3"),
    ("0,9", "--hosts 9: the run has hosts 0-3"),
    ("", "--hosts is empty"),
    ("first", "--hosts 'first' is not a list of host numbers"),
])
def test_host_selections_outside_the_slice(work, home, hosts, says):
    assert says in one_line(run(work, home, "--topology", "2x8", "--hosts", hosts), ExitCode.USAGE)


# -- directories -----------------------------------------------------------------------------------


def test_unusable_log_and_working_directories(work, home, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for log_dir, says in ((a_file, "is a file, not a directory"), (a_file / "sub", "is a file, not a directory"),
                          ("/proc/tpl-runs", "is under /proc, which holds no files"),
                          ("/sys/kernel/x", "is under /sys, which holds no files")):
        line = one_line(run(work, home, "--topology", "2x8", "--log-dir", str(log_dir)), ExitCode.USAGE)
        assert f"--log-dir {log_dir}" in line and says in line
    line = one_line(run(work, home, "--topology", "2x8", "--workdir", str(a_file)), ExitCode.USAGE)
    assert f"working directory {a_file} is a file" in line
    assert not (work / "runs").exists(), "nothing was created"


# -- ports, commands, addresses, the environment ----------------------------------------------------


def test_ports_outside_the_range(home):
    env = cli_env(TPULAUNCH_HOME=str(home))
    for port in ("0", "65536", "-1"):
        line = one_line(invoke("cluster", "up", "--tpu", "t", "--port", port, env=env), ExitCode.USAGE)
        assert "Invalid value for '--port'" in line


def test_several_tpus_need_the_head_off_the_slices_and_each_tpu_once(home):
    env = cli_env(TPULAUNCH_HOME=str(home))
    line = one_line(invoke("cluster", "up", "--tpu", "a", "--tpu", "b", env=env), ExitCode.USAGE)
    assert "2 TPUs with the Ray head on worker 0 of a" in line and "--head local" in line
    line = one_line(invoke("cluster", "up", "--tpu", "a", "--tpu", "a", "--head", "local", env=env), ExitCode.USAGE)
    assert "--tpu names a TPU twice" in line


def test_empty_commands(work, home):
    env = cli_env(TPULAUNCH_HOME=str(home))
    line = one_line(invoke("exec", "--topology", "2x8", "--", "", cwd=work, env=env), ExitCode.USAGE)
    assert "the command to run is empty" in line


@pytest.mark.parametrize("value, source", [("garbage", "RAY_ADDRESS"), ("10.0.0.1:99999", "RAY_ADDRESS"),
                                           ("host:port", "RAY_ADDRESS")])
def test_a_bad_ray_address_names_where_it_came_from(work, home, value, source):
    line = one_line(run(work, home, "--topology", "2x8", "--dry-run", env_extra={"RAY_ADDRESS": value}), ExitCode.USAGE)
    assert f"{source} '{value}' is not HOST:PORT" in line and "unset RAY_ADDRESS" in line


def test_an_empty_or_bad_address_flag(work, home):
    assert "--address is empty" in one_line(run(work, home, "--topology", "2x8", "--address", ""), ExitCode.USAGE)
    line = one_line(run(work, home, "--topology", "2x8", "--address", "nohost"), ExitCode.USAGE)
    assert "--address 'nohost' is not HOST:PORT" in line


@pytest.mark.parametrize("name, value", [("TPULAUNCH_CONNECT_TIMEOUT", "abc"), ("TPULAUNCH_CONNECT_TIMEOUT", "nan"),
                                         ("TPULAUNCH_DIST_TIMEOUT", "-3")])
def test_bad_settings_in_the_environment_are_named_before_anything_starts(work, home, name, value):
    line = one_line(run(work, home, "--topology", "2x8", env_extra={name: value}), ExitCode.USAGE)
    assert line.startswith(f"error: {name}")


def test_bad_settings_given_to_the_hosts_with_env(work, home):
    line = one_line(run(work, home, "--topology", "2x8", "--env", "TPULAUNCH_JAX_INIT_TIMEOUT=soon"), ExitCode.USAGE)
    assert "TPULAUNCH_JAX_INIT_TIMEOUT='soon' is not a number of seconds" in line


# -- state: the state dir, records, tokens ----------------------------------------------------------


def test_tpulaunch_home_that_is_a_file_or_open_to_others(work, tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    line = one_line(invoke("cluster", "status", env=cli_env(TPULAUNCH_HOME=str(f))), ExitCode.USAGE)
    assert f"TPULAUNCH_HOME={f} is a file" in line
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    line = one_line(invoke("cluster", "status", env=cli_env(TPULAUNCH_HOME=str(shared))), ExitCode.STATE)
    assert "can be written by others (mode 0777)" in line and f"chmod 700 {shared}" in line


BAD_RECORDS = {
    "cut in half": ('{"address": "127.0.0.2:1", "temp_dir": "/tmp/tpl-x", "tok', "is corrupt (line 1"),
    "a list": ("[1, 2]", "is corrupt (a list, not an object)"),
    "wrong types": (json.dumps({"address": 5, "temp_dir": None, "token_path": None, "emulated": True}),
                    "field 'address' is 5, not a str"),
    "slices of strings": (json.dumps({"address": "a:1", "temp_dir": None, "token_path": None, "emulated": False,
                                      "slices": ["x"]}), "field 'slices' holds something other than slices"),
    "missing fields": (json.dumps({"address": "a:1"}), "has no 'temp_dir'"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_record_that_cannot_be_read_is_said_to_be_unreadable(work, home, case):
    text, says = BAD_RECORDS[case]
    home.mkdir(mode=0o700)
    (home / "cluster.json").write_text(text)
    env = cli_env(TPULAUNCH_HOME=str(home))
    for args in (["cluster", "status"], ["cluster", "env"], ["cluster", "down"]):
        line = one_line(invoke(*args, env=env), ExitCode.STATE)
        assert f"cluster record {home / 'cluster.json'}" in line and says in line, line
        assert "tpulaunch cluster down --force" in line
    line = one_line(run(work, home, "--topology", "2x8", "--address", "auto"), ExitCode.STATE)
    assert says in line


def test_a_record_that_is_a_directory(home):
    (home / "cluster.json").mkdir(parents=True)
    home.chmod(0o700)
    line = one_line(invoke("cluster", "down", env=cli_env(TPULAUNCH_HOME=str(home))), ExitCode.STATE)
    assert "is a directory, not a file" in line


def test_a_plain_run_says_why_it_ignores_an_unreadable_record(work, home):
    home.mkdir(mode=0o700)
    (home / "cluster.json").write_text("{")
    proc = run(work, home, "--topology", "2x8", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "note: cluster record" in proc.stderr and "is corrupt" in proc.stderr
    assert "starting a cluster of this run's own" in proc.stderr


@pytest.mark.parametrize("mode, content, says", [
    (0o644, "a" * 64, "can be read by others (mode 0644)"),
    (0o640, "a" * 64, "can be read by others (mode 0640)"),
    (0o600, "", "does not hold a token"),
    (0o600, "two words", "does not hold a token"),
])
def test_a_token_file_others_can_read_or_that_holds_no_token(work, home, tmp_path, mode, content, says):
    tok = tmp_path / "token"
    tok.write_text(content)
    tok.chmod(mode)
    line = one_line(run(work, home, "--topology", "2x8", "--address", "127.0.0.1:1",
                        env_extra={"RAY_AUTH_TOKEN_PATH": str(tok)}), ExitCode.STATE)
    assert f"the cluster's token file {tok}" in line and says in line


# -- what tpulaunch may touch ----------------------------------------------------------------------


def _record(home: Path, **fields) -> Path:
    home.mkdir(mode=0o700, exist_ok=True)
    doc = {"address": "127.0.0.2:1", "temp_dir": None, "token_path": None, "emulated": True, **fields}
    (home / "cluster.json").write_text(json.dumps(doc))
    return home / "cluster.json"


@pytest.mark.parametrize("temp_dir, says", [
    ("/tmp", "field 'temp_dir' is /tmp, not a /tmp/tpl-* directory"),
    ("relative/tpl-x", "not a /tmp/tpl-* directory"),
    (["/tmp/tpl-x"], "field 'temp_dir' is ['/tmp/tpl-x'], not a str"),
])
def test_a_record_naming_a_directory_not_ours_is_refused(home, temp_dir, says):
    _record(home, temp_dir=temp_dir, cluster_id="abc")
    line = one_line(invoke("cluster", "down", env=cli_env(TPULAUNCH_HOME=str(home))), ExitCode.STATE)
    assert says in line


def test_a_tpl_directory_without_our_marker_is_not_deleted(home, tmp_path):
    decoy = Path(ownership.make_temp_dir("someone-else", tmp_path))  # a tpl-* dir marked for another cluster
    (decoy / "precious").write_text("keep me")
    try:
        _record(home, temp_dir=str(decoy), cluster_id="ours")
        line = one_line(invoke("cluster", "down", env=cli_env(TPULAUNCH_HOME=str(home))), ExitCode.STATE)
        assert f"({decoy}) is marked for cluster someone-else, not for cluster ours" in line
        assert "nothing was stopped or deleted" in line
        assert (decoy / "precious").read_text() == "keep me"
        (decoy / ownership.MARKER).unlink()
        line = one_line(invoke("cluster", "down", env=cli_env(TPULAUNCH_HOME=str(home))), ExitCode.STATE)
        assert "has no tpulaunch marker" in line and (decoy / "precious").exists()
        _record(home, temp_dir=str(decoy), cluster_id=None)  # a record from before the markers
        assert "has no 'cluster_id'" in one_line(invoke("cluster", "down", env=cli_env(TPULAUNCH_HOME=str(home))),
                                                 ExitCode.STATE)
    finally:
        import shutil

        shutil.rmtree(decoy, ignore_errors=True)


def test_ownership_checks_are_by_marker_and_exact_id(tmp_path):
    d = ownership.make_temp_dir("c1", tmp_path)
    try:
        assert ownership.check_temp_dir(d, "c1", "rec") == d
        with pytest.raises(StateError, match="marked for cluster c1, not for cluster c2"):
            ownership.check_temp_dir(d, "c2", "rec")
        link = d + "-link"
        os.symlink(d, link)
        try:
            with pytest.raises(StateError, match="not a directory of this user"):
                ownership.check_temp_dir(link, "c1", "rec")  # a symlink named tpl-* is not our dir
        finally:
            os.unlink(link)
        assert ownership.check_temp_dir("/tmp/tpl-gone-already", "c1", "rec") == "/tmp/tpl-gone-already"
    finally:
        import shutil

        shutil.rmtree(d)


def test_force_finds_the_clusters_of_this_home_and_of_homes_that_are_gone(tmp_path, monkeypatch):
    """`cluster down --force` in one CI job must not stop a parallel job's cluster (another
    TPULAUNCH_HOME); a cluster whose home was deleted, or marked before homes were, is still found."""
    monkeypatch.setattr(ownership, "temp_root", lambda: tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    a, b, gone = tmp_path / "a", tmp_path / "b", tmp_path / "gone"
    for h in (a, b, gone):
        h.mkdir()
    ids = {"ca": a, "cb": b, "cgone": gone}
    for cid, h in ids.items():
        ownership.make_temp_dir(cid, h)
    gone.rmdir()
    legacy = Path(ownership.make_temp_dir("clegacy", a))
    (legacy / ownership.MARKER).write_text(json.dumps({"cluster_id": "clegacy"}))  # no home: before homes
    ours = set(ids) | {"clegacy"}

    def found(home):
        return {o.cluster_id for o in ownership.find_orphans(home)} & ours

    assert found(a) == {"ca", "cgone", "clegacy"}
    assert found(b) == {"cb", "cgone", "clegacy"}
    assert found(None) == ours
    line = one_line(invoke("cluster", "down", "--all", env=cli_env(TPULAUNCH_HOME=str(a))), ExitCode.USAGE)
    assert "--all goes with --force" in line


BIG = "9" * 10_000


@pytest.mark.parametrize("args, says", [
    (["mesh", "inspect", "--topology", "2x" + BIG], "(10002 characters)' is not a topology"),
    (["mesh", "inspect", "v4-" + BIG], "(10003 characters)"),
    (["run", "train.py", "--topology", "2x8", "--max-restarts", "9" * 400, "--dry-run"],
     "is not a count from 0 to 1000000"),
    (["run", "train.py", "--topology", "2x8", "--max-preemptions", "-1", "--dry-run"], "is not a count from 0"),
    (["run", "train.py", "--topology", "2x8", "--env", "A\n=1", "--dry-run"], "--env 'A\\n=1' is not KEY=VALUE"),
    (["run", "train.py", "--topology", "2x8", "--log-dir", "x" * 10_000, "--dry-run"], "--log-dir is 10000 characters"),
    (["run", "train.py", "--topology", "2x8", "--compile-cache", "/etc/hostname", "--dry-run"], "is a file, not a directory"),
    (["run", "train.py", "--topology", "2x8", "--compile-cache", "/proc/x", "--dry-run"], "is under /proc"),
    (["cluster", "up", "--topology", "2x2", "--name", ""], "--name '' is not a slice name"),
    (["cluster", "up", "--topology", "2x2", "--name", "bad name!/.."], "is not a slice name"),
    (["cluster", "up", "--topology", "2x2", "--name", "a" * 10_000], "(10000 characters) is not a slice name"),
    (["slice", "create", "s1", "--accelerator", "v4-8", "--zone", "z", "--project", "p", "--wait-timeout", "nan"],
     "--wait-timeout nan is not a positive number"),
    (["slice", "create", "s1", "--accelerator", "v4-8", "--zone", "z", "--project", "p", "--wait-timeout", "-1"],
     "--wait-timeout -1 is not a positive number"),
    (["slice", "create", "s1", "--accelerator", "v4-8", "--zone", "z", "--project", "p", "--num-slices", "0"],
     "--num-slices 0 is not a number of slices"),
    (["slice", "create", "Bad_Name", "--accelerator", "v4-8", "--zone", "z", "--project", "p"],
     "is not a name the Cloud TPU API accepts"),
])
def test_values_past_any_bound_are_one_line_exit_2(work, home, args, says):
    proc = invoke(*args, env=cli_env(TPULAUNCH_HOME=str(home)), cwd=work)
    assert says in one_line(proc, ExitCode.USAGE)


@pytest.mark.parametrize("endpoint", ["::bad::", "http://[::1", "http://127.0.0.1:99999999"])
def test_a_malformed_tpu_api_endpoint_is_one_line(home, endpoint):
    proc = invoke("slice", "describe", "x", "--zone", "z", "--project", "p",
                  env=cli_env(TPULAUNCH_HOME=str(home), TPULAUNCH_TPU_API_ENDPOINT=endpoint))
    assert "TPULAUNCH_TPU_API_ENDPOINT=" in one_line(proc, ExitCode.USAGE)

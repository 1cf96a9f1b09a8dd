"""Hostile inputs that used to end in exit 70 (or in a silent success): each is one line, its
documented exit code, and nothing started. In this process: every command here fails before Ray
or any process is involved (the unit tier refuses a test that starts one, so a check that came too
late would fail here, not pass). What needs a real cluster is tests/integration/test_hostile_inputs.py.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from fakes import invoke
from support import cli_env, one_line, read_only
from tpulaunch.cluster import record
from tpulaunch.errors import ExitCode, MeshError, StateError
from tpulaunch.plan import mesh


@pytest.fixture
def home(tmp_path):
    d = tmp_path / "home"
    d.mkdir(mode=0o700)
    return d


def env_of(home: Path | str, **extra: str) -> dict[str, str]:
    return cli_env(TPULAUNCH_HOME=str(home), **extra)


# -- 1. a billion slices ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, asked", [
    (["mesh", "inspect", "--topology", "2x2x1", "--accelerator", "v4", "--num-slices", "1000000000"],
     "--num-slices 1000000000"),
    (["mesh", "inspect", "--topology", "2x2x1", "--accelerator", "v4", "--dcn", "data=1000000000"],
     "--dcn data=1000000000 (1000000000 slices)"),
    (["cluster", "up", "--topology", "2x2x1", "--accelerator", "v4", "--num-slices", "1000000000"],
     "--num-slices 1000000000"),
])
def test_more_slices_than_a_multislice_can_have_is_refused_before_any_is_planned(home, args, asked):
    """Before: 43-154 s of building a billion slice specs, then MemoryError (exit 70)."""
    line = one_line(invoke(*args, env=env_of(home)), ExitCode.USAGE)
    assert f"{asked} is more slices than a multislice job can have (1024)" in line
    assert "199 slices" in line  # why the bound is where it is


def test_the_slice_bound_itself():
    mesh.check_slice_count(1)
    mesh.check_slice_count(mesh.MAX_SLICES)
    for n in (0, -3, mesh.MAX_SLICES + 1):
        with pytest.raises(MeshError):
            mesh.check_slice_count(n)


# -- 2. a TPULAUNCH_HOME that cannot be written ------------------------------------------------------



def test_a_home_that_cannot_be_written_is_refused_before_a_cluster_starts(home):
    """Before: the nodes started, the record could not be written (exit 70), and ~10 Ray processes
    and the temp dir were left behind."""
    with read_only(home):
        probe = home / "probe"
        with pytest.raises(OSError):
            probe.write_text("x")  # the directory really is read-only here
        for args in (["cluster", "up", "--topology", "2x2x1", "--accelerator", "v4", "--prewarm", "none"],
                     ["cluster", "down"], ["cluster", "down", "--force"]):
            line = one_line(invoke(*args, env=env_of(home)), ExitCode.STATE)
            assert f"tpulaunch's state directory {home} cannot be written" in line, line
        with pytest.MonkeyPatch.context() as mp:  # what only reads it still may
            mp.setenv("TPULAUNCH_HOME", str(home))
            assert record.state_dir() == home
            with pytest.raises(StateError, match="cannot be written"):
                record.writable_state_dir()
    assert list(home.iterdir()) == []


def test_a_record_that_cannot_be_written_is_one_line_and_leaves_no_half_record(home):
    (home / "cluster.json.tmp").mkdir()
    info = record.ClusterInfo(address="127.0.0.1:1", temp_dir=None, token_path=None, emulated=True)
    with pytest.raises(StateError, match=r"cluster record .*cluster.json cannot be written: Is a directory"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TPULAUNCH_HOME", str(home))
            record.save_record(info)
    assert not (home / "cluster.json").exists()


# -- 3. a token file ending in a newline ---------------------------------------------------------------


@pytest.mark.parametrize("content", ["a" * 64 + "\n", "a" * 64 + "\r\n", "  " + "a" * 64 + " \n\n"])
def test_a_token_file_ending_in_a_newline_is_the_token(tmp_path, content):
    tok = tmp_path / "token"
    tok.write_text(content)
    tok.chmod(0o600)
    assert record.check_token_file(str(tok)) == "a" * 64


@pytest.mark.parametrize("content, code, says", [
    ("a" * 64 + "\n", ExitCode.CLUSTER, "cannot reach Ray at 127.0.0.1:"),  # the token passed; the address is dead
    ("a" * 32 + " " + "a" * 32 + "\n", ExitCode.STATE, "does not hold a token (expected one word"),
    ("a" * 32 + "\n" + "a" * 32 + "\n", ExitCode.STATE, "does not hold a token (expected one word"),
])
def test_the_cli_takes_a_token_ending_in_a_newline_and_refuses_one_with_inner_whitespace(home, tmp_path, content,
                                                                                        code, says):
    tok = tmp_path / "token"
    tok.write_text(content)
    tok.chmod(0o600)
    with socket.socket() as s:  # a port nothing listens on: the command must get as far as connecting
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        line = one_line(invoke("cluster", "status", "--address", f"127.0.0.1:{port}",
                               env=env_of(home, RAY_AUTH_TOKEN_PATH=str(tok))), code)
    assert says in line, line


# -- 4. a TPULAUNCH_HOME no path can be ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["a" * 10_000, "a" * 300, "x/" * 3000])
@pytest.mark.parametrize("args", [["cluster", "status"], ["cluster", "up", "--topology", "2x2x1"], ["cluster", "down"],
                                  ["runs"]])
def test_a_tpulaunch_home_too_long_for_a_path_is_a_bad_value(tmp_path, name, args):
    """Before: OSError: [Errno 36] File name too long (exit 70)."""
    long = str(tmp_path / name)
    line = one_line(invoke(*args, env=env_of(long)), ExitCode.USAGE)
    assert f"TPULAUNCH_HOME '{long[:40]}...' ({len(long)} characters) is too long a path" in line, line


# -- 5. ray-driver.log that is no file -----------------------------------------------------------------


def test_ray_driver_log_that_is_a_directory_is_named_before_a_cluster_starts(home):
    """Before: `cluster status` ended in IsADirectoryError (exit 70); `cluster up` started a cluster
    that then could not connect to it."""
    (home / "ray-driver.log").mkdir()
    line = one_line(invoke("cluster", "up", "--topology", "2x2x1", "--accelerator", "v4", "--prewarm", "none",
                           env=env_of(home)), ExitCode.STATE)
    assert f"tpulaunch's log of Ray's own messages {home / 'ray-driver.log'} is a directory" in line
    assert f"rm -r {home / 'ray-driver.log'}" in line


def test_what_ray_driver_log_may_be(home, monkeypatch):
    monkeypatch.setenv("TPULAUNCH_HOME", str(home))
    p = home / "ray-driver.log"
    assert record.driver_log_path() == p  # not there yet: made on first use
    p.write_text("")
    assert record.driver_log_path() == p
    p.unlink()
    p.symlink_to("/dev/null")  # a user dropping Ray's messages
    assert record.driver_log_path() == p
    p.unlink()
    os.mkfifo(p)  # opening it to write would block until someone reads
    with pytest.raises(StateError, match="is not a file"):
        record.driver_log_path()
    p.unlink()
    p.symlink_to(home / "nothing")
    with pytest.raises(StateError, match="symbolic link to nothing"):
        record.driver_log_path()


# -- 6. an empty RUN ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "wait", "logs", "stop"])
@pytest.mark.parametrize("run", ["", " ", "a b", "x" * 300])
def test_an_empty_or_malformed_run_is_refused_before_any_cluster_is_asked(home, command, run):
    """No cluster is up in `home`: a RUN that got past its check would end in exit 5 (no running
    cluster), not 2."""
    line = one_line(invoke(command, run, env=env_of(home)), ExitCode.USAGE)
    assert "is not a run id" in line and "`run --detach` printed, or last" in line

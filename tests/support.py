"""Helpers the tests share: the real CLI in a subprocess (`run_cli`), test scripts, /proc views.

(`conftest.py` holds the fixtures; `fakes/` the fake Cloud TPU API, metadata server and gcloud.)
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from tpulaunch import procfs


REPO = Path(__file__).resolve().parents[1]
FAKES = REPO / "tests" / "fakes"

# The slice of the shared emulated cluster (conftest.py `shared_cluster`): a v5p-16, 2 hosts of 4
# chips, 8 devices. Sized for the 2-core machines the suite runs on: an emulated torch_xla host
# holds the whole slice's devices and runs the whole SPMD program, so a 4-host v6e-16 (2x8) ran
# every program 4 times over 16 devices (64 device programs on 2 cores) where this runs it twice
# over 8. Two hosts still show everything multi-host (ranks, the gloo group, per-host input, which
# host is blamed); slices of 4 hosts and more run in the tests that start their own clusters.
SHARED = ("--topology", "2x2x2", "--accelerator", "v5p")
SHARED_HOSTS = 2

os.environ["NO_COLOR"] = "1"
os.environ["COLUMNS"] = "100"
os.environ.pop("FORCE_COLOR", None)
os.environ.pop("RAY_ADDRESS", None)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: str | Path | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m tpulaunch ARGS...` and capture stdout/stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "tpulaunch", *args],
        env=env or cli_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd, input=input,
    )


@contextmanager
def emulated_cluster(home: Path, *args: str, **extra_env: str):
    """`tpulaunch cluster up ARGS --json` under TPULAUNCH_HOME=home (and `extra_env`), then
    `cluster down`, also when the body fails (its failure is the one reported).

    Yields {"env": env reaching it, "info": the `cluster up --json` document, "home": home, "record": its
    record (`cluster.json`: its id, temp dir, addresses, token path)}.
    """
    env = cli_env(TPULAUNCH_HOME=str(home), **extra_env)
    record: dict = {}
    try:
        up = run_cli("cluster", "up", *args, "--json", env=env, timeout=300)
        assert up.returncode == 0, up.stderr
        record = json.loads((home / "cluster.json").read_text())
        yield {"env": env, "info": json.loads(up.stdout), "home": home, "record": record}
    finally:
        down = run_cli("cluster", "down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    # and nothing of it is left: no process names its id or temp dir (argv, environment, open files)
    from tpulaunch.cluster import ownership

    left = processes_mentioning([f"{ownership.ID_ENV}={record['cluster_id']}", record["temp_dir"]])
    assert not left, left[:5]


def run_json(*args: str, **kw) -> dict:
    proc = run_cli(*args, "--json", **kw)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def write_scripts(directory: Path, scripts: dict[str, str]) -> Path:
    """Write dedented test scripts into a directory (a launch's working directory)."""
    import textwrap

    for name, body in scripts.items():
        (directory / name).write_text(textwrap.dedent(body))
    return directory


def live_processes() -> dict[int, dict[str, bytes]]:
    """Every live (not zombie) process: its argv, environment and the paths of its open files."""
    return {p.pid: {"cmdline": p.cmdline(), "environ": p.environ(), "fds": "".join(p.open_files()).encode()}
            for p in procfs.processes(skip_self=False) if procfs.alive(p.pid)}


def processes_mentioning(needles: list[str]) -> list[str]:
    """Live processes whose argv, environment or open files mention any needle.

    A host process that was a spare shows its run only by a file it holds open (its environment
    predates the run): `tpulaunch-run-<run id>-...`.
    """
    out = []
    for pid, info in live_processes().items():
        blob = info["cmdline"] + info["environ"] + info["fds"]
        if any(n.encode() in blob for n in needles):
            out.append(f"{pid}: {blob[:160]!r}")
    return out


def last_summary(log_root: Path) -> dict:
    """summary.json of the newest run under a --log-dir."""
    runs = sorted(log_root.iterdir())
    assert runs, f"no run directory under {log_root}"
    return json.loads((runs[-1] / "summary.json").read_text())




def invoke_json(*args: str, env: dict[str, str] | None = None) -> dict:
    """`tpulaunch ARGS... --json` in this process (see `fakes.invoke`): the one JSON document."""
    from fakes import invoke

    proc = invoke(*args, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def status_doc(env: dict[str, str], run_id: str) -> dict:
    """What `tpulaunch status RUN --json` prints, asked from this process through the Python client.

    For loops that wait for a run to reach a state: they look every half second, and a CLI process
    per look costs most of a CPU-second on a 2-core machine. (The CLI's own output is asserted by
    the tests that call it.) `env` says which cluster, as it does for `run_cli`.
    """
    from unittest import mock

    import tpulaunch

    with mock.patch.dict(os.environ):  # restored as it was on the way out
        for k in ("TPULAUNCH_HOME", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "KUBECONFIG"):
            os.environ.pop(k, None)
            if env.get(k) is not None:
                os.environ[k] = env[k]
        return tpulaunch.Client("auto").run(run_id).status().to_dict()


def one_line(proc, code: int) -> str:
    """Exit `code`, nothing on stdout, exactly one line on stderr, no traceback: that line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "internal error" not in lines[0]
    return lines[0]


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def _set_immutable(path: Path, on: bool) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        flags[0] = flags[0] | FS_IMMUTABLE_FL if on else flags[0] & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags)
    finally:
        os.close(fd)


@contextmanager
def read_only(path: Path):
    """`path` made read-only for this user: mode 0500, or for root (whom no mode bit stops) the
    immutable attribute (`chattr +i`), which the kernel enforces on root as well. A filesystem
    that refuses the attribute to root fails the test (it cannot show what it is for)."""
    if os.geteuid() != 0:
        path.chmod(0o500)
        try:
            yield
        finally:
            path.chmod(0o700)
        return
    try:
        _set_immutable(path, True)
    except OSError as e:
        raise AssertionError(f"root cannot make {path} read-only on this filesystem ({e.strerror}):"
                             " run the suite as another user or on a filesystem with chattr +i") from None
    try:
        yield
    finally:
        _set_immutable(path, False)

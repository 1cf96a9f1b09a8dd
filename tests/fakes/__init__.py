"""Fakes that speak the real protocols (HTTP for the Cloud TPU API and the metadata server, an
executable on PATH for gcloud), and helpers to run the real `tpulaunch` command against them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAKE_BIN = Path(__file__).resolve().parent / "bin"
PYTHON_BIN = str(Path(sys.executable).parent)  # has python3 (for the fake gcloud), never gcloud


def hermetic_path(gcloud: bool = False) -> str:
    """A PATH with no real Cloud SDK on it (this machine has /usr/bin/gcloud), or the fake one first.

    The system's tools stay, as on any real machine (Ray's job manager runs `bash`): through a
    directory of links to them that leaves the Cloud SDK's commands out."""
    dirs = [str(FAKE_BIN)] if gcloud else []
    return os.pathsep.join([*dirs, PYTHON_BIN, system_bin()])


_CLOUD_SDK = {"gcloud", "gsutil", "bq", "docker-credential-gcloud", "git-credential-gcloud.sh"}


def system_bin() -> str:
    """A directory of links to /usr/local/bin, /usr/bin and /bin, without the Cloud SDK (made once
    per machine, atomically: parallel test processes may race to make it)."""
    import hashlib
    import tempfile

    dirs = ("/usr/local/bin", "/usr/bin", "/bin")
    names: dict[str, str] = {}
    for d in dirs:
        for n in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            if n not in _CLOUD_SDK and n not in names:
                names[n] = os.path.join(d, n)
    key = hashlib.sha256("\0".join(f"{n}={p}" for n, p in names.items()).encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"tplt-sysbin-{os.getuid()}-{key}"
    if not out.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        for n, p in names.items():
            os.symlink(p, tmp / n)
        try:
            os.rename(tmp, out)
        except OSError:  # another process made it first
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return str(out)


# Inherited variables that would let the host machine leak into a test.
_SCRUB_PREFIXES = ("TPULAUNCH_", "GOOGLE_", "CLOUDSDK_", "GCE_", "FAKE_GCLOUD_", "NO_GCE_CHECK", "TPU_")


def closed_port() -> int:
    """A local TCP port nothing listens on now, free to be bound later (by a test's cluster).

    Chosen as the product chooses ports it binds later (`cluster.ports`): below the kernel's
    ephemeral range, so no outgoing connection of the machine takes it in the meantime (a port from
    `bind(0)` is in that range: a fresh clone once failed with Ray's GCS "address already in use")."""
    from tpulaunch.cluster.ports import free_port

    return free_port()


def cli_env(home: Path, *, gcloud: bool = False, **extra: str) -> dict[str, str]:
    """A clean environment for the CLI: no host credentials/config, fake gcloud only if asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES)}
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(home),
        PATH=hermetic_path(gcloud),
        PYTHONPATH=str(REPO),
        NO_COLOR="1",
        COLUMNS="100",
        NO_GCE_CHECK="true",  # google-auth must never probe a real metadata server from tests
        GCE_METADATA_IP=f"127.0.0.1:{closed_port()}",
        CLOUDSDK_CONFIG=str(home / "gcloud-config"),
        # the fake API answers from the pytest process, which a loaded 2-core machine can hold off the
        # CPU for seconds (CI once timed out at the default 10 s); the default is tested in the unit tier
        TPULAUNCH_API_TIMEOUT="60",
    )
    if gcloud:
        # the fake VMs' image (tests/fakes/bin/gcloud): Ray's background work per node as on an emulated
        # cluster, since every "VM" shares this machine's cores, but with Ray's metrics on as on a real
        # VM (test_cluster_remote checks the agents' ports, the metrics exporter's among them); and XLA
        # compiling as the suite's own processes do (conftest.py)
        from tpulaunch.cluster.record import QUIET_RAY

        image = {k: v for k, v in QUIET_RAY.items() if k != "RAY_enable_metrics_collection"}
        env["FAKE_GCLOUD_VM_ENV"] = json.dumps({**image, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")})
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str], timeout: float = 60, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run the real console entry (`python -m tpulaunch ...`) in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "tpulaunch", *args],
        cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def flat(text: str) -> str:
    """Whitespace-normalized text, so assertions survive terminal-width wrapping."""
    return " ".join(text.split())


def invoke(*args: str, env: dict[str, str] | None = None, timeout: float | None = None,
           cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run a `tpulaunch` command line in this process (the same entry as the console script, minus
    the interpreter start): exit code, stdout and stderr as a subprocess would give them.
    (`timeout` is `run_cli`'s; in this process pytest's own timeout bounds the call.)"""
    import contextlib
    import io

    from tpulaunch import cli

    out, err = io.StringIO(), io.StringIO()
    saved, here = dict(os.environ), os.getcwd()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.invoke(list(args))
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["tpulaunch", *args], code, out.getvalue(), err.getvalue())

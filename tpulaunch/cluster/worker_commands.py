"""The commands that start, query and stop Ray on a TPU VM, as text for `gcloud ... ssh --command`.

Pure: building them touches nothing (`remote.py` runs them through `tpulaunch.gcloud`, `join.py` runs
`ray start` the same way on the VM itself). Every piece is quoted with `shlex.quote`; the token goes
over stdin, never on a command line; the worker programs (`worker_start`, `worker_query`,
`worker_stop`) are sent as `python -c` source, so a worker needs no tpulaunch.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
from pathlib import Path

from tpulaunch import gcloud
from tpulaunch.cluster import worker_query, worker_start, worker_stop
from tpulaunch.cluster.ownership import ID_ENV, MARKER

DEFAULT_PORT = 6379
DEFAULT_PYTHON = "python3"
JSON_MARK = worker_query.JSON_MARK
REMOTE_TOKEN = '"$HOME"/.tpulaunch/ray_token'  # a fixed fragment of ours: $HOME expands remotely
WRITE_TOKEN = f'umask 077 && mkdir -p "$HOME"/.tpulaunch && cat > {REMOTE_TOKEN}'
AUTH_ENV = f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={REMOTE_TOKEN} RAY_USAGE_STATS_ENABLED=0"
MAX_PARALLEL_SSH = 16


def cluster_key(project: str, zone: str, name: str) -> str:
    return hashlib.sha256(f"{project}/{zone}/{name}".encode()).hexdigest()[:10]


def default_temp_dir(project: str, zone: str, name: str) -> str:
    return f"/tmp/tpl-{cluster_key(project, zone, name)}"  # short: Ray socket paths must fit 107 bytes


def ray_start_words(
    *, python: str, node_ip: str, temp_dir: str, port: int, head: bool, head_ip: str | None = None,
    dashboard: bool = False,
) -> list[str]:
    """argv of `ray start` on one TPU VM (head on worker 0, join elsewhere): Ray's CLI with a patient
    wait for the raylet (`worker_start`)."""
    argv = [python, "-c", _source(worker_start), "start",
            "--node-ip-address", node_ip, "--temp-dir", temp_dir,
            "--dashboard-agent-listen-port", "0", "--min-worker-port", "0", "--max-worker-port", "0",
            "--disable-usage-stats"]
    if head:
        argv += ["--head", "--port", str(port), "--include-dashboard", "true" if dashboard else "false",
                 "--dashboard-host", "127.0.0.1"]
    else:
        argv += ["--address", f"{head_ip}:{port}"]
    return argv


def start_command(words: list[str], temp_dir: str, cluster_id: str) -> str:
    """Store the token sent on stdin owner-only, mark the temp dir, then `ray start` with token auth on
    and the cluster's id in the environment of every Ray process it starts."""
    marker = json.dumps({"cluster_id": cluster_id})
    mark = (f"mkdir -p {shlex.quote(temp_dir)} && printf %s {shlex.quote(marker)}"
            f" > {shlex.quote(temp_dir + '/' + MARKER)}")
    return (f"{WRITE_TOKEN} && {mark} && {AUTH_ENV} {gcloud.env_assignments({ID_ENV: cluster_id})}"
            f" {gcloud.shell_words(words)}")


def _source(module) -> str:  # a module of this package
    """A worker program's source, sent with `python -c` (the worker needs no tpulaunch)."""
    return Path(module.__file__).read_text()




def query_words(python: str, address: str) -> list[str]:
    """argv of `worker_query` asking the head at `address` which nodes it has."""
    return [python, "-c", _source(worker_query), address]


def query_command(python: str, head_ip: str, port: int) -> str:
    return f"{AUTH_ENV} {gcloud.shell_words(query_words(python, f'{head_ip}:{port}'))}"


def local_auth_env(token_path: str) -> dict[str, str]:
    """What `AUTH_ENV` sets on a worker, for Ray run on this machine with the token at `token_path`."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path, "RAY_USAGE_STATS_ENABLED": "0"}


def stop_command(python: str, temp_dir: str, cluster_id: str, keep_dir: bool = False) -> str:
    """`worker_stop` as a command for a worker; `keep_dir`: its temp dir (Ray's logs) is kept."""
    keep = ["--keep-dir"] if keep_dir else []
    return gcloud.shell_words([python, "-c", _source(worker_stop), temp_dir, cluster_id, *keep])


def marked_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith(JSON_MARK):
            try:
                return json.loads(line[len(JSON_MARK):])
            except ValueError:
                return None
    return None


def output_tail(proc: subprocess.CompletedProcess[str] | gcloud.SshResult, n: int = 3) -> str:
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip() and not ln.startswith(JSON_MARK)]
    return " | ".join(lines[-n:])


# gcloud runs an ssh that exits 255 again, up to 10 times (OpenSSH's own failures exit 255, so it cannot
# tell them from the remote command's), on the stdin the first run has read: a set-up script exiting 255
# would run again as an empty script and "succeed". Its 255 is reported as 254.
SETUP_255 = 254


def setup_stdin(setup: str) -> str:
    """What `bash -s` on a worker reads: the set-up script (`set -e`) in a subshell whose exit status
    255 leaves as SETUP_255, with a line saying so."""
    said = f"tpulaunch: the setup exited 255, reported as {SETUP_255} (gcloud runs an ssh that exits 255 again)"
    return (f"(\nset -e\n{setup}\n)\nrc=$?\nif [ \"$rc\" -eq 255 ]; then\n"
            f"  echo '{said}' >&2\n  exit {SETUP_255}\nfi\nexit \"$rc\"\n")

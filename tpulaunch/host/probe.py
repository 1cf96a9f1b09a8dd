"""What a host process would see, checked before it starts: `python -m tpulaunch.host.probe REQUEST`.

The host agent runs this with exactly the environment and working directory the run's host
process gets (so a `PYTHONPATH` that shadows a package on one host shows here as it would there)
and reads one JSON document from stdout. It imports no framework: versions come from the installed
distributions' metadata. The driver compares every host's answer (`run.preflight`).

REQUEST (JSON): {"script": path or null, "cache_dir": path or null, "log_dir": path or null,
"connect": [[host, port, label], ...], "bind": [[port, label], ...], "timeout_s": float}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys

PACKAGES = ("tpulaunch", "torch", "torch_xla", "jax", "jaxlib", "libtpu", "libtpu-nightly", "ray")
MAX_HASHED_FILES = 2000  # a working directory's Python files, hashed together (bounded)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version_from(meta_dir: str) -> str | None:
    """The `Version:` header of a dist-info's METADATA (an egg-info's PKG-INFO)."""
    for name in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(meta_dir, name), encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
                    if not line.strip():
                        break
        except OSError:
            continue
    return None


def versions(path: list[str] | None = None) -> dict[str, str]:
    """Installed versions of PACKAGES as `importlib.metadata.version` finds them (the first
    distribution on `sys.path`), read from each distribution's METADATA.

    Not importlib.metadata itself: its imports were half of this probe's start, paid once per
    host per run (32 emulated hosts share two cores here)."""
    out = {"python": sys.version.split()[0]}
    wanted = {_normal(n): n for n in PACKAGES}
    for entry in sys.path if path is None else path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in sorted(names):
            stem, dot, kind = name.rpartition(".")
            if not dot or kind not in ("dist-info", "egg-info"):
                continue
            parts = stem.split("-")  # name-version[-pyX.Y]; the name ends before the version's digit
            cut = next((i for i, part in enumerate(parts) if i and part[:1].isdigit()), len(parts))
            package = wanted.get(_normal("-".join(parts[:cut])))
            if package is None or package in out:
                continue
            version = _version_from(os.path.join(entry or ".", name))
            if version:
                out[package] = version
    return out


def file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def tree_sha256(root: str) -> tuple[str, int]:
    """One digest of every `*.py` under `root` (relative path and content), and how many files."""
    h = hashlib.sha256()
    n = 0
    skip = {".git", ".venv", "venv", "__pycache__", "runs", "node_modules", ".pytest_cache"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            if not name.endswith(".py") or n >= MAX_HASHED_FILES:
                continue
            full = os.path.join(dirpath, name)
            digest = file_sha256(full)
            if digest is not None:
                h.update(os.path.relpath(full, root).encode() + b"\0" + digest.encode())
                n += 1
    return h.hexdigest(), n


def connect(host: str, port: int, timeout_s: float) -> str:
    """`refused` (the host answered: the path is open, nothing listens yet), `open` (something
    listens already), `timeout` (no answer: a firewall drops it), or the error."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as e:
        return (e.strerror or type(e).__name__).lower()


def bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def free_bytes(path: str | None) -> int | None:
    """Free disk where `path` is (or would be: its nearest existing ancestor)."""
    if not path:
        return None
    p = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def probe(request: dict) -> dict:
    timeout = float(request.get("timeout_s") or 2.0)
    script = request.get("script")
    tree, files = tree_sha256(os.getcwd())
    return {
        "versions": versions(),
        "script_sha256": file_sha256(script) if script else None,
        "workdir_sha256": tree, "workdir_files": files,
        "connect": [[host, port, label, connect(host, int(port), timeout)]
                    for host, port, label in request.get("connect", [])],
        "bind": [[port, label, bindable(int(port))] for port, label in request.get("bind", [])],
        "disk_free": {"compile cache": free_bytes(request.get("cache_dir")),
                      "log dir": free_bytes(request.get("log_dir"))},
        "mem_available": mem_available(),
        "executable": sys.executable,
    }


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))

"""A cluster's Ray token on this machine: made once, kept owner-only under the state directory.

Every cluster tpulaunch brings up on real machines (TPU VMs over gcloud ssh, GKE) has a token of
its own, stored here (`ray_token-<key>`, mode 0600) and sent to the cluster over a channel that
keeps it off command lines (ssh's stdin, a Kubernetes Secret). The processes and the objects of the
cluster carry an id derived from it (`cluster_id_of`), which tells them apart from anything else
without revealing the token.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from tpulaunch.cluster.record import check_token_file, state_dir

PREFIX = "ray_token-"


def token_file(key: str) -> Path:
    return state_dir() / f"{PREFIX}{key}"


def ensure_token(key: str) -> tuple[Path, str, bool]:
    """(path, token, created_now): the cluster's token, stored owner-only (0600) under state_dir()."""
    p = token_file(key)
    if p.exists():
        return p, check_token_file(str(p), "the cluster's token file"), False
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    tok = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(tok)
    return p, tok, True


def store_token(key: str, token: str) -> Path:
    """Keep a token given by the cluster (a joined one's), owner-only; the path."""
    p = token_file(key)
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token.strip())
    os.replace(tmp, p)
    return p


def cluster_id_of(token: str) -> str:
    """The id a cluster's processes and temp dir carry: derived from its token (stable across
    `cluster up` runs that find the same token, and revealing nothing of it)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def is_ours(path: str) -> bool:
    """A token file tpulaunch made (`token_file`): in the state dir, named so, not a link. A record
    naming any other file never gets it deleted."""
    p = Path(path)
    return p.parent.resolve() == state_dir().resolve() and p.name.startswith(PREFIX) and not p.is_symlink()

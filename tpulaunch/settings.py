"""Values read from the environment (`TPULAUNCH_*_TIMEOUT` and the like), checked in one place.

A value that is set but unusable (not a number, NaN, infinite, not positive) is an error that names
the variable, never a silent default: a user who set it meant something.
"""

from __future__ import annotations

import math
import os

from tpulaunch.errors import TpulaunchError


def endpoint(name: str, value: str | None = None) -> str | None:
    """An endpoint override from variable `name` (or `value`): None when unset; else HOST[:PORT] or
    http(s)://HOST[:PORT], or an error naming the variable."""
    from urllib.parse import urlsplit

    raw = (value or os.environ.get(name, "")).strip()
    if not raw:
        return None
    try:
        parts = urlsplit(raw if "://" in raw else "https://" + raw)
        parts.port  # noqa: B018 - a port that is not a number raises here
        ok = bool(parts.hostname) and parts.scheme in ("http", "https") and len(raw) <= 2048
    except ValueError:
        ok = False
    if not ok:
        raise TpulaunchError(f"{name}={raw[:80]!r} is not an endpoint",
                             "give HOST[:PORT] or http(s)://HOST[:PORT], or unset it for Google's")
    return raw.rstrip("/")


def check_environment() -> None:
    """What every command reads from the environment, checked before it starts (one line, exit 2)."""
    endpoint("TPULAUNCH_TPU_API_ENDPOINT")


# Read on the hosts (from the host's environment: the node's, or --env): checked on the driver too.
HOST_SECONDS = {"TPULAUNCH_DIST_TIMEOUT": 300.0, "TPULAUNCH_JAX_INIT_TIMEOUT": 300.0,
                "TPULAUNCH_JAX_SHUTDOWN_TIMEOUT": 30.0,
                "TPULAUNCH_EXIT_HANDLERS_TIMEOUT": 10.0}  # a failed script's atexit handlers and threads


def host_seconds(name: str) -> float:
    """A host's setting of HOST_SECONDS, from its environment (the driver has checked it already)."""
    return seconds(name, HOST_SECONDS[name])


def seconds(name: str, default: float, raw: str | None = None) -> float:
    """Seconds from environment variable `name` (or `raw`, its value from elsewhere, e.g. --env),
    unset or empty: `default`; else finite and above 0, or an error naming the variable."""
    raw = (os.environ.get(name, "") if raw is None else raw).strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise TpulaunchError(f"{name}='{raw}' is not a number of seconds", f"set it to e.g. {default:g}") from None
    if not math.isfinite(value) or value <= 0:
        raise TpulaunchError(f"{name}={raw} is not a positive number of seconds", f"set it to e.g. {default:g}")
    return value

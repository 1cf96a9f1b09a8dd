"""Values read from the environment (`TPULAUNCH_*_TIMEOUT` and the like), checked in one place.

A value that is set but unusable (not a number, NaN, infinite, not positive) is an error that names
the variable, never a silent default: a user who set it meant something.
"""

from __future__ import annotations

import math
import os

from tpulaunch.errors import TpulaunchError


# Read on the hosts (from the host's environment: the node's, or --env): checked on the driver too.
HOST_SECONDS = {"TPULAUNCH_DIST_TIMEOUT": 300.0, "TPULAUNCH_JAX_INIT_TIMEOUT": 300.0,
                "TPULAUNCH_JAX_SHUTDOWN_TIMEOUT": 30.0}


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

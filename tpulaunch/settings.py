"""Values read from the environment (`TPULAUNCH_*_TIMEOUT` and the like), checked in one place.

A value that is set but unusable (not a number, NaN, infinite, not positive) is an error that names
the variable, never a silent default: a user who set it meant something.
"""

from __future__ import annotations

import math
import os

from tpulaunch.errors import TpulaunchError


def seconds(name: str, default: float) -> float:
    """Seconds from environment variable `name` (unset or empty: `default`), finite and above 0."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise TpulaunchError(f"{name}='{raw}' is not a number of seconds", f"set it to e.g. {default:g}") from None
    if not math.isfinite(value) or value <= 0:
        raise TpulaunchError(f"{name}={raw} is not a positive number of seconds", f"set it to e.g. {default:g}")
    return value

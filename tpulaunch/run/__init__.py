"""What `tpulaunch run` and `tpulaunch exec` do, as a library.

* `prepare`: the request (`LaunchRequest`) checked once and, with what its cluster holds, the
  `LaunchPlan` and its `Supervision`, connecting nowhere (all `--dry-run` needs); `find_cluster`
  says which cluster it goes to; `runner` whether the run is supervised here or on the head;
* `launch`: get a Ray cluster (start an emulated one when none is given; `Connection` is the one
  connection to an existing one), run the attempts (`loop`), clean up;
* `execute`: one attempt: gang-schedule one host agent per TPU host (`fleet`), supervise, fail fast;
* `watch`, `policy` and `hang`: the decisions, pure; `recovery/`: what happens between attempts;
* `record/`: the run's timeline and what is read from it; `summary`: what a run produced.

The names below are loaded on first use: importing `tpulaunch.run.status` (as a script's
`import tpulaunch` does, through the client) must not load the whole launcher.
"""

from __future__ import annotations

import importlib
from typing import Any

# (the functions named as their modules, `prepare`, `launch` and `execute`, are imported from
# those modules: once a submodule is loaded its name in this package is the module)
_WHERE = {
    "Limits": "execute", "Sink": "execute", "Connection": "launch",
    "LaunchRequest": "prepare", "Prepared": "prepare", "Target": "prepare", "check_script": "prepare",
    "client_env": "prepare", "find_cluster": "prepare", "head_python": "prepare", "is_local": "prepare",
    "shipped_workdir": "prepare",
    "Attempt": "summary", "HostResult": "summary", "Outcome": "summary", "RunSummary": "summary",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'tpulaunch.run' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tpulaunch.run.{_WHERE[name]}"), name)

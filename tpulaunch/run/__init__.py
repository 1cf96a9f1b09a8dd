"""What `tpulaunch run` and `tpulaunch exec` do, as a library.

* `prepare`: the request (`LaunchRequest`) and what its cluster holds to the `LaunchPlan`,
  connecting nowhere (all `--dry-run` needs); `find_cluster` says which cluster it goes to;
* `launch`: get a Ray cluster (start an emulated one when none is given; `Connection` is the one
  connection to an existing one), run attempts as `policy` decides, clean up;
* `execute`: one attempt: gang-schedule one host agent per TPU host (`fleet`), supervise, fail fast;
* `watch` and `policy`: the decisions, pure; `summary`: what a run produced; `paths`: where it went.
"""

from tpulaunch.run.execute import Limits, Sink, execute
from tpulaunch.run.launch import Connection, launch
from tpulaunch.run.prepare import (LaunchRequest, Prepared, Target, check_script, client_env, find_cluster, head_python,
                                   is_local, prepare, shipped_workdir)
from tpulaunch.run.summary import Attempt, HostResult, Outcome, RunSummary

__all__ = ["Attempt", "Connection", "HostResult", "LaunchRequest", "Limits", "Outcome", "Prepared", "RunSummary",
           "Sink", "Target", "check_script", "client_env", "execute", "find_cluster", "head_python", "is_local", "launch", "prepare",
           "shipped_workdir"]

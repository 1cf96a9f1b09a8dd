"""What `tpulaunch run` and `tpulaunch exec` do, as a library: prepare, launch, execute.

* `prepare`: flags (`LaunchRequest`) to the `LaunchPlan`, starting nothing (all `--dry-run` needs);
* `launch`: get a Ray cluster (start an emulated one when none is given), run attempts of the
  whole slice within the restart and preemption budgets, clean up;
* `execute`: one attempt: gang-schedule one host agent per TPU host, stream, fail fast;
* `summary`: what a run produced (`RunSummary`, `Attempt`, `HostResult`) and who failed first.
"""

from tpulaunch.run.execute import Limits, Sink, execute
from tpulaunch.run.launch import launch
from tpulaunch.run.prepare import LaunchRequest, Prepared, prepare
from tpulaunch.run.summary import Attempt, HostResult, RunSummary

__all__ = ["Attempt", "HostResult", "LaunchRequest", "Limits", "Prepared", "RunSummary", "Sink", "execute", "launch",
           "prepare"]

"""What `tpulaunch run` and `tpulaunch exec` do, as a library: prepare, launch, execute.

* `prepare`: flags (`LaunchRequest`) to the `LaunchPlan`, starting nothing (all `--dry-run` needs);
* `launch`: get a Ray cluster (start an emulated one when none is given), execute, clean up;
* `execute`: gang-schedule one host agent per TPU host, stream, fail fast, summarize.
"""

from tpulaunch.run.execute import HostResult, RunSummary, Sink, execute
from tpulaunch.run.launch import launch
from tpulaunch.run.prepare import LaunchRequest, Prepared, prepare

__all__ = ["HostResult", "LaunchRequest", "Prepared", "RunSummary", "Sink", "execute", "launch", "prepare"]

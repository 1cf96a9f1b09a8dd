"""The environment a host process starts from, and where its files go: the node's, not the agent's.

The agent is a Ray worker, and Ray describes that worker in its environment (its job, its raylet,
its niceness, its share of the host's chips); a host process must see the node as a script run
there by hand would (`host_env`), plus the plan's per-host contract (`plan.env.split_env`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping

from tpulaunch import procfs
from tpulaunch.plan.contract import HostState
from tpulaunch.plan.env import PLAN_MULTISLICE_ENV, split_env, xla_flags

# What Ray gives its worker processes (this agent is one) that describes that worker, not the host.
NICENESS_ENV = "RAY_worker_niceness"
_DROP = ("RAY_ADDRESS", "RAY_JOB_ID", "RAY_RAYLET_PID", "RAY_CLIENT_MODE", "RAY_LD_PRELOAD_ON_WORKERS", NICENESS_ENV)
# The chips and host grid, which Ray rewrites in a worker holding part of a host (`TPUAcceleratorManager`):
# a host process gets the node's own values, where the node has them (GKE's TPU device plugin sets them
# with TPU_SKIP_MDS_QUERY, and libtpu then reads the grid from them alone), never a worker's.
NODE_TPU_ENV = ("TPU_VISIBLE_CHIPS", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS")
_NOT_INHERITED = frozenset(_DROP + NODE_TPU_ENV + PLAN_MULTISLICE_ENV)  # what host_env never takes from this agent


def run_files_dir() -> str:
    """Where a run's files on this host go (its state, heartbeat and timings): this Ray node's
    session directory, which goes with the cluster's temp dir at `cluster down`. An agent killed
    before it could remove them (SIGKILL, a lost node) leaves nothing behind in /tmp."""
    import ray._private.worker as worker

    node = worker._global_node  # Ray has no public accessor for the session dir
    if node is None:  # not in a Ray worker (a unit test's agent)
        return tempfile.gettempdir()
    path = os.path.join(node.get_session_dir_path(), "tpulaunch")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def package_path() -> str:
    """A directory holding only `tpulaunch` (a link to this package): on the PYTHONPATH of a host
    process in another interpreter (`--python`), it finds the bootstrap and nothing else of ours."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256(package.encode()).hexdigest()[:12]
    root = os.path.join(tempfile.gettempdir(), f"tpulaunch-pkg-{os.getuid()}-{digest}")
    link = os.path.join(root, "tpulaunch")
    if not os.path.islink(link):
        os.makedirs(root, mode=0o700, exist_ok=True)
        tmp = f"{link}.{os.getpid()}"
        os.symlink(package, tmp)
        os.replace(tmp, link)
    return root


def spare_env(state: HostState) -> dict[str, str]:
    """The environment of a spare that can take `state`'s run: the node's, and what stays from
    run to run in the plan's (`split_env`); what each run sets is handed over with the run."""
    return start_env(state)[0]


def start_env(state: HostState) -> tuple[dict[str, str], dict[str, str]]:
    """(what stays from run to run: the node's environment under the plan's; what this run and
    attempt set). A host process starts with both, a spare with the first."""
    static, per_run = split_env(state)
    return layered(host_env(), static, state), per_run


def layered(node: Mapping[str, str], static: Mapping[str, str], state: HostState) -> dict[str, str]:
    """The node's environment under the plan's `static` part for `state`'s host. Pure.

    XLA_FLAGS is the one both may set that must not simply be replaced: on an emulated host whose
    user gave none, the node's own stay before the plan's (`plan.env.xla_flags`); the plan's are the
    emulation's CPU device count, or what a Ray Train config's `env` set in their place. A user's
    `--env XLA_FLAGS` is in `static` already, after the emulation's (`plan.env.split_env`).
    """
    env = {**node, **static}
    job = state.job
    if job.emulated and "XLA_FLAGS" in job.emulation_env and "XLA_FLAGS" not in job.user_env:
        flags = xla_flags(node.get("XLA_FLAGS"), static.get("XLA_FLAGS"), None)
        if flags is not None:
            env["XLA_FLAGS"] = flags
    return env


def host_env() -> dict[str, str]:
    """The environment a host process starts from: the node's, as a script run there by hand sees it.

    Not this agent's: Ray sets OMP_NUM_THREADS to the actor's CPU count (1) in its workers unless
    the node set it, and a script inheriting that runs torch's CPU ops on one thread (data loading,
    checkpoints) on a host with hundreds of cores. It is kept only when the node's raylet has it.
    The TPU grid is the node's too (NODE_TPU_ENV); the slices a run spans are the plan's alone
    (PLAN_MULTISLICE_ENV).
    """
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    node = _raylet_env()
    if node is not None:
        env.update({k: node[k] for k in NODE_TPU_ENV if k in node})
    if "OMP_NUM_THREADS" in env and node is not None and "OMP_NUM_THREADS" not in node:
        del env["OMP_NUM_THREADS"]
    return env


def _raylet_env() -> dict[str, str] | None:
    """The raylet's environment (what `ray start` on this node was given); None if unreadable."""
    try:
        return procfs.Process(int(os.environ["RAY_RAYLET_PID"])).env()
    except (KeyError, ValueError):
        return None

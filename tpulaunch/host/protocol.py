"""What the driver and a host agent say to each other: frozen data, no Ray, no processes.

The agent (`agent.py`) answers with these; the driver's supervision reads their fields. A
simulated host (the scale harness) answers with the same types, so the supervision code cannot
tell the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostOptions:
    """How an agent runs this run's host process (the same for every host of a run)."""

    cwd: str | None = None  # where the script runs: the driver's directory on emulated hosts
    check_tpu: bool = False  # first make sure no leftover process holds the chips (real TPU hosts)
    kill_stale: bool = False  # ... and clear them if one does
    watch_preemption: bool = False  # ask the GCE metadata server for preemption notices
    metadata_host: str | None = None  # that server (None: the default one)
    preemption_grace_s: float = 30.0  # a preempted script's time between SIGTERM and SIGKILL
    keep_children: bool = False  # leave processes the script started running after it exits


@dataclass(frozen=True)
class Started:
    """The agent's answer to `start`."""

    pid: int  # the host process, or -1 when it could not start (the next poll says why)
    prewarmed: bool  # a spare process with the framework imported took the run
    why: str  # why a spare did (not) take it, or why nothing started


@dataclass(frozen=True)
class PollReply:
    """New output of a host and, once every line is out, its end."""

    lines: tuple[tuple[str, str], ...]  # (stream, text)
    code: int | None  # exit code (128+N for signal N) once the host process ended and its output is drained
    wall_s: float  # seconds since the host process started (until it ended)
    ended: float | None  # time.time() when it ended (the host's clock)
    activity: float  # time.time() of the last sign of life: an output line or tpulaunch.heartbeat()
    preempted: str | None = None  # why, when this host is going away (a notice, SIGTERM to the agent)
    phases: dict = field(default_factory=dict)  # import_s, boot_s, mesh_s (from the bootstrap), at the end
    step: int | None = None  # the last `tpulaunch.heartbeat(step=N)`, if the script reports steps
    step_age: float = 0.0  # seconds since that step was reported (the host's clock, a difference)
    first_step: tuple[int, float] | None = None  # this host process's first reported step: (step, seconds ago)
    # the last `heartbeat(step=N, checkpoint=True)`: (N, save s, s ago)
    checkpoint: tuple[int, float, float] | None = None


@dataclass(frozen=True)
class AgentInfo:
    """Where an agent lives: node labels decide its process index, not scheduling order."""

    node_id: str
    node_ip: str
    hostname: str
    labels: dict
    pid: int
    spares: tuple[str, ...] = ()
    run: HostRun | None = None  # the run this agent's host process belongs to, while it runs


@dataclass(frozen=True)
class HostRun:
    """Which run an agent is serving (`tpulaunch stacks` finds a run's hosts by it)."""

    run_id: str
    attempt: int
    process_index: int
    hosts: int  # how many hosts the run has
    log_dir: str  # the run's directory on the driver's machine


@dataclass(frozen=True)
class PreflightRequest:
    """What an agent checks before its host's script may start (`run.preflight` builds it)."""

    connect: tuple[tuple[str, int, str], ...] = ()  # (host, port, what): ports the run will use on other hosts
    bind: tuple[tuple[int, str], ...] = ()  # (port, what): ports this host will listen on (process 0)
    cache_dir: str | None = None
    log_dir: str | None = None
    timeout_s: float = 2.0


@dataclass(frozen=True)
class PreflightReport:
    """One host's answers. `probe` is what `python -m tpulaunch.host.probe` saw in the run's own
    environment; the rest is the agent's (its node's identity, the TPU)."""

    process_index: int
    probe: dict  # versions, script/workdir digests, connect/bind results, disk and memory
    node_worker_id: str | None  # TPU_WORKER_ID in the node's own environment (GKE, emulation)
    label_worker_id: str | None  # ray.io/tpu-worker-id of the node the agent runs on
    label_slice: str | None
    metadata_worker_id: str | None = None  # agent-worker-number from the GCE metadata server (TPU VMs)
    tpu_holders: tuple[str, ...] = ()  # processes holding the TPU or the libtpu lockfile
    stale_lockfile: str | None = None  # the libtpu lockfile, left by a process that is gone
    error: str | None = None  # the probe could not run

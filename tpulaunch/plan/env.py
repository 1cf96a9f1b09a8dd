"""The environment a host process sees, derived from its `HostState` by one pure function.

Nothing else in tpulaunch writes these variables: a restart or a spare process changes fields of
the state, and the environment follows. `split_env` says which part stays from run to run on a
host (a spare process started with it can take any run with the same) and which part each run or
attempt changes (handed to the spare when it takes the run).

What is pushed, and for whom:

* `TPULAUNCH_*`: tpulaunch's own context (`tpulaunch.context()` reads the pickled state instead);
* `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_*`: torch.distributed's `env://`;
* `TPU_WORKER_ID`, `TPU_WORKER_HOSTNAMES`, `TPU_ACCELERATOR_TYPE`, `TPU_NAME`: libtpu, torch_xla
  and JAX's GKE cluster detection; without a metadata server also `TPU_SKIP_MDS_QUERY`,
  `TPU_TOPOLOGY` and the bounds (the fallback torch_xla and libtpu honour);
* `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` for JAX;
* `MEGASCALE_*` on multislice;
* on emulated hosts the framework adapter's CPU settings (`Job.emulation_env`);
* the user's `--env`, last, over everything (its `XLA_FLAGS` after the emulation's own).

A user's variable that a framework's import or the interpreter's start may read (`read_at_import`:
`XLA_*`, `JAX_*`, `PYTHONPATH`, ...) is part of what stays from run to run: a spare imported
without it would not be the process a fresh start makes. Any other (a run name, a checkpoint
path, an API key) is read by the script after the fork, so it is set per run, and a run that
changes it still takes the warm host's spare.
"""

from __future__ import annotations

from tpulaunch.plan.contract import HostState

# Prefixes of the variables a framework import, a native library's load or the interpreter's start
# may read (compared upper-case). Generous on purpose: a variable wrongly here only costs a warm
# start; one wrongly missing would make a forked host differ from a fresh one.
IMPORT_TIME_PREFIXES = (
    "PYTHON", "PATH", "HOME", "TMPDIR", "LANG", "LC_", "TZ", "LD_", "MALLOC", "TCMALLOC", "GLIBC",
    "XLA", "JAX", "TPU", "PJRT", "LIBTPU", "MEGASCALE", "CLOUD_TPU", "TORCH", "PYTORCH", "CUDA", "NCCL",
    "OMP", "KMP", "MKL", "OPENBLAS", "GOTO", "BLIS", "NUMEXPR", "NUMPY", "NPY", "TF_", "GLOG", "ABSL",
    "GRPC", "PROTOCOL_BUFFERS", "RAY",
)


def read_at_import(name: str) -> bool:
    """Whether a user's variable may change what importing the framework does (see the module doc)."""
    upper = name.upper()
    return upper.startswith(IMPORT_TIME_PREFIXES) and not upper.startswith("TPULAUNCH_")  # ours: read at run time


# The slices a run spans, which the plan sets whenever there are two or more: a host process never keeps
# a value of these from its node (a multislice pod's may name other slices, or more of them than this
# attempt has after a shrink, and libtpu would wait for slices that never join: Ray's ray#62893).
PLAN_MULTISLICE_ENV = ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_PORT")

# libtpu's own hang flags, which tpulaunch sets on real multislice hosts: a program a peer never
# joins aborts (its HANG_DETECTED digest in the host's log, which stops the attempt and is triaged)
# instead of waiting for ever. Put before the host's own LIBTPU_INIT_ARGS (the node's, or --env's),
# where absl takes the last of a flag given twice: the user's word wins (`--megascale_abort_on_hangs=false`).
LIBTPU_OURS_ENV = "TPULAUNCH_LIBTPU_INIT_ARGS"


# libtpu's threshold is the stall timeout and this much more: tpulaunch's own stall comes first, while
# every host process is alive for its stacks (libtpu aborts them as it reports); libtpu's report is
# the backstop where the stall is not seen (a thread of the script printing while the program hangs)
LIBTPU_HANG_MARGIN_S = 60


def megascale_hang_flags(stall_s: float | None) -> str:
    flags = "--megascale_abort_on_hangs=true"
    return flags + (f" --megascale_graph_hang_threshold={max(1, int(stall_s)) + LIBTPU_HANG_MARGIN_S}s"
                    if stall_s else "")


def libtpu_args(ours: str | None, theirs: str | None) -> str | None:
    """LIBTPU_INIT_ARGS with tpulaunch's flags first and the host's own after them (theirs win). Pure."""
    parts = [p for p in ((ours or "").strip(), (theirs or "").strip()) if p]
    return " ".join(parts) or None


def xla_flags(node: str | None, emulation: str | None, user: str | None) -> str | None:
    """XLA_FLAGS from the three places that may set them, in the order XLA reads them (the last of a
    flag given twice wins). A user's `--env XLA_FLAGS` sets them as on a real host: the node's go, and
    the emulation's CPU device count stays first. Without it the node's own (an opt level or a dump dir
    the shell exported, as on the real host) stay, before the emulation's. None: nobody set them."""
    parts = [emulation, user] if user is not None else [node, emulation]
    given = [p for p in parts if p is not None]
    return " ".join(p for p in given if p) if given else None


def split_env(state: HostState) -> tuple[dict[str, str], dict[str, str]]:
    """(what stays from run to run on this host, what this run and attempt set). Disjoint; the
    user's `--env` wins over both, in the first part where it may be read at import, else in the
    second."""
    job, slot, ends = state.job, state.slot, state.endpoints
    topo = job.mesh.topology
    n = str(state.num_processes)
    proc = str(slot.process_index)
    static: dict[str, str] = {
        "TPULAUNCH_PROCESS_INDEX": proc,
        "TPULAUNCH_NUM_PROCESSES": n,
        "TPULAUNCH_EMULATED": "1" if job.emulated else "0",
        "TPULAUNCH_FRAMEWORK": str(job.framework),
        "MASTER_ADDR": ends.host,
        "RANK": proc,
        "WORLD_SIZE": n,
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "TPU_WORKER_ID": str(slot.worker_id),
        "TPU_WORKER_HOSTNAMES": ",".join(slot.slice_ips),
        "TPU_ACCELERATOR_TYPE": topo.accelerator_type,
        "TPU_NAME": slot.slice_name,
        "PJRT_DEVICE": "TPU",
        "PYTHONUNBUFFERED": "1",
    }
    per_run: dict[str, str] = {
        "TPULAUNCH_RUN_ID": job.run_id,
        "TPULAUNCH_RESTART_COUNT": str(state.attempt),
        "TPULAUNCH_COORDINATOR_ADDRESS": ends.coordinator_address,
        "TPULAUNCH_GROUP_ADDRESS": ends.group_address,
        "MASTER_PORT": str(ends.master_port),
    }
    if not job.metadata_server:
        static.update({
            "TPU_SKIP_MDS_QUERY": "1",
            "TPU_TOPOLOGY": topo.topology,
            "TPU_HOST_BOUNDS": topo.bounds_str(topo.host_bounds),
            "TPU_CHIPS_PER_HOST_BOUNDS": topo.bounds_str(topo.chips_per_host_bounds),
        })
    if ends.jax_address is not None:
        per_run["JAX_COORDINATOR_ADDRESS"] = ends.jax_address
        static.update({"JAX_NUM_PROCESSES": n, "JAX_PROCESS_ID": proc})
    if state.num_slices > 1 and not job.emulated:  # per run: --stall-timeout is the run's (libtpu reads it at boot)
        per_run[LIBTPU_OURS_ENV] = megascale_hang_flags(job.hang_s)
    if state.num_slices > 1:
        static.update({
            "MEGASCALE_COORDINATOR_ADDRESS": ends.host,
            "MEGASCALE_PORT": str(ends.megascale_port),
            "MEGASCALE_NUM_SLICES": str(state.num_slices),
            "MEGASCALE_SLICE_ID": str(slot.slice_index),
        })
    if job.emulated:
        static.update(job.emulation_env)
        if ends.emulation_port is not None:
            per_run["TPULAUNCH_EMULATION_PORT"] = str(ends.emulation_port)
    at_import = {k: v for k, v in job.user_env.items() if read_at_import(k)}
    static.update(at_import)
    flags = xla_flags(None, job.emulation_env.get("XLA_FLAGS") if job.emulated else None, job.user_env.get("XLA_FLAGS"))
    if flags is not None:
        static["XLA_FLAGS"] = flags
    for key, value in job.user_env.items():
        if key not in at_import:
            static.pop(key, None)
            per_run[key] = value
        else:
            per_run.pop(key, None)
    return static, per_run


def host_env(state: HostState) -> dict[str, str]:
    """Every variable tpulaunch sets in the host process of `state`."""
    static, per_run = split_env(state)
    return {**static, **per_run}

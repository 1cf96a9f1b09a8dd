"""Every environment variable tpulaunch reads or sets, as documentation data.

Nothing reads this module at run time: the modules that read a variable name it themselves. It
exists so the docs' variables page is generated from one list (docs/_ext/tpulaunch_docs.py), and
`tests/unit/test_docs.py` fails when a `TPULAUNCH_*` name in the code is missing here, or when one
listed here is named nowhere in the code.
"""

from __future__ import annotations

from typing import NamedTuple


class EnvVar(NamedTuple):
    """One variable: its name, who sets and reads it, and what it does (default first)."""

    name: str
    who: str
    meaning: str


# Who: "you" are the person or CI job running tpulaunch; "the driver" is the `tpulaunch` command
# (or `tpulaunch.Client`) on your machine; "each host" is a TPU host's process (its node's
# environment, or `--env NAME=VALUE`).
YOU_DRIVER = "you; read by the driver"
YOU_HOSTS = "you (node environment or --env); read on each host, checked on the driver first"
TPULAUNCH_SETS = "tpulaunch, for each host process"

VARIABLES: tuple[EnvVar, ...] = (
    # -- read on the driver: discovery and cluster access --------------------------------------------
    EnvVar("TPULAUNCH_TPU_API_ENDPOINT", YOU_DRIVER,
           "Default ``tpu.googleapis.com``. The Cloud TPU API endpoint, e.g. ``http://127.0.0.1:8080`` for a"
           " local fake. A ``http://localhost`` / ``127.0.0.1`` / ``[::1]`` URL is called without"
           " credentials; any other endpoint uses Application Default Credentials. Checked before every"
           " command (one line, exit 2, if it is no endpoint)."),
    EnvVar("TPULAUNCH_API_TIMEOUT", YOU_DRIVER,
           "Default ``10``. Seconds one Cloud TPU API operation may take in total (all pages, and the"
           " listing a 404 does), retries off. ``--timeout`` overrides it; a value that is not a number"
           " of seconds is exit 2."),
    EnvVar("TPULAUNCH_METADATA_HOST", YOU_DRIVER + " and each host",
           "No default (``metadata.google.internal`` on a TPU VM). The GCE metadata server's"
           " ``host[:port]``. Setting it also means \"this is a TPU VM\"; given to a run with ``--env``,"
           " the hosts watch that server for preemption notices, emulated too."),
    EnvVar("GCE_METADATA_HOST", YOU_DRIVER,
           "No default. Honoured after ``TPULAUNCH_METADATA_HOST`` (google-auth's name for the same thing)."),
    EnvVar("TPULAUNCH_METADATA_TIMEOUT", YOU_DRIVER, "Default ``2``. Seconds per metadata request."),
    EnvVar("TPULAUNCH_GCLOUD_TIMEOUT", YOU_DRIVER,
           "Default ``5``. Seconds ``gcloud config get-value`` may take before it is ignored."),
    EnvVar("TPULAUNCH_KUBE_TIMEOUT", YOU_DRIVER,
           "Default ``15``. Seconds one Kubernetes API call may take (GKE), retries off."),
    EnvVar("KUBECONFIG", YOU_DRIVER,
           "Default ``~/.kube/config``. The kubeconfig ``--gke`` commands read, as kubectl does"
           " (``--kubeconfig`` wins; in a pod with none, its service account)."),
    EnvVar("GOOGLE_CLOUD_PROJECT", YOU_DRIVER,
           "No default. The project, after ``--project`` and before ``CLOUDSDK_CORE_PROJECT`` and gcloud's"
           " configuration."),
    EnvVar("CLOUDSDK_CORE_PROJECT", YOU_DRIVER,
           "No default. The project, after ``GOOGLE_CLOUD_PROJECT`` and before gcloud's configuration."),
    EnvVar("CLOUDSDK_COMPUTE_ZONE", YOU_DRIVER,
           "No default. The zone, after ``--zone`` and before gcloud's configuration."),
    EnvVar("TPULAUNCH_CONNECT_TIMEOUT", YOU_DRIVER,
           "Default ``15``. Seconds to reach a Ray cluster (``ray.init``); past it, exit 5. A value that is"
           " not a number of seconds is exit 2."),
    EnvVar("TPULAUNCH_AUTOSCALER_DECLINE_TIMEOUT", YOU_DRIVER,
           "Default ``120``. ``cluster up --gke --autoscaler`` with no node pool of the shape in sight: seconds"
           " the cluster autoscaler's word that no node could ever take a slice's pods must stand (no scale-up"
           " meanwhile) before the bring-up ends, exit 3, instead of waiting out ``--timeout``."),
    EnvVar("TPULAUNCH_HOME", YOU_DRIVER,
           "Default ``~/.cache/tpulaunch``. Where tpulaunch keeps cluster records (``cluster.json``), tokens,"
           " the driver's log of Ray's native output and ``failed-starts/``. A parallel CI job gets its own"
           " clusters by setting its own; ``cluster down --force`` leaves another home's clusters alone."
           " Set for a detached run's supervisor by tpulaunch."),
    EnvVar("TPULAUNCH_DEBUG", YOU_DRIVER,
           "Unset. ``1`` is ``--debug``: tracebacks and debug logs, and Ray's native stderr stays on the"
           " terminal instead of the driver's log."),
    # -- read on the hosts ---------------------------------------------------------------------------
    EnvVar("TPULAUNCH_DIST_TIMEOUT", YOU_HOSTS,
           "Default ``300``. Seconds a collective of tpulaunch's gloo group (and JAX's initialization, unless"
           " the next is set) waits for the other hosts; also how long torch_xla's process 0 waits for the"
           " others to leave first."),
    EnvVar("TPULAUNCH_JAX_INIT_TIMEOUT", YOU_HOSTS,
           "Default ``300`` (or ``TPULAUNCH_DIST_TIMEOUT``). Seconds ``jax.distributed.initialize`` waits for"
           " every host."),
    EnvVar("TPULAUNCH_JAX_SHUTDOWN_TIMEOUT", YOU_HOSTS,
           "Default ``30``. Seconds a host's ``jax.distributed.shutdown()`` (a barrier) may take after a"
           " clean script."),
    EnvVar("TPULAUNCH_EXIT_HANDLERS_TIMEOUT", YOU_HOSTS,
           "Default ``10``. Seconds a failed script's ``atexit`` handlers and non-daemon threads get before"
           " its host leaves."),
    # -- set by tpulaunch: the per-host contract, for your script to read ----------------------------
    EnvVar("TPULAUNCH_PROCESS_INDEX", TPULAUNCH_SETS,
           "This host's process index: its TPU worker id (slice-major on multislice), as"
           " ``tpulaunch.context().process_index``."),
    EnvVar("TPULAUNCH_NUM_PROCESSES", TPULAUNCH_SETS, "Host processes in the run (one per TPU host)."),
    EnvVar("TPULAUNCH_EMULATED", TPULAUNCH_SETS, "``1`` on an emulated slice, ``0`` on a TPU."),
    EnvVar("TPULAUNCH_FRAMEWORK", TPULAUNCH_SETS,
           "The framework booted: ``torch_xla``, ``jax``, ``torch_tpu`` or ``none``."),
    EnvVar("TPULAUNCH_RUN_ID", TPULAUNCH_SETS,
           "The run's id; also how tpulaunch finds a run's host processes on a machine."),
    EnvVar("TPULAUNCH_RESTART_COUNT", TPULAUNCH_SETS,
           "The attempt: ``0``, ``1``, ... after relaunches (``tpulaunch.context().restart_count``). Resume"
           " from your checkpoint when it is above 0."),
    EnvVar("TPULAUNCH_COORDINATOR_ADDRESS", TPULAUNCH_SETS, "``HOST:PORT`` of process 0, where the hosts meet."),
    EnvVar("TPULAUNCH_GROUP_ADDRESS", TPULAUNCH_SETS,
           "``HOST:PORT`` of the store of tpulaunch's own gloo group: a port of its own, so a script's own"
           " process group on ``MASTER_PORT`` never meets a listener that is closing."),
    EnvVar("TPULAUNCH_EMULATION_PORT", TPULAUNCH_SETS,
           "Emulated torch_xla hosts only: the port of the store they share per-host input through."),
    EnvVar("TPULAUNCH_LIBTPU_INIT_ARGS", TPULAUNCH_SETS,
           "Real multislice hosts only: libtpu's hang flags (``--megascale_abort_on_hangs=true"
           " --megascale_graph_hang_threshold=<--stall-timeout + 60>s``), put before the host's own"
           " ``LIBTPU_INIT_ARGS`` at boot so that the host's own flags win."),
    # -- set by tpulaunch: its own bookkeeping --------------------------------------------------------
    EnvVar("TPULAUNCH_CLUSTER_ID", "tpulaunch, for every process of a cluster it starts",
           "The cluster's id (random, or a hash of the token on real slices): what ``cluster down`` and"
           " ``--kill-stale`` stop a process by, never a substring of some argument."),
    EnvVar("TPULAUNCH_STATE", "the host agent, for the host process",
           "The file holding the host's pickled contract (its ``HostState``) for the run."),
    EnvVar("TPULAUNCH_HEARTBEAT_FILE", "the host agent, for the host process",
           "The file ``tpulaunch.heartbeat()`` writes; the agent watches it (stall detection, step rates)."),
    EnvVar("TPULAUNCH_TIMINGS_FILE", "the host agent, for the host process",
           "Where the bootstrap writes its phases (import, boot, mesh) as JSON."),
    EnvVar("TPULAUNCH_PY_STDIO_FDS", "the host agent, for the bootstrap",
           "``OUT,ERR``: the file descriptors the bootstrap gives ``sys.stdout`` and ``sys.stderr``."),
    EnvVar("TPULAUNCH_SPARE_FD", "the host agent, for a warm spare",
           "The spare process's end of the socket pair the agent asks it to fork a run's host process over."),
    EnvVar("TPULAUNCH_GKE_CLUSTER", "tpulaunch, for a detached run's supervisor on a GKE head",
           "The GKE cluster (name, namespace, worker group, as JSON) whose pods and nodes the supervisor"
           " reads through the in-cluster API (preemptions)."),
)

"""Options several commands share, defined once (each command module uses what it needs)."""

from __future__ import annotations

import typer

JSON = typer.Option(False, "--json", help="Print one JSON document on stdout.")

# -- which slice --------------------------------------------------------------------------------
TOPOLOGY = typer.Option(None, "--topology", "-t", help="Slice shape: 2x8 (2D) or 2x2x4 (3D).")
ACCELERATOR = typer.Option(
    None, "--accelerator", "-a",
    help="Generation (v2 v3 v4 v5e v5p v6e v7x) or accelerator type (v4-32). A 2D shape alone means v6e.",
)
CHIPS_PER_HOST = typer.Option(
    None, "--chips-per-host", help="Override chips per VM (4 for a two-VM v5e/v6e 2x4, as on GKE)."
)
NUM_SLICES = typer.Option(None, "--num-slices", help="Number of identical slices (multislice).")
TPU = typer.Option(None, "--tpu", help="Cloud TPU node name: discover the slice through the Cloud TPU API.")
QUEUED_RESOURCE = typer.Option(None, "--queued-resource", help="Queued resource name (its nodes form a multislice).")
ZONE = typer.Option(None, "--zone", help="Zone (default: CLOUDSDK_COMPUTE_ZONE, then gcloud config compute/zone).")
PROJECT = typer.Option(
    None, "--project", help="Project (default: GOOGLE_CLOUD_PROJECT / CLOUDSDK_CORE_PROJECT, then gcloud config)."
)
FORCE = typer.Option(False, "--force", help="Go on even if the slice is not READY/HEALTHY.")

# -- the mesh -----------------------------------------------------------------------------------
MESH = typer.Option(
    None, "--mesh", "-m",
    help="Per-slice mesh NAME=SIZE,... (one size may be -1). Default: data over one host;"
         " data=hosts,model=devices_per_host over several.",
)
DCN = typer.Option(None, "--dcn", help="Slices per axis across the data-centre network, e.g. data=2 (multislice).")
PLACEMENT = typer.Option(
    "auto", "--placement",
    help="How the mesh is laid onto the chips: auto (fewest ICI hops per ring step, each host on whole rows of"
         " the first axis where that can be), ici (fewest hops, nothing else asked), host (each host one"
         " contiguous block of the mesh, the rule before 0.2).")

# -- runs ---------------------------------------------------------------------------------------
ENV = typer.Option(None, "--env", "-e",
                   help="Extra KEY=VALUE for every host (repeatable); --env NAME takes NAME's value from this shell.")
ENV_FILE = typer.Option(None, "--env-file", metavar="FILE",
                        help="KEY=VALUE lines (dotenv) for every host (repeatable; --env wins). Values stay off"
                             " command lines and job tables.")
SHOW_ENV = typer.Option(False, "--show-env", help="With --dry-run: print the values of --env / --env-file too.")
HOSTS = typer.Option(None, "--hosts", help="Hosts whose output reaches the terminal: all (default), 0, 0,2.")
KILL_STALE = typer.Option(
    False, "--kill-stale", help="On TPU hosts, kill leftover processes holding the chips (and a stale libtpu lockfile)."
)
TIMEOUT = typer.Option(None, "--timeout", metavar="SECONDS",
                       help="Wall clock for the whole run; then every host's stacks are dumped and it ends (exit 124).")
STALL_TIMEOUT = typer.Option(None, "--stall-timeout", metavar="SECONDS",
                             help="No output (or tpulaunch.heartbeat()) from any host for this long: dump stacks,"
                                  " exit 124.")
MAX_RESTARTS = typer.Option(0, "--max-restarts", help="Relaunch the whole slice this many times after a host fails.")
MAX_PREEMPTIONS = typer.Option(0, "--max-preemptions",
                               help="Relaunch this many times after a host is lost or preempted.")
PREEMPTION_WAIT = typer.Option(600.0, "--preemption-wait", metavar="SECONDS",
                               help="How long to wait for the slice to be whole again after a lost host.")
PREEMPTION_GRACE = typer.Option(30.0, "--preemption-grace", metavar="SECONDS",
                                help="A preempted script's time between SIGTERM and SIGKILL (to save a checkpoint).")
KEEP_CHILDREN = typer.Option(
    False, "--keep-children",
    help="Leave processes a host's script started (servers, daemons) running after it exits; by default they"
         " are stopped with it (and named).")
COORDINATOR_PORT = typer.Option(
    None, "--coordinator-port", metavar="PORT",
    help="The port the hosts meet on at process 0's host (MASTER_PORT); on a real slice JAX's coordinator"
         " takes PORT+1 and tpulaunch's gloo group PORT+2. Default: 8476 on a slice (open it in the firewall),"
         " a free port when emulated.")
STRAGGLER_RATIO = typer.Option(
    0.7, "--straggler-ratio", metavar="R",
    help="Name a host whose step rate (tpulaunch.heartbeat(step=N)) falls below R x the median host's; 0: never.")
NO_PREFLIGHT = typer.Option(False, "--no-preflight",
                            help="Skip the checks of every host (versions, ports, chips, ids) before the scripts"
                                 " start.")
DRY_RUN = typer.Option(False, "--dry-run", help="Print the launch plan (hosts, env, mesh) and start nothing.")

# -- GKE (the Kubernetes API, configured as kubectl is) -------------------------------------------
GKE = typer.Option(False, "--gke", help="GKE: TPU node pools and KubeRay through the Kubernetes API.")
KUBECONFIG = typer.Option(None, "--kubeconfig", metavar="FILE",
                          help="With --gke: the kubeconfig (default: KUBECONFIG, then ~/.kube/config; in a pod, its"
                               " service account).")
CONTEXT = typer.Option(None, "--context", help="With --gke: the kubeconfig context (default: its current one).")
NAMESPACE = typer.Option(None, "--namespace", help="With --gke: the namespace (default: the context's, else default).")
AUTOSCALER = typer.Option(False, "--autoscaler",
                          help="With --gke: the TPU node pools come from GKE's cluster autoscaler (pools that scale"
                               " from zero, node auto-provisioning): their nodes need not be there yet; the wait shows"
                               " the autoscaler's answer, and ends (exit 3) when none of the shape is in sight and it"
                               " says for 120 s that no node could ever fit.")

"""tpulaunch-ray-start: Ray's own `ray start` (its CLI, given the arguments after the program), with
a patient wait for the new raylet to register with the GCS.

`ray start` waits for its raylet by calling `services.get_node` in a loop with no pause, each call
a new GCS connection: while a node starts, that process spins a core of the VM, and every node
joining at once (a pod's hosts) loads the one GCS they share. And it gives up after a fixed 30 s
(`raylet_start_wait_time_s` in ray/_private/node.py, no setting), which a raylet on a busy machine
has been seen to need. Ray looks the function up at each call, so the one installed here tries
again itself, every 50 ms, for up to `REGISTER_WAIT_S` from the first call for a node, before it
lets the failure through.

And the raylet itself gives up on its node after 15 s: it waits for the dashboard agent it starts
to write the ports its servers listen on (HTTP, gRPC, Prometheus) to files in the session dir
(`dashboard_agent_listen_port_<node id>`, `metrics_agent_port_...`, `metrics_export_port_...`),
and that agent first imports every dashboard module (2.4 CPU-s on these machines). With the
machine's cores busy (emulated hosts importing their frameworks, other nodes starting) the agent
has been seen to take longer, and the raylet exits with "Check failed: ... Timed out waiting for
file ...dashboard_agent_listen_port_..." (and, once that one was written ahead, "...
metrics_agent_port_..."): the node never registers, and Ray says "The current node timed out
during startup". Ray has no setting for those 15 s (`WaitForPersistedPort`'s default); the files
exist only to tell the raylet ports the agents chose themselves. So every agent port `ray start`
leaves to its agent (0, its default) is chosen before the raylet starts (`early_agent_ports`: one
free now below the ephemeral range, which the agent is told) and written to its file, as the
agent will write it: the raylet goes on at once, and each agent takes its port when it is ready.
The runtime-env agent's port is chosen ahead the same way.

That agent's own wait is a setting: the raylet asks it for each worker's environment, and after
`agent_register_timeout_ms` (30 s; Ray's default on Windows, where agents are known to be slow to
start, is 100 s) of "connection refused" it exits. Under the suite's load a re-created VM's node
joined, then died 30 s later that way, its runtime-env agent still importing: the slice never
came back. So a node started here gets 100 s too (`patient_agents`), unless its environment
already says how long.

Runs on a TPU worker over gcloud ssh (and for a head off the slice, here), sent as its own source
with `python -c` (`cluster/remote.py`), so the worker needs Ray and no tpulaunch; emulated nodes
(`cluster/nodes.py`) install the same wait and the same early port in their own process (their
ports are chosen by the launcher).
"""

import os
import random
import socket
import sys
import time
from collections.abc import Container
from typing import Any

REGISTER_WAIT_S = 90.0
AGENT_WAIT_MS = 100_000  # the raylet's wait for its runtime-env agent (Ray's default: 30 s; on Windows 100 s)


def patient_get_node(wait_s: float = REGISTER_WAIT_S) -> None:
    """Make `ray._private.services.get_node` retry (50 ms apart) for `wait_s` per node."""
    import ray._private.services as services

    real = services.get_node
    first_call: dict = {}

    def get_node(gcs_address, node_id):  # Ray's signature
        deadline = first_call.setdefault(node_id, time.monotonic()) + wait_s
        while True:
            try:
                return real(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    services.get_node = get_node


def patient_agents(wait_ms: int = AGENT_WAIT_MS) -> None:
    """Give the raylets started from this process `wait_ms` for their runtime-env agent, unless
    the environment (a deployment's) sets Ray's `agent_register_timeout_ms` already."""
    os.environ.setdefault("RAY_agent_register_timeout_ms", str(wait_ms))


# The agents' ports a raylet waits to read from a file when it is not given them (0): each
# (RayParams field, the file's name in ray._raylet) -- the dashboard agent's HTTP, gRPC and
# Prometheus ports, and the runtime-env agent's. Ray 2.60's raylet waits 15 s for each of the
# first three (`WaitForDashboardAgentPorts`), then dies.
AGENT_PORTS = (("dashboard_agent_listen_port", "DASHBOARD_AGENT_LISTEN_PORT_NAME"),
               ("metrics_agent_port", "METRICS_AGENT_PORT_NAME"),
               ("metrics_export_port", "METRICS_EXPORT_PORT_NAME"),
               ("runtime_env_agent_port", "RUNTIME_ENV_AGENT_PORT_NAME"))


def early_agent_ports() -> None:
    """Before each raylet starts, write its agents' ports to the files the raylet waits on, as the
    agents themselves will: each port chosen ahead, or (given 0: "the agent chooses") one free now,
    which the agent is then told."""
    import ray._private.node as node
    import ray._raylet as raylet

    real = node.Node.start_raylet

    def start_raylet(self: node.Node, *args: Any, **kwargs: Any) -> Any:  # Ray's signature, passed through
        params = self._ray_params  # read by start_raylet for the agents' and the raylet's command lines
        taken: set[int] = set()
        for field, name in AGENT_PORTS:
            port = getattr(params, field) or free_low_port(taken)
            setattr(params, field, port)
            if port:
                taken.add(port)
                # in ray._raylet (compiled) but not in the stub it ships
                raylet.persist_port(self._session_dir, self._node_id,  # type: ignore[attr-defined]  # see above
                                    getattr(raylet, name), port)
        return real(self, *args, **kwargs)

    node.Node.start_raylet = start_raylet  # type: ignore[method-assign]  # patched on purpose


LOWEST_PORT = 10000  # below it: well-known and registered services


def ephemeral_low() -> int:
    """The bottom of the kernel's ephemeral port range (bind(0) and outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_low_port(taken: Container[int] = ()) -> int:
    """A port free now below the kernel's ephemeral range (where no outgoing connection takes it
    before the agent binds it), not in `taken`; 0 (the agent chooses, the raylet waits) when there
    is none. (The launcher's own choices, claimed across processes, are `cluster/ports.py`'s.)"""
    top = ephemeral_low()
    for port in random.sample(range(LOWEST_PORT, top), min(200, max(0, top - LOWEST_PORT))):
        if port not in taken and port_is_free(port):
            return port
    return 0


def patient_node_start() -> None:
    """All of the above, before this process starts Ray nodes (`ray start` here, `Node()` in
    `cluster/nodes.py`): a patient wait for each raylet, its agents' ports chosen ahead, and a
    raylet patient with its runtime-env agent."""
    patient_get_node()
    early_agent_ports()
    patient_agents()


if __name__ == "__main__":
    patient_node_start()
    from ray.scripts.scripts import main

    sys.argv[0] = "ray"
    main()

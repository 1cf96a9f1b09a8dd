"""tpulaunch-ray-start: Ray's own `ray start` (its CLI, given the arguments after the program), with
a patient wait for the new raylet to register with the GCS.

`ray start` waits for its raylet by calling `services.get_node` in a loop with no pause, each call
a new GCS connection: while a node starts, that process spins a core of the VM, and every node
joining at once (a pod's hosts) loads the one GCS they share. And it gives up after a fixed 30 s
(`raylet_start_wait_time_s` in ray/_private/node.py, no setting), which a raylet on a busy machine
has been seen to need. Ray looks the function up at each call, so the one installed here tries
again itself, every 50 ms, for up to `REGISTER_WAIT_S` from the first call for a node, before it
lets the failure through.

Runs on a TPU worker over gcloud ssh (and for a head off the slice, here), sent as its own source
with `python -c` (`cluster/remote.py`), so the worker needs Ray and no tpulaunch; emulated nodes
(`cluster/nodes.py`) install the same wait in their own process.
"""

import sys
import time

REGISTER_WAIT_S = 90.0


def patient_get_node(wait_s: float = REGISTER_WAIT_S) -> None:
    """Make `ray._private.services.get_node` retry (50 ms apart) for `wait_s` per node."""
    import ray._private.services as services

    real = services.get_node
    first_call: dict = {}

    def get_node(gcs_address, node_id):  # noqa: ANN001, ANN202 - Ray's signature
        deadline = first_call.setdefault(node_id, time.monotonic()) + wait_s
        while True:
            try:
                return real(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    services.get_node = get_node


if __name__ == "__main__":
    patient_get_node()
    from ray.scripts.scripts import main

    sys.argv = ["ray", *sys.argv[1:]]
    main()

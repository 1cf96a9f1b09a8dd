"""tpulaunch-query: which nodes does the Ray head at ADDR know? Prints one marked JSON line.

Runs on a TPU worker (or the head's machine) over gcloud ssh, sent as its own source with
`python -c` (`cluster/remote.py`), so the worker needs Ray but not tpulaunch. Standard library and
Ray only; tests import it and run it as a program.
"""

import json
import logging
import socket
import sys

JSON_MARK = "TPULAUNCH-JSON:"


def query(addr: str) -> dict:
    host, port = addr.rsplit(":", 1)
    out: dict = {"head": False, "nodes": []}
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as e:
        out["error"] = str(e)
        return out
    out["head"] = True
    try:
        import ray

        ray.init(address=addr, logging_level=logging.ERROR, log_to_driver=False)
        try:  # a DeveloperAPI (no public per-node view); Ray leaves out what is all taken
            from ray._private.state import available_resources_per_node

            avail = available_resources_per_node()
        except ImportError:  # a Ray without it: nothing said of free resources (None), the rest still
            avail = {}
        for n in ray.nodes():
            out["nodes"].append({k: n.get(k) for k in ("NodeID", "Alive", "Labels", "Resources", "NodeManagerAddress")}
                                | {"Available": avail.get(n["NodeID"])})
        ray.shutdown()
    except Exception as e:  # said in the answer, one line
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


if __name__ == "__main__":
    print(JSON_MARK + json.dumps(query(sys.argv[1])), flush=True)

"""Discover which slice(s) a run gets: Cloud TPU API, GCE metadata server, Ray's TPU labels, or flags.

* `describe`: real slices from the Cloud TPU API (`tpu_api`) or the metadata server (`metadata`),
  and the checks of a found slice against the flags and for readiness;
* `ray_labels`: slices as Ray's node labels show them in a running cluster;
* `resolve`: the one decision of which slice(s) a request gets (`resolve(request, cluster)`).
"""

from tpulaunch.discover.describe import (
    check_matches,
    check_ready,
    describe_node,
    describe_queued_resource,
    generation_of,
    list_nodes,
    local_host,
    local_slice,
    readiness_problems,
    require_project_zone,
    resolve_project_zone,
)
from tpulaunch.discover.resolve import (
    ClusterSlices,
    ResolvedSlices,
    SliceRequest,
    emulated_slices,
    request_num_slices,
    resolve,
)

__all__ = [
    "ClusterSlices",
    "ResolvedSlices",
    "SliceRequest",
    "check_matches",
    "check_ready",
    "describe_node",
    "describe_queued_resource",
    "emulated_slices",
    "generation_of",
    "list_nodes",
    "local_host",
    "local_slice",
    "readiness_problems",
    "require_project_zone",
    "request_num_slices",
    "resolve",
    "resolve_project_zone",
]

"""Slice-selection flags shared by `run`, `exec` and `mesh inspect`."""

from __future__ import annotations

import typer

from tpulaunch.cli.output import Output
from tpulaunch import discover

SLICE_OPTIONS = {
    "tpu": typer.Option(None, "--tpu", help="Cloud TPU node name: discover the slice through the Cloud TPU API."),
    "queued_resource": typer.Option(None, "--queued-resource", help="Queued resource name (its nodes form a multislice)."),
    "zone": typer.Option(None, "--zone", help="Zone of --tpu (default: CLOUDSDK_COMPUTE_ZONE or gcloud config)."),
    "project": typer.Option(None, "--project", help="Project of --tpu (default: GOOGLE_CLOUD_PROJECT or gcloud config)."),
    "force": typer.Option(False, "--force", help="Go on even if the slice is not READY/HEALTHY."),
}


def resolve_slices(out: Output, req: discover.SliceRequest) -> discover.ResolvedSlices:
    """Resolve (no cluster), with a progress line while the Cloud TPU API is asked."""
    if req.tpu or req.queued_resource:
        with out.status("asking the Cloud TPU API ..."):
            return discover.resolve(req)
    return discover.resolve(req)

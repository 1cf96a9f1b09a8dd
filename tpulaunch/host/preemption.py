"""Watch the GCE metadata server for the notice that this TPU VM is going away.

Compute Engine sets `instance/preempted` to `TRUE` when a spot/preemptible VM is being preempted,
and `instance/maintenance-event` to `TERMINATE_ON_HOST_MAINTENANCE` before a maintenance event
that stops the VM (TPU VMs cannot live-migrate; `MIGRATE_ON_HOST_MAINTENANCE` is only logged).
A thread asks once a second (GCE gives about 30 s of notice) and calls `on_notice(why)` once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

POLL_S = 1.0
TERMINATING = ("TERMINATE_ON_HOST_MAINTENANCE",)


def notice(preempted: str | None, maintenance: str | None) -> str | None:
    """Why the VM is going away, from the two metadata values; None while it is not."""
    if (preempted or "").strip().upper() == "TRUE":
        return "preemption notice (instance/preempted=TRUE)"
    event = (maintenance or "").strip().upper()
    if event in TERMINATING:
        return f"maintenance notice (instance/maintenance-event={event})"
    return None


def watch(host: str | None, on_notice: Callable[[str], None], stop: Callable[[], bool]) -> threading.Thread:
    """Poll the metadata server (`host` or the default) until a notice or `stop()`; daemon thread."""
    from tpulaunch.discover.metadata import MetadataClient
    from tpulaunch.errors import MetadataError

    def run() -> None:
        client = MetadataClient(host=host)
        while not stop():
            try:
                why = notice(client.get("instance/preempted"), client.get("instance/maintenance-event"))
            except MetadataError:
                why = None  # a metadata hiccup is not a notice; ask again
            if why:
                on_notice(why)
                return
            threading.Event().wait(POLL_S)

    t = threading.Thread(target=run, name="tpulaunch-preemption-watch", daemon=True)
    t.start()
    return t

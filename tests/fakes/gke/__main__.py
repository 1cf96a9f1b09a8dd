"""Serve a fake GKE cluster until SIGTERM/SIGINT: `python -m tests.fakes.gke --pool ...` (from the repo root).

Each `--pool NAME=LABEL:TOPOLOGY:CHIPS[:spot][:nodes=N][:policy=P][:maintenance=EPOCH]` is a TPU node
pool (LABEL is its cloud.google.com/gke-tpu-accelerator, e.g. tpu-v5p-slice); a CPU pool for Ray's
head is always there. It prints the kubeconfig's path on stdout (KUBECONFIG=... for a shell).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from . import FakeGke, NodePool, tpu_pool


def parse_pool(text: str) -> NodePool:
    name, _, rest = text.partition("=")
    label, topology, chips, *extra = rest.split(":")
    kw: dict = {}
    for e in extra:
        if e == "spot":
            kw["spot"] = True
        elif e.startswith("nodes="):
            kw["nodes"] = int(e[6:])
        elif e.startswith("policy="):
            kw["placement_policy"] = e[7:]
        elif e.startswith("maintenance="):
            kw["maintenance"] = int(e[12:])
        else:
            raise SystemExit(f"unknown pool option {e!r}")
    return tpu_pool(name, label, topology if topology != "-" else None, int(chips), **kw)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fakes.gke", description=__doc__)
    ap.add_argument("--pool", action="append", default=[], help="NAME=LABEL:TOPOLOGY:CHIPS[:spot][:nodes=N]...")
    ap.add_argument("--comeback", type=float, default=5.0, help="seconds before a preempted pool is back")
    args = ap.parse_args(argv)
    pools = [NodePool("default-pool", nodes=1), *(parse_pool(p) for p in args.pool)]
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    fake = FakeGke(pools, comeback_s=args.comeback).start()
    try:
        print(f"KUBECONFIG={fake.kubeconfig}", flush=True)
        done.wait()
    finally:
        fake.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

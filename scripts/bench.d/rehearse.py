"""What `run --rehearse` costs: the transformer recipe rehearsed for a v5p-128 and a v6e-256, what a
rehearsal adds to a run (rehearsal and emulated run of a v5p-16, interleaved), and the largest target.

`python scripts/bench.d/rehearse.py` prints the BENCHMARKS.md section (`section()`); `measure()` gives
the numbers. Every run is the CLI in a subprocess, as a user types it; the rehearsal's own figures
(programs, libtpu's compile seconds, peak memory) come from its `--json` report.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = str(REPO / ".venv" / "bin" / "python")
RECIPE = "recipes/jax_transformer.py"
TARGETS = [("v5p", "4x4x4", 16), ("v6e", "16x16", 64)]  # (generation, shape, data axis = hosts)
# up to 2048 devices: XLA's CPU client runs no program over more in one process (`rehearse.MAX_CPU_DEVICES`)
LARGEST = [("v5p", "8x8x8", 128), ("v5p", "8x16x16", 512)]


def _run(args: list[str], logs: str, timeout: float = 1800) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "TPULAUNCH_HOME": os.path.join(logs, "home"), "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.perf_counter()
    proc = subprocess.run([PY, "-m", "tpulaunch", "run", "--log-dir", logs, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - t0, proc


def rehearse(gen: str, shape: str, batch: int, logs: str, timeout: float = 1800) -> dict:
    """One rehearsal of the recipe (2 steps): wall seconds and its report."""
    wall, proc = _run([RECIPE, "--topology", shape, "--accelerator", gen, "--rehearse", "--json", "--",
                       "--steps", "2", "--batch", str(max(32, batch))], logs, timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"rehearsal of {gen} {shape} exited {proc.returncode}: {proc.stderr[-2000:]}")
    doc = json.loads(proc.stdout)
    step = next(p for p in doc["programs"] if p["name"] == "train_step")
    return {"wall_s": wall, "programs": len(doc["programs"]), "compile_s": sum(p["compile_s"] for p in doc["programs"]),
            "step_bytes": step["total_bytes"], "collectives": step["collectives"], "rss": doc["peak_rss_bytes"],
            "libtpu": doc["libtpu_version"], "devices": doc["devices"], "target": doc["target"]}


def measure(n: int = 3) -> dict:
    logs = tempfile.mkdtemp(prefix="tpl-bench-rehearse-")
    out: dict = {"targets": [], "pairs": [], "largest": None}
    for gen, shape, hosts in TARGETS:
        runs = [rehearse(gen, shape, hosts, logs) for _ in range(n)]
        best = runs[0] | {"wall_s": statistics.median(r["wall_s"] for r in runs),
                          "compile_s": statistics.median(r["compile_s"] for r in runs)}
        out["targets"].append(best)
    # what a rehearsal adds: the rehearsal of a v5p-16, then the emulated run of it, in turn
    for _ in range(n):
        a = rehearse("v5p", "2x2x2", 2, logs)
        wall, proc = _run([RECIPE, "--topology", "2x2x2", "--accelerator", "v5p", "--", "--steps", "2"], logs)
        if proc.returncode != 0:
            raise RuntimeError(f"emulated run exited {proc.returncode}: {proc.stderr[-2000:]}")
        out["pairs"].append((a["wall_s"], wall, a["compile_s"]))
    for gen, shape, hosts in LARGEST:  # the largest that rehearses in 10 minutes here
        try:
            out["largest"] = rehearse(gen, shape, hosts, logs, timeout=600)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            out["largest_stop"] = f"{gen} {shape}: {str(e).splitlines()[0][:200]}"
            break
    return out


def section(n: int = 3) -> str:
    m = measure(n)
    rows = "".join(f"| {t['target']} | {t['devices']} | {t['wall_s']:.1f} | {t['programs']} | {t['compile_s']:.1f} |"
                   f" {t['step_bytes'] / 2**20:.1f} MiB | {t['rss'] / 2**30:.2f} GiB |\n" for t in m["targets"])
    pairs = "".join(f"| {k + 1} | {a:.1f} | {b:.1f} | {c:.1f} |\n" for k, (a, b, c) in enumerate(m["pairs"]))
    big = m["largest"]
    largest = (f"The largest target rehearsed here: **{big['target']}** ({big['devices']} devices) in {big['wall_s']:.0f} s"
               f" ({big['programs']} programs, libtpu {big['compile_s']:.0f} s, peak {big['rss'] / 2**30:.1f} GiB)."
               if big else "No large target rehearsed.") + (f" Next: {m['largest_stop']}." if m.get("largest_stop") else "")
    return f"""## Rehearsal: the recipe compiled for real TPUs (`run --rehearse`)

Measured on {datetime.date.today().isoformat()} (`scripts/bench.d/rehearse.py`, median of {n}): `recipes/jax_transformer.py
--steps 2` rehearsed (one process holding every device as a CPU device; each program compiled by libtpu
{m['targets'][0]['libtpu']} first). "libtpu" is the seconds libtpu spent compiling, summed over the programs.

| target | devices | wall (s) | programs | libtpu (s) | train_step per device | peak memory |
| --- | ---: | ---: | ---: | ---: | ---: | ---: |
{rows}
What a rehearsal adds to a run: on a v5p-16 (2 hosts, which this machine can also emulate), the
rehearsal and then the emulated run (cold cluster), in turn:

| pair | rehearsal (s) | emulated run (s) | libtpu in the rehearsal (s) |
| --- | ---: | ---: | ---: |
{pairs}
Median: the rehearsal adds **{statistics.median(a for a, _, _ in m['pairs']):.1f} s** to a
{statistics.median(b for _, b, _ in m['pairs']):.1f} s run.

{largest}
"""


if __name__ == "__main__":
    print(section(int(sys.argv[1]) if len(sys.argv) > 1 else 3))

"""Launch benchmarks, all measured in one run on this machine; writes BENCHMARKS.md.

Wall times of whole commands, as a user would see them (median of --repeat runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PY = sys.executable
TL = [PY, "-m", "tpulaunch"]


def timed(cmd: list[str], env: dict | None = None, cwd: Path = REPO) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return dt, p.stdout + p.stderr


def median_of(n: int, cmd: list[str], env: dict | None = None) -> float:
    return statistics.median(timed(cmd, env)[0] for _ in range(n))


def planning_section(_ctx: dict) -> str:
    sys.path.insert(0, str(HERE))
    import planning

    rows = planning.measure()
    base = rows[0]["mesh_s"] + rows[0]["launch_plan_s"]
    cli = {}
    for acc in ("tpu7x-32", "tpu7x-18432"):
        cli[acc] = median_of(5, [*TL, "mesh", "inspect", acc])
    table = "".join(
        f"| {r['accelerator']} | {r['chips']} | {r['hosts']} | {r['mesh_s'] * 1000:.1f} | {r['launch_plan_s'] * 1000:.1f} |"
        f" {(r['mesh_s'] + r['launch_plan_s']) / base:.0f}x |\n" for r in rows)
    return f"""## Planning time vs slice size

Measured on {datetime.date.today().isoformat()} (`scripts/bench.d/planning.py`, median of 5, in-process, no Ray):
Topology and MeshPlan with every device placed on its chip, then the LaunchPlan with every host's
environment. Baseline: the 16-chip slice of the same run.

| slice | chips | hosts | mesh plan (ms) | launch plan (ms) | vs 16 chips |
| --- | ---: | ---: | ---: | ---: | ---: |
{table}
Whole command, `tpulaunch mesh inspect` piped (process start, imports, plan, print; median of 5):
{cli['tpu7x-32']:.2f} s for tpu7x-32, {cli['tpu7x-18432']:.2f} s for tpu7x-18432 (9216 chips, 2304 hosts).
"""


def mesh_section(_ctx: dict) -> str:
    sys.path.insert(0, str(HERE))
    import mesh_scores

    rows = mesh_scores.measure()
    worse = [r for r in rows if not r["no_worse"]]
    verdict = ("tpulaunch's layout is no worse than mesh_utils' in every case (innermost axis first, then the total)"
               if not worse else f"WORSE than mesh_utils in {len(worse)} case(s): " + ", ".join(r["slice"] for r in worse))
    return f"""## Mesh cost on pods: ICI hops per ring step (by model)

Measured on {datetime.date.today().isoformat()} (`scripts/bench.d/mesh_scores.py`, pure, from the chips' coordinates).
Each axis's mean ICI hops per step of a ring along it (closure included; 1 = every step to a
neighbouring chip; two cores of a chip are 0 apart), axes in mesh order, innermost last.
Wraparound on 3-D dimensions of 4+ chips and 2-D dimensions of 16+. "mesh_utils" is JAX
{_jax_version()}'s `create_device_mesh` given devices with the slice's coordinates; "refuses": it builds
no mesh for that shape. "hosts own rows": every row of the first axis on one host (per-host input).
{verdict}.

{mesh_scores.table(rows)}"""


def recovery_section(_ctx: dict) -> str:
    sys.path.insert(0, str(HERE))
    import recovery

    r = recovery.measure()
    rows = "".join(f"| {i + 1} | {x['recovery_s']:.1f} | {x['api_s']:.1f} | {x['setup_join_s']:.1f} | {x['overhead_s']:.1f} |\n"
                   for i, x in enumerate(r["rows"]))
    b = r["buckets"]
    mean = sum(x["overhead_s"] for x in r["rows"]) / max(1, len(r["rows"]))
    return f"""## Recovery through preemptions (fake Cloud TPU API, head off the slice)

Measured on {datetime.date.today().isoformat()} (`scripts/bench.d/recovery.py`): a spot v4-16 (2 hosts), `cluster up --tpu
--head local`, a detached run with `--recreate --max-preemptions 3` (0.3 s steps, a save every 2 steps),
the slice preempted three times. Recovery: from the failure to the next attempt's first step
(`tpulaunch goodput`); the fake API's part: deleting, creating and provisioning the slice again (its
waits are the suite's, 0.2 s and 0.3 s); tpulaunch's overhead: the rest (noticing the loss, setting up and
joining the new VMs, Ray seeing them whole, the relaunch and the script's start-up).

| preemption | recovery (s) | fake API (s) | setup + join (s) | tpulaunch overhead (s) |
| ---: | ---: | ---: | ---: | ---: |
{rows}
Mean overhead per preemption {mean:.1f} s. The run: wall {r['wall_s']:.1f} s, goodput {100 * r['goodput']:.0f}%
(productive {b['productive']:.1f} s, checkpoint {b['checkpoint']:.1f} s, wasted {b['wasted_progress']:.1f} s, recovery
{b['recovery']:.1f} s, cluster start {b['cluster_start']:.1f} s, idle {b['idle']:.1f} s).
"""


def elastic_section(_ctx: dict) -> str:
    sys.path.insert(0, str(HERE))
    import elastic

    rows = elastic.measure()
    table = "".join(
        f"| `--min-slices {r['min_slices']}` | {r['wall_s']:.1f} | {100 * r['goodput']:.0f}% | {r['buckets']['productive']:.1f}"
        f" | {r['buckets']['recovery']:.1f} | {r['buckets']['wasted_progress']:.1f} | "
        + ", ".join(f"{o} ({why})" for o, why in r["attempts"]) + " |\n" for r in rows)
    return f"""## Elastic multislice: one preemption, waiting vs going on (fake Cloud TPU API)

Measured on {datetime.date.today().isoformat()} (`scripts/bench.d/elastic.py`): two spot v4-8 slices under a head here, a
detached run on both (`--dcn data=2 --recreate --max-preemptions 1`, 0.3 s steps to step 200, a save
every 2 steps), slice B preempted at step 10; the fake API takes {elastic.PROVISION_S:g} s to provision B again.
`--min-slices 2` waits for B; `--min-slices 1` goes on on A and grows back at the first checkpoint
after B is back. Goodput from `tpulaunch goodput`: the share of the wall time spent making steps. It counts
time, not device-seconds: the shrunk attempt steps on half the devices (here the script's step time does
not depend on them; a data-parallel job's global batch would take about twice as long per step on one slice).

| run | wall (s) | goodput | productive (s) | recovery (s) | wasted (s) | attempts |
| --- | ---: | ---: | ---: | ---: | ---: | --- |
{table}"""


def spares_section(ctx: dict) -> str:
    sys.path.insert(0, str(HERE))
    import spares

    m = spares.measure(max(2, ctx["n"] - 1))
    pre, hung = m["preemption"], m["hang"]
    rows = "".join(f"| {k + 1} | {w['recovery_s']:.1f} | {w['api_s']:.1f} | {w['overhead_s']:.1f} | {s['recovery_s']:.1f}"
                   f" | {s['swap_s']:.2f} | {w['recovery_s'] / max(1e-9, s['recovery_s']):.2f} |\n"
                   for k, (w, s) in enumerate(zip(pre[False], pre[True])))
    hrows = "".join(f"| {k + 1} | {w['recovery_s']:.1f} | {w['replace_s']:.1f} | {s['recovery_s']:.1f} |"
                    f" {s['replace_s']:.2f} |\n" for k, (w, s) in enumerate(zip(hung[False], hung[True])))
    med = statistics.median
    return f"""## Recovery with a spare slice: a preemption and a hang, with and without (interleaved pairs)

Measured on {datetime.date.today().isoformat()} (`scripts/bench.d/spares.py`). Preemption: two spot v4-8 slices under a
head here (fake Cloud TPU API, its waits the suite's 0.2 s and 0.3 s), `cluster up --tpu A --tpu B --head local`
with or without `--spare-slices 1`; a detached run on both (`--dcn data=2 --recreate --max-preemptions 1`,
0.3 s steps, a save every 2), B preempted at step {spares.PREEMPT_AT}. Recovery: from the loss to the next attempt's first step
(`tpulaunch goodput`); without a spare, the fake API's part is deleting, creating and provisioning B
again, and tpulaunch's overhead the rest (noticing, setting up and joining the new VM, Ray seeing it,
the relaunch); with one, nothing waits for B (made again in the background, the new spare): the whole
recovery is overhead. Pairs in turn, the order flipped each pair.

| pair | without: recovery (s) | fake API (s) | overhead (s) | with a spare: recovery = overhead (s) | swap (s) | ratio |
| ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{rows}
Median overhead: **{med(s['overhead_s'] for s in pre[True]):.1f} s with a spare** against
{med(w['overhead_s'] for w in pre[False]):.1f} s without (goal: at most 5 s); and without a spare a real
re-creation adds minutes to hours on top, which the spare does not wait for at all.

Hang: an emulated 2-slice run (v4 2x2x2, 2 hosts a slice) whose host 3 blocks in its input in attempt 0,
`--stall-timeout 20 --max-restarts 1 --replace-hung`, on `cluster up --num-slices 2` with or without
`--spare-slices 1`. From the stall being declared (20 s after the last step) to the restarted
attempt's first step: every host's stacks taken and triaged (host 3 named each time), then the hung
slice made again (its hosts stopped and started, as a TPU VM is replaced) or a spare in its place.

| pair | made again: stall to first step (s) | replacing (s) | a spare: stall to first step (s) | swap (s) |
| ---: | ---: | ---: | ---: | ---: |
{hrows}
Median: {med(w['recovery_s'] for w in hung[False]):.1f} s made again, {med(s['recovery_s'] for s in hung[True]):.1f} s with a spare
(the rest of either is the stacks, stopping the hung attempt and the script's start-up: torch, gloo).
"""


def _jax_version() -> str:
    import jax

    return jax.__version__


def floor_at_once(n: int, procs: int, env: dict, noop: str) -> float:
    """Median seconds for `procs` copies of noop.py started at once (what emulated hosts must do)."""
    def once() -> float:
        t0 = time.perf_counter()
        ps = [subprocess.Popen([PY, noop], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for _ in range(procs)]
        if any(p.wait() != 0 for p in ps):
            raise SystemExit("bench: noop.py failed")
        return time.perf_counter() - t0

    return statistics.median(once() for _ in range(n))


def run_json(cmd: list[str], env: dict) -> tuple[float, dict]:
    """A `tpulaunch run ... --json`: wall seconds and its summary."""
    dt, _ = timed([*cmd, "--json"], env)
    runs = sorted(Path(env["TPULAUNCH_HOME"], "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    return dt, json.loads((runs[-1] / "summary.json").read_text())


SPARES_READY_S = 25  # after `cluster up` or a cold run, the hosts' spare processes finish importing torch_xla


def phase_rows(summary: dict) -> dict[str, float]:
    t, hosts = summary["timings"], summary["hosts"]

    def med(key: str) -> float:
        return statistics.median(h["phases"].get(key, 0.0) for h in hosts) if hosts else 0.0

    return {"cluster start": t.get("cluster_start_s", 0.0), "connect": t.get("connect_s", 0.0),
            "schedule (placement group)": t.get("schedule_s", 0.0),
            "host agents found or started": t.get("agents_s", 0.0) - t.get("schedule_s", 0.0),
            "host: framework import (median)": med("import_s"), "host: runtime boot (median)": med("boot_s"),
            "host: mesh (median)": med("mesh_s"), "first line (from the attempt's start)": t.get("first_line_s", 0.0),
            "whole launch (summary wall)": summary["wall_s"]}


def launch_section(ctx: dict) -> str:
    n, env, noop = ctx["n"], ctx["env"], ctx["noop"]
    logs = ["--log-dir", os.path.join(env["TPULAUNCH_HOME"], "runs")]
    floor_env = {**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "16"}
    rows: dict[str, float] = {}
    print("bench: floors (python noop.py: one process; 4 at once, as 4 emulated hosts)", file=sys.stderr)
    rows["floor"] = floor_at_once(n, 1, floor_env, noop)
    rows["floor4"] = floor_at_once(n, 4, floor_env, noop)
    print("bench: cold launches (each starts and stops a 4-node emulated cluster)", file=sys.stderr)
    cold = [run_json([*TL, "run", noop, "--topology", "2x8", *logs], env) for _ in range(n)]
    rows["cold"] = statistics.median(dt for dt, _ in cold)
    print("bench: --keep-cluster, then the next plain run on the kept cluster", file=sys.stderr)
    timed([*TL, "run", noop, "--topology", "2x8", "--keep-cluster", *logs], env)
    time.sleep(SPARES_READY_S)
    rows["kept"] = timed([*TL, "run", noop, "--topology", "2x8", *logs], env)[0]
    timed([*TL, "cluster", "down"], env)
    print("bench: warm launches on `cluster up` (spares ready, and back to back)", file=sys.stderr)
    rows["cluster_up"], _ = timed([*TL, "cluster", "up", "--topology", "2x8"], env)
    try:
        warm = []
        for _ in range(n):
            time.sleep(SPARES_READY_S)
            warm.append(run_json([*TL, "run", noop, "--topology", "2x8", "--address", "auto", *logs], env))
        rows["warm"] = statistics.median(dt for dt, _ in warm)
        rows["back_to_back"] = statistics.median(
            timed([*TL, "run", noop, "--topology", "2x8", "--address", "auto", *logs], env)[0] for _ in range(n))
    finally:
        timed([*TL, "cluster", "down"], env)
    print("bench: anchor (Ray Train TorchTrainer, 4 workers)", file=sys.stderr)
    rows["anchor"] = median_of(n, [PY, str(HERE / "anchor_ray_train.py")], env)
    a = rows["anchor"]
    phases_cold, phases_warm = phase_rows(cold[-1][1]), phase_rows(warm[-1][1])
    phase_table = "".join(f"| {k} | {phases_cold[k]:.2f} | {phases_warm[k]:.2f} |\n" for k in phases_cold)
    return f"""## Launch time (emulated 2x8 = v6e-16, 4 hosts)

Measured on {datetime.date.today().isoformat()} (median of {n} runs). `noop.py` imports torch_xla, gets the
16-device mesh and exits. Emulated hosts share the {os.cpu_count()} cores, so every emulated host's torch_xla
import competes with the others' and with the Ray processes of the emulated nodes.

| what | seconds | vs anchor | vs 4-process floor |
| --- | ---: | ---: | ---: |
| floor: `python noop.py` in one process, same device count | {rows['floor']:.1f} | {rows['floor'] / a:.2f} | |
| emulation floor: 4 x `python noop.py` at once | {rows['floor4']:.1f} | {rows['floor4'] / a:.2f} | 1.00 |
| **cold**: `tpulaunch run noop.py --topology 2x8` (starts and stops a 4-node cluster) | {rows['cold']:.1f} | **{rows['cold'] / a:.2f}** | {rows['cold'] / rows['floor4']:.2f} |
| **warm**: `--address auto` on `cluster up`, the hosts' spare processes ready | {rows['warm']:.1f} | {rows['warm'] / a:.2f} | **{rows['warm'] / rows['floor4']:.2f}** |
| warm, back to back (the same spares fork each run: no import) | {rows['back_to_back']:.1f} | {rows['back_to_back'] / a:.2f} | {rows['back_to_back'] / rows['floor4']:.2f} |
| kept: a plain `run` after `run --keep-cluster` (spares ready) | {rows['kept']:.1f} | {rows['kept'] / a:.2f} | {rows['kept'] / rows['floor4']:.2f} |
| anchor: Ray Train `TorchTrainer`, 4 workers, same no-op (one Ray node) | {a:.1f} | 1.00 | {a / rows['floor4']:.2f} |
| `tpulaunch cluster up --topology 2x8` (once, spares included) | {rows['cluster_up']:.1f} | | |

Where a launch's time goes (seconds, from the runs' `summary.json`: the last cold and warm run):

| phase | cold | warm |
| --- | ---: | ---: |
{phase_table}"""


def step_times(out: str) -> list[float]:
    m = re.search(r"STEP_TIME (\{.*\})", out)
    if not m:
        raise SystemExit("bench: no STEP_TIME in output:\n" + out[-2000:])
    return json.loads(m.group(1))["steps_s"]


def step_section(ctx: dict) -> str:
    """Seconds per step of the 2D transformer recipe: directly vs under tpulaunch (warm 2x4 cluster)."""
    env, logs = ctx["env"], ctx["logs"]
    steps, runs = 200, 5
    args = ["--steps", str(steps)]
    direct_env = {**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "BENCH_TOPOLOGY": "2x4"}
    script = str((HERE / "step_time.py").relative_to(REPO))
    timed([*TL, "cluster", "up", "--topology", "2x4"], env)
    direct, tl = [], []
    try:
        for k in range(runs):  # in pairs, back to back, so a slow patch of the machine hits both alike
            print(f"bench: step time, pair {k + 1} of {runs}: direct, then tpulaunch", file=sys.stderr)
            time.sleep(10)  # the host's spare process (started after the last run) has finished importing
            direct.append(statistics.median(step_times(timed([PY, script, *args], direct_env)[1])))
            time.sleep(10)
            tl.append(statistics.median(step_times(
                timed([*TL, "run", script, "--topology", "2x4", "--address", "auto", *logs, "--", *args], env)[1])))
    finally:
        timed([*TL, "cluster", "down"], env)
    d, t = statistics.median(direct), statistics.median(tl)
    pair = statistics.median(b / a for a, b in zip(direct, tl))
    spread = max(max(direct) / min(direct), max(tl) / min(tl))
    return f"""## Step time (2D transformer recipe, 1 host x 8 devices)

Measured on {datetime.date.today().isoformat()}: median seconds per step over {steps} steps (the first 5 dropped),
{runs} pairs of runs, each pair a direct run then a `tpulaunch run` right after it (10 s apart, with
the same idle emulated 2x4 cluster up during both). The step-time ratio is the median of the pairs'
ratios: the machine's speed drifts by more than the gap measured (runs of one kind vary by up to
{spread:.2f}x in this run), and the two runs of a pair share its state.

| how | runs (median s/step) | median |
| --- | --- | ---: |
| directly, one process (8 CPU devices) | {", ".join(f"{x:.4f}" for x in direct)} | {d:.4f} |
| `tpulaunch run` (1 emulated host) | {", ".join(f"{x:.4f}" for x in tl)} | {t:.4f} |
| ratio of each pair | {", ".join(f"{b / a:.3f}" for a, b in zip(direct, tl))} | **{pair:.3f}** |

Ratio of the two medians: {t / d:.3f}.
"""


def scaling_section(ctx: dict) -> str:
    env, noop = ctx["env"], ctx["noop"]
    logs = ["--log-dir", os.path.join(env["TPULAUNCH_HOME"], "runs")]
    shapes = ((1, "v6e 2x4", "v6e-8", 8), (2, "v4 2x2x2", "v4-16", 8), (4, "v6e 2x8", "v6e-16", 16),
              (8, "v6e 4x8", "v6e-32", 32))
    launch, floor = {}, {}
    for hosts, name, spec, devices in shapes:
        print(f"bench: cold launch and floor, {hosts} emulated host(s)", file=sys.stderr)
        launch[hosts] = timed([*TL, "run", noop, "--accelerator", spec, *logs], {**env, "BENCH_TOPOLOGY": spec})[0]
        floor[hosts] = floor_at_once(1, hosts, {**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices),
                                                "BENCH_TOPOLOGY": spec}, noop)
    return f"""## Launch time vs emulated hosts (cold, one run each)

Measured on {datetime.date.today().isoformat()}. Floor: that many `noop.py` processes at once (each with the
slice's device count), what the emulated hosts must do on these {os.cpu_count()} cores.

| hosts | topology | launch (s) | floor (s) | launch - floor (s) |
| ---: | --- | ---: | ---: | ---: |
""" + "".join(f"| {h} | {name} | {launch[h]:.1f} | {floor[h]:.1f} | {launch[h] - floor[h]:.1f} |\n"
              for h, name, _, _ in shapes) + f"""
From 4 to 8 hosts the launch grows {launch[8] / launch[4]:.2f}x; the floor itself grows {floor[8] / floor[4]:.2f}x.
"""


FIRST_STEP_CASES = [  # (what, recipe, topology, hosts)
    ("torch_xla demo (transformer_2d)", "recipes/transformer_2d.py", "2x8", 4),
    ("JAX demo (jax_transformer)", "recipes/jax_transformer.py", "2x4", 1),
    ("JAX demo (jax_transformer)", "recipes/jax_transformer.py", "2x8", 4),
]


def first_step_section(ctx: dict) -> str:
    """Time to the first training step, with an empty persistent compilation cache and a warm one."""
    env = ctx["env"]
    logs = ["--log-dir", os.path.join(env["TPULAUNCH_HOME"], "runs")]
    rows = []
    for name, recipe, topo, hosts in FIRST_STEP_CASES:
        framework = "jax" if "jax" in recipe else "torch_xla"  # the hosts' spares import what the script will
        timed([*TL, "cluster", "up", "--topology", topo, "--prewarm", framework], env)
        try:
            cache = tempfile.mkdtemp(prefix="tpl-bench-cache-")
            seen = []
            for label in ("empty cache", "warm cache", "no cache"):
                time.sleep(SPARES_READY_S)
                flags = ["--no-compile-cache"] if label == "no cache" else ["--compile-cache", cache]
                seen.append(time_to(r"step 0 ", [*TL, "run", recipe, "--topology", topo, "--address", "auto",
                                                 "--framework", framework, *logs, *flags, "--", "--steps", "3"], env))
            rows.append((name, f"{hosts} ({topo})", *seen))
        finally:
            timed([*TL, "cluster", "down"], env)
    return f"""## Time to the first step, persistent compilation cache

Measured on {datetime.date.today().isoformat()} on a warm emulated slice (spares ready): seconds from the
command's start to the first `step 0` line, one run each, in the order empty, warm, none. The
cache is on by default for JAX (`~/.cache/tpulaunch/xla-cache/jax/<slice>`; `--compile-cache DIR`,
`--no-compile-cache`); torch_xla runs here with `--compile-cache DIR` given explicitly.

| script | hosts | empty cache | warm cache | no cache | warm vs empty |
| --- | --- | ---: | ---: | ---: | ---: |
""" + "".join(f"| {n} | {h} | {e:.1f} | {w:.1f} | {o:.1f} | {e / w:.2f}x |\n" for n, h, e, w, o in rows) + """
- **torch_xla**: 2.9 writes cached executables but cannot load them ("Failed to deserialize
  executable: UNIMPLEMENTED: Deserializing serialized executable not supported"), on TPU as on CPU
  (pytorch/xla#9094): its warm-cache run is no faster than its run with no cache, and tpulaunch
  gives torch_xla no default cache.
- **JAX, one host**: what every host of a TPU slice does: it reads the entries process 0 wrote.
- **JAX, four emulated hosts**: only process 0 reads the cache. JAX keys an entry by, among
  other things, the fingerprint of the devices' topology; a TPU slice's topology is the same on
  every host, but the CPU topology of each emulated host process is its own, so hosts 1-3 compute
  other keys, miss, and compile again (JAX writes from process 0 only). The first step waits for
  the slowest host, so the emulated 4-host slice shows little of the cache.
"""


def time_to(pattern: str, cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = None
    assert p.stdout is not None
    for line in p.stdout:
        if seen is None and re.search(pattern, line):
            seen = time.perf_counter() - t0
    if p.wait() != 0 or seen is None:
        raise SystemExit(f"bench: {' '.join(cmd)} failed or printed no {pattern!r}")
    return seen


def scale_run(n: int, scenario: str, seconds: float, *flags: str) -> dict:
    out = timed([PY, str(HERE / "scale.py"), str(n), scenario, str(seconds), *flags])[1]
    m = re.search(r"^SCALE (\{.*\})$", out, re.M)
    if not m:
        raise SystemExit("bench: scale.py printed no result:\n" + out[-2000:])
    return json.loads(m.group(1))


def scale_section(_ctx: dict) -> str:
    """The supervision of N simulated hosts on real Ray (`scale.py`), now and with the old cadence."""
    seconds = 20.0
    rows = []
    for n in (16, 256, 2304):
        for scenario in ("quiet", "chatty", "failure"):
            print(f"bench: scale, {n} simulated hosts, {scenario}", file=sys.stderr)
            rows.append(("now", scale_run(n, scenario, seconds)))
    for scenario in ("quiet", "chatty"):
        print(f"bench: scale, 2304 simulated hosts, {scenario}, the old cadence (baseline)", file=sys.stderr)
        rows.append(("baseline: 1 poll/s per host, no batching", scale_run(2304, scenario, seconds, "--old-cadence")))

    def row(label: str, r: dict) -> str:
        stop = f"{r['stop_s']:.2f} ({r['told']} told)" if r["stop_s"] is not None else ""
        lost = r["lines_sent"] - r["lines_written"]
        return (f"| {r['hosts']} | {r['scenario']} | {label} | {r['cpu_cores']:.2f} | {r['peak_rss_mib']:.0f} |"
                f" {r['polls_per_s']:.0f} | {r['lines_per_s']:.0f} | {r['lines_sent']} / {r['lines_written']}"
                f"{' (LOST ' + str(lost) + ')' if lost else ''} | {stop} | {r['summary_s'] * 1000:.0f} |\n")

    table = "".join(row(label, r) for label, r in rows)
    return f"""## Supervising many hosts (simulated hosts, real Ray, real supervision)

Measured on {datetime.date.today().isoformat()} (`scripts/bench.d/scale.py`): the real `RayFleet`, `AttemptWatch`,
host logs and terminal sink supervise N simulated hosts, answered by {4} async actor processes that
speak the host agent's calls (one real Ray call per host per poll), for {seconds:.0f} s per row. quiet: no host
prints; chatty: every host prints a line a second; failure: chatty, host N/2 exits 1 halfway. CPU is the
launcher process's (process time / wall; the actors are other processes), RSS its peak, polls the calls
the launcher made per second; stop: from the failing host's exit to the last host told to stop.

| hosts | scenario | cadence | launcher CPU (cores) | peak RSS (MiB) | polls/s | lines/s to logs | lines sent / written | stop (s) | summary (ms) |
| ---: | --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: |
{table}
The cadence now (`run.fleet.cadence`): up to 16 hosts, one renewal a second and every line at once;
above, a quiet host's poll is renewed every N/250 s (1-10 s) and a chatty host's reply gathers N/500 s
of lines (up to 5 s); a host's end always answers at once.
"""


def launcher_cpu(cmd: list[str], env: dict, cwd: Path = REPO) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the launcher process itself) of one command."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr.read()[-3000:] if p.stderr else ''}")
    return wall, usage.ru_utime + usage.ru_stime


def real_scale_section(ctx: dict) -> str:
    """Launch of a no-framework script on 4-32 real emulated Ray nodes, cold and warm."""
    env = ctx["env"]
    logs = ["--log-dir", os.path.join(env["TPULAUNCH_HOME"], "runs")]
    script = str((HERE / "noframework.py").relative_to(REPO))
    shapes = ((4, "2x8"), (8, "4x8"), (16, "8x8"), (32, "8x16"))
    rows = []
    for hosts, topo in shapes:
        print(f"bench: real Ray, {hosts} emulated hosts: cold", file=sys.stderr)
        cold = launcher_cpu([*TL, "run", script, "--topology", topo, "--framework", "none", *logs], env)
        print(f"bench: real Ray, {hosts} emulated hosts: cluster up, then warm runs", file=sys.stderr)
        up_wall, _ = launcher_cpu([*TL, "cluster", "up", "--topology", topo, "--prewarm", "none"], env)
        try:
            launcher_cpu([*TL, "run", script, "--topology", topo, "--address", "auto", "--framework", "none", *logs], env)
            warm = [launcher_cpu([*TL, "run", script, "--topology", topo, "--address", "auto", "--framework", "none",
                                  *logs], env) for _ in range(ctx["n"])]
        finally:
            timed([*TL, "cluster", "down"], env)
        w = sorted(warm)[len(warm) // 2]
        rows.append((hosts, topo, cold, up_wall, w))
    base = rows[1]
    table = "".join(f"| {h} | {t} | {c[0]:.1f} | {c[1]:.2f} | {u:.1f} | {w[0]:.2f} | {w[1]:.2f} |"
                    f" {c[0] / base[2][0]:.2f} | {w[0] / base[4][0]:.2f} |\n" for h, t, c, u, w in rows)
    return f"""## Launch time vs real Ray nodes (`--framework none`)

Measured on {datetime.date.today().isoformat()}: `tpulaunch run noframework.py --framework none` on emulated slices
of 4 to 32 hosts, each host a real Ray node on this machine ({os.cpu_count()} cores). Cold: the run starts and
stops its own cluster. Warm: on `cluster up` (after one run), median of {ctx['n']}. Launcher CPU: the
`tpulaunch` process (user + system) with the helpers it reaps (a cold run's node starters, up to 3
processes that each import Ray), not Ray's daemons. Growth is relative to 8 hosts.

| hosts | topology | cold (s) | cold launcher CPU (s) | cluster up (s) | warm (s) | warm launcher CPU (s) | cold vs 8 | warm vs 8 |
| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{table}
From 8 to 32 hosts (4x the nodes) a cold launch grows {rows[3][2][0] / base[2][0]:.2f}x and a warm one {rows[3][4][0] / base[4][0]:.2f}x.
"""


def preflight_section(ctx: dict) -> str:
    """What preflight adds to a warm 2x8 launch: pairs of runs with and without it."""
    env, noop = ctx["env"], ctx["noop"]
    logs = ["--log-dir", os.path.join(env["TPULAUNCH_HOME"], "runs")]
    timed([*TL, "cluster", "up", "--topology", "2x8"], env)
    pairs, inside = [], []
    try:
        for k in range(5):
            print(f"bench: preflight, pair {k + 1} of 5", file=sys.stderr)
            got = {}
            for label, flags in (("with", []), ("without", ["--no-preflight"])):
                time.sleep(SPARES_READY_S)
                dt, summary = run_json([*TL, "run", noop, "--topology", "2x8", "--address", "auto", *logs, *flags], env)
                got[label] = dt
                if label == "with":
                    inside.append(summary["attempts"][0]["timings"]["preflight_s"])
            pairs.append((got["with"], got["without"]))
    finally:
        timed([*TL, "cluster", "down"], env)
    diffs = [a - b for a, b in pairs]
    return f"""## Preflight on a warm 2x8 (4 hosts)

Measured on {datetime.date.today().isoformat()}: 5 pairs of warm `tpulaunch run noop.py --topology 2x8 --address auto`,
with preflight (the default) then `--no-preflight`, spares ready before each run.

| pair | with (s) | without (s) | added (s) | preflight phase (s, from the summary) |
| ---: | ---: | ---: | ---: | ---: |
""" + "".join(f"| {k + 1} | {a:.2f} | {b:.2f} | {a - b:+.2f} | {p:.2f} |\n" for k, ((a, b), p) in enumerate(zip(pairs, inside))) + f"""
Median added: **{statistics.median(diffs):+.2f} s** (the phase itself: {statistics.median(inside):.2f} s; the
budget is 1.5 s).
"""


def rehearsal_section(ctx: dict) -> str:
    sys.path.insert(0, str(HERE))
    import rehearse

    return rehearse.section(ctx["n"])

SECTIONS = {"planning": planning_section, "mesh": mesh_section, "launch": launch_section, "steps": step_section, "scaling": scaling_section,
            "first_step": first_step_section, "preflight": preflight_section, "scale": scale_section,
            "real_scale": real_scale_section, "recovery": recovery_section, "elastic": elastic_section,
            "spares": spares_section, "rehearsal": rehearsal_section}
MARK = "<!-- bench section: {} -->"


def write(out: Path, done: dict[str, str]) -> str:
    """BENCHMARKS.md with the sections measured now replaced and the others kept as they were."""
    old = out.read_text() if out.exists() else ""
    kept = {}
    for name in SECTIONS:
        m = re.search(re.escape(MARK.format(name)) + r"\n(.*?)(?=<!-- bench section: |\Z)", old, re.S)
        if m:
            kept[name] = m.group(1).rstrip() + "\n"
    kept.update(done)
    head = f"""# Benchmarks

Written by `./scripts/bench` on this machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()},
Python {platform.python_version()}. Wall-clock seconds of whole commands unless noted; each section
says when it was measured (`./scripts/bench --only planning` remeasures one section).

"""
    text = head + "\n".join(f"{MARK.format(n)}\n{kept[n]}" for n in SECTIONS if n in kept)
    out.write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of sections: {', '.join(SECTIONS)}")
    args = ap.parse_args()
    wanted = [w for w in args.only.split(",") if w]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"bench: unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    home = tempfile.mkdtemp(prefix="tpl-bench-home-")
    env = {**os.environ, "TPULAUNCH_HOME": home, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    ctx = {"n": args.repeat, "env": env, "logs": ["--log-dir", os.path.join(home, "runs")],
           "noop": str((HERE / "noop.py").relative_to(REPO))}
    try:
        done = {name: SECTIONS[name](ctx) for name in SECTIONS if name in wanted}
    except BaseException:
        print(f"bench: the runs' logs are kept in {home}", file=sys.stderr)
        raise
    shutil.rmtree(home, ignore_errors=True)  # every run succeeded: its logs are not needed
    print(write(Path(args.out), done))


if __name__ == "__main__":
    main()

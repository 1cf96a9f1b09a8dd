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


def launch_section(ctx: dict) -> str:
    n, env, logs, noop = ctx["n"], ctx["env"], ctx["logs"], ctx["noop"]
    rows: dict[str, float] = {}
    print("bench: floor (python noop.py, 16 CPU devices, one process)", file=sys.stderr)
    rows["floor"] = median_of(n, [PY, noop], {**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "16"})
    print("bench: emulation floor (4 x python noop.py at once, as 4 emulated hosts on these cores)", file=sys.stderr)
    floor_env = {**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "16"}

    def four_at_once() -> float:
        t0 = time.perf_counter()
        procs = [subprocess.Popen([PY, noop], cwd=REPO, env=floor_env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for _ in range(4)]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("bench: noop.py failed")
        return time.perf_counter() - t0

    rows["floor4"] = statistics.median(four_at_once() for _ in range(n))
    print("bench: cold launch (emulated 2x8, cluster started and stopped)", file=sys.stderr)
    rows["cold"] = median_of(n, [*TL, "run", noop, "--topology", "2x8", *logs], env)
    print("bench: warm launch (--address auto)", file=sys.stderr)
    up, _ = timed([*TL, "cluster", "up", "--topology", "2x8"], env)
    rows["cluster_up"] = up
    try:
        rows["warm"] = median_of(n, [*TL, "run", noop, "--topology", "2x8", "--address", "auto", *logs], env)
    finally:
        timed([*TL, "cluster", "down"], env)
    print("bench: anchor (Ray Train TorchTrainer, 4 workers)", file=sys.stderr)
    rows["anchor"] = median_of(n, [PY, str(HERE / "anchor_ray_train.py")], env)
    return f"""## Launch time (emulated 2x8 = v6e-16, 4 hosts)

Measured on {datetime.date.today().isoformat()} (median of {n} runs). `noop.py` imports torch_xla, gets the
16-device mesh and exits. Emulated hosts share the {os.cpu_count()} cores, so every emulated host's torch_xla
import competes with the others'.

| what | seconds | vs anchor |
| --- | ---: | ---: |
| floor: `python noop.py` in one process, same device count | {rows['floor']:.1f} | {rows['floor'] / rows['anchor']:.2f} |
| emulation floor: 4 x `python noop.py` at once (what 4 emulated hosts must do on {os.cpu_count()} cores) | {rows['floor4']:.1f} | {rows['floor4'] / rows['anchor']:.2f} |
| cold: `tpulaunch run noop.py --topology 2x8` (starts and stops a 4-node Ray cluster) | {rows['cold']:.1f} | {rows['cold'] / rows['anchor']:.2f} |
| warm: the same with `--address auto` on a cluster already up | {rows['warm']:.1f} | {rows['warm'] / rows['anchor']:.2f} |
| anchor: Ray Train `TorchTrainer`, 4 workers, same no-op (one Ray node) | {rows['anchor']:.1f} | 1.00 |
| `tpulaunch cluster up --topology 2x8` (once) | {rows['cluster_up']:.1f} | |

Warm launch minus floor: {rows['warm'] - rows['floor']:.1f} s; minus the emulation floor: {rows['warm'] - rows['floor4']:.1f} s
(the launcher's own cost: driver start, Ray connect, one Ray actor per host).
Cold minus warm ({rows['cold'] - rows['warm']:.1f} s) is starting and stopping the 4-node Ray cluster.
"""


def step_section(ctx: dict) -> str:
    env, logs = ctx["env"], ctx["logs"]
    print("bench: step time, 1-host slice (2x4, 8 devices): direct vs tpulaunch", file=sys.stderr)
    step_args = ["--", "--steps", "25"]
    _, out_direct = timed([PY, str(HERE / "step_time.py"), "--steps", "25"],
                          {**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "BENCH_TOPOLOGY": "2x4"})
    _, out_tl = timed([*TL, "run", str((HERE / "step_time.py").relative_to(REPO)), "--topology", "2x4", *logs, *step_args], env)

    def step(out: str) -> float:
        m = re.search(r"STEP_TIME (\{.*\})", out)
        if not m:
            raise SystemExit("bench: no STEP_TIME in output:\n" + out[-2000:])
        return json.loads(m.group(1))["mean_s"]

    direct, tl = step(out_direct), step(out_tl)
    return f"""## Step time (2D transformer recipe, 25 steps, first 5 dropped)

Measured on {datetime.date.today().isoformat()}.

| how | s/step | ratio |
| --- | ---: | ---: |
| directly, one process, 2x4 (8 CPU devices) | {direct:.3f} | 1.00 |
| `tpulaunch run` on an emulated 2x4 (1 host, 8 devices) | {tl:.3f} | {tl / direct:.3f} |
"""


def scaling_section(ctx: dict) -> str:
    env, logs, noop = ctx["env"], ctx["logs"], ctx["noop"]
    scaling = {}
    shapes = ((1, "v6e 2x4", ["--topology", "2x4"]), (2, "v4 2x2x2", ["--topology", "2x2x2", "--accelerator", "v4"]),
              (4, "v6e 2x8", ["--topology", "2x8"]), (8, "v6e 4x8", ["--topology", "4x8"]))
    for hosts, _name, topo in shapes:
        print(f"bench: cold launch, {hosts} emulated host(s)", file=sys.stderr)
        scaling[hosts] = timed([*TL, "run", noop, *topo, *logs], env)[0]
    return f"""## Launch time vs emulated hosts (cold, one run each)

Measured on {datetime.date.today().isoformat()}.

| hosts | topology | seconds |
| ---: | --- | ---: |
""" + "".join(f"| {h} | {name} | {scaling[h]:.1f} |\n" for h, name, _ in shapes)


SECTIONS = {"planning": planning_section, "launch": launch_section, "steps": step_section, "scaling": scaling_section}
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
    done = {name: SECTIONS[name](ctx) for name in SECTIONS if name in wanted}
    print(write(Path(args.out), done))


if __name__ == "__main__":
    main()

"""Recovery with and without a spare slice: one preemption, and one hang, in interleaved pairs.

Preemption, on the fake Cloud TPU API with the head here: two spot v4-8 slices (one host each),
`cluster up --tpu A --tpu B --head local` with or without `--spare-slices 1` (the spare made through
a queued resource by `cluster up`), a detached run on A and B (`--num-slices 2 --dcn data=2
--recreate --max-preemptions 1`, 0.3 s steps, a save every 2 steps), B preempted at step 8. Without a
spare the run waits for B to be made again (the fake API's waits are the suite's: 0.2 s and 0.3 s;
a real re-creation takes minutes); with one, the spare takes B's place at once and B is made again in
the background. Recovery: from the loss to the next attempt's first step (`tpulaunch goodput`); the
fake API's part: deleting, creating and provisioning B again; tpulaunch's overhead: the rest.

Hang, on an emulated cluster (`cluster up --topology 2x2x2 --accelerator v4 --num-slices 2` with or without
`--spare-slices 1`): a 2-slice run of 2 hosts a slice whose host 3 blocks in its input in attempt 0
(`--stall-timeout 20 --max-restarts 1 --replace-hung`; 20 s: a loaded 2-core machine can take 10 s to import torch). From the stall being declared to the
restarted attempt's first step: the hung slice made again (its hosts stopped and started, as a VM is
replaced), or a spare in its place.

Pairs run in turn, the order flipped each pair (A B, B A, ...), so drift on this noisy machine
falls on both sides.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from fakecloud import cloud, step_script
from fakes import cli_env, run_cli

SLICES, PREEMPT_AT, STEPS = ("sp-a", "sp-b"), 8, 60
STEP_SCRIPT = step_script(STEPS, per_host=False)
HANG_SCRIPT = """\
import json, os, time
import torch
import torch.distributed as dist
import tpulaunch

dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TPULAUNCH_RESTART_COUNT"])
ckpt = os.path.join(os.environ["CKPT_DIR"], "step.json")
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
while step < 12:
    if attempt == 0 and rank == 3 and step == 5:
        while True:  # host 3's input never returns
            time.sleep(0.5)
    x = torch.ones(4) * step
    dist.all_reduce(x)
    step += 1
    tpulaunch.heartbeat(step=step)
    if step % 2 == 0:
        if rank == 0:
            with open(ckpt + ".tmp", "w") as f:
                json.dump({"step": step}, f)
            os.replace(ckpt + ".tmp", ckpt)
        tpulaunch.heartbeat(step=step, checkpoint=True)
    dist.barrier()
"""


def preemption(spare: bool) -> dict:
    """One run of the preemption scenario: its recovery, the fake API's part of it, and the swap."""
    with cloud("spares") as c:
        c.up(SLICES, *(["--spare-slices", "1"] if spare else []))
        try:
            good, final = c.preempted_run(STEP_SCRIPT, at_step=PREEMPT_AT, preempt=SLICES[1])
        finally:
            c.down()
    a0 = final["attempts"][0]
    rec = (a0.get("recreated") or [{}])[0].get("steps", {})
    api_s = sum(rec.get(k, 0.0) for k in ("delete_s", "create_s", "provision_s"))
    recovery = good["attempts"][1].get("recovery_s", 0.0)
    return {"spare": spare, "run_id": final["run_id"], "recovery_s": recovery, "api_s": api_s, "overhead_s": recovery - api_s,
            "swap_s": sum(r["seconds"] for r in a0.get("replaced", [])), "how": [r["how"] for r in a0.get("replaced", [])],
            "outcomes": [a["outcome"] for a in final["attempts"]], "goodput": good["goodput"], "wall_s": good["wall_s"]}


def hang(spare: bool) -> dict:
    """One run of the hang scenario on an emulated cluster: from the stall to the next first step."""
    base = Path(tempfile.mkdtemp(prefix="tpl-bench-hang-"))
    env = cli_env(base / "home", TPULAUNCH_HOME=str(base / "tplhome"))

    def cli(*args: str, timeout: float = 600, check: bool = True):  # noqa: ANN202
        proc = run_cli(*args, env=env, cwd=base, timeout=timeout)
        if check and proc.returncode != 0:
            raise SystemExit(f"bench spares: `tpulaunch {' '.join(args[:3])}` exit {proc.returncode}: "
                             f"{proc.stderr[-2000:]}")
        return proc

    cli("cluster", "up", "--topology", "2x2x2", "--accelerator", "v4", "--num-slices", "2", "--prewarm", "none",
        *(["--spare-slices", "1"] if spare else []))
    try:
        (base / "hang.py").write_text(HANG_SCRIPT)
        (base / "ckpt").mkdir()
        run = cli("run", "hang.py", "--address", "auto", "--topology", "2x2x2", "--accelerator", "v4", "--num-slices",
                  "2", "--dcn", "data=2", "--framework", "none", "--stall-timeout", "20", "--max-restarts", "1",
                  "--replace-hung", "--env", f"CKPT_DIR={base / 'ckpt'}", "--json")
        s = json.loads(run.stdout)
        good = json.loads(cli("goodput", "last", "--json").stdout)
    finally:
        cli("cluster", "down", timeout=240, check=False)
    a0 = s["attempts"][0]
    return {"spare": spare, "recovery_s": good["attempts"][1].get("recovery_s", 0.0),
            "replace_s": sum(r["seconds"] for r in a0.get("replaced", [])), "how": [r["how"] for r in a0["replaced"]],
            "culprits": a0["hang"]["culprits"], "outcomes": [a["outcome"] for a in s["attempts"]]}


def interleaved(fn, pairs: int) -> dict[bool, list[dict]]:  # noqa: ANN001
    """`pairs` runs each without and with a spare, the order flipped each pair."""
    out: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(pairs):
        for spare in ((False, True) if i % 2 == 0 else (True, False)):
            out[spare].append(fn(spare))
    return out


def measure(pairs: int = 2) -> dict:
    pre = interleaved(preemption, pairs)
    hung = interleaved(hang, pairs)
    ratios = [w["recovery_s"] / max(1e-9, s["recovery_s"]) for w, s in zip(pre[False], pre[True])]
    return {"preemption": pre, "hang": hung, "pair_ratios": ratios,
            "median": {k: statistics.median(r["overhead_s"] for r in v) for k, v in pre.items()}}


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 1), indent=1))

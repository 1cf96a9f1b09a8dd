"""A hang traced to the host that caused it, its slice replaced, and the run back from its checkpoint.

An emulated 2-slice run (2 hosts a slice) whose host 3 blocks in its input before the step's
all_reduce, in attempt 0 only, while the other three wait in the all_reduce (torch.distributed over
gloo, the script's own group). `--stall-timeout` takes every host's stacks; the triage names host 3
and where it is, and the others in the collective; `--replace-hung` makes host 3's slice again (an
emulated slice's hosts are stopped and started again, as a TPU VM is replaced); the next attempt
resumes from the checkpoint and the run ends 0. The script imports nothing of tpulaunch's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support import cli_env, run_cli, write_scripts

pytestmark = pytest.mark.lifecycle

SCRIPT = """\
import json, os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # MASTER_ADDR, RANK, WORLD_SIZE as on any multi-host launch
rank, attempt = dist.get_rank(), int(os.environ["TPULAUNCH_RESTART_COUNT"])
ckpt = os.path.join(os.environ["CKPT_DIR"], "step.json")
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
print(f"attempt {attempt} host {rank} starts at step {step}", flush=True)


def load_batch(step):  # the input pipeline: on host 3, in attempt 0, it never returns
    if attempt == 0 and rank == 3 and step == 5:
        while True:
            time.sleep(0.5)
    return torch.ones(4) * step


while step < 10:
    x = load_batch(step)
    dist.all_reduce(x)  # the step's collective: the others wait here for host 3
    step += 1
    print(f"host {rank} step {step} sum {x[0].item():.0f}", flush=True)
    if step % 2 == 0 and rank == 0:
        with open(ckpt + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
print(f"host {rank} done at step {step}", flush=True)
"""


def test_a_hang_names_its_culprit_replaces_its_slice_and_the_run_resumes(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    write_scripts(work, {"hang_probe.py": SCRIPT})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    logs = tmp_path / "runs"
    env = cli_env(TPULAUNCH_HOME=str(tmp_path / "home"))
    proc = run_cli("run", "hang_probe.py", "--topology", "2x2x2", "--accelerator", "v5p", "--num-slices", "2",
                   "--dcn", "data=2", "--framework", "none", "--stall-timeout", "20", "--max-restarts", "1",
                   "--replace-hung", "--env", f"CKPT_DIR={ckpt}", "--log-dir", str(logs), "--json",
                   env=env, cwd=work, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    s = json.loads(proc.stdout)
    a0, a1 = s["attempts"]
    assert a0["outcome"] == "stalled" and a1["outcome"] == "ok" and s["restarts"] == 1
    hang = a0["hang"]
    assert hang["culprits"] == [3] and hang["slices"] == [1]
    assert re.fullmatch(r"load_batch \(hang_probe\.py:1[45]\)", hang["where"]), hang
    assert hang["others"].startswith("all_reduce (distributed_c10d.py:"), hang
    assert re.match(r"hang: host 3 \(slice 1 worker 1\) is in load_batch \(hang_probe\.py:1[45]\); the other 3 wait"
                    r" in all_reduce \(distributed_c10d\.py:\d+\)", hang["line"]), hang["line"]
    assert hang["line"] in proc.stderr
    assert [(r["slice"], r["how"]) for r in a0["replaced"]] == [(s["slices"][1]["name"], "made again")]
    # every host's stacks of the hung attempt are kept, each saying where that host was
    for h in a0["hosts"]:
        stacks = Path(h["stacks"]).read_text()
        assert ("load_batch" in stacks) == (h["process_index"] == 3), stacks[:500]
        assert Path(h["stacks"]).parent == Path(a0["log_dir"])
    out = proc.stderr
    resumed = sorted(int(m) for m in re.findall(r"attempt 1 host \d starts at step (\d+)", out))
    assert len(resumed) == 4 and resumed[0] == resumed[-1] == 4, out[-3000:]  # the checkpoint of step 4
    assert all(f"host {r} done at step 10" in out for r in range(4))

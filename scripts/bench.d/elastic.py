"""The gain of elastic multislice: one preemption, with `--min-slices 2` (wait for the slice) and `--min-slices 1`.

On the fake Cloud TPU API with the head here: two spot v4-8 slices (one host each), `cluster up --tpu A
--tpu B --head local`, a detached run with `--num-slices 2 --dcn data=2 --recreate --max-preemptions 1`
whose script steps every 0.3 s to step 200 and saves every 2 steps (`heartbeat(step=N,
checkpoint=True)`); slice B is preempted at step 10. The fake API takes PROVISION_S to provision a
slice again (a real re-creation takes minutes; this keeps the bench short while the wait is long
enough to matter). With `--min-slices 2` the run waits for B and relaunches on both; with
`--min-slices 1` it goes on on A at once and grows back at the first checkpoint after B is back.
Goodput and wall time of each, from `tpulaunch goodput`.
"""

from __future__ import annotations

import json
import uuid

from fakecloud import ZONE, cloud, step_script
from fakes import closed_port

SLICES, PROVISION_S, STEPS = ("el-a", "el-b"), 20.0, 200
SCRIPT = step_script(STEPS, per_host=False)


def scenario(min_slices: int) -> dict:
    with cloud("elastic", provision_s=PROVISION_S) as c:
        for name in SLICES:
            c.cli("slice", "create", name, "--accelerator", "v4-8", "--spot", "--wait", "--zone", ZONE, "--project", "p")
        c.cli("cluster", "up", "--tpu", SLICES[0], "--tpu", SLICES[1], "--zone", ZONE, "--project", "p", "--head",
              "local", "--head-ip", "127.0.0.2", "--port", str(closed_port()), "--ray-temp-dir",
              f"/tmp/tplr-{uuid.uuid4().hex[:8]}")
        try:
            (c.base / "train.py").write_text(SCRIPT)
            (c.base / "ckpt").mkdir()
            run_id = c.cli("run", "train.py", "--address", "auto", "--framework", "none", "--detach", "--recreate",
                           "--num-slices", "2", "--dcn", "data=2", "--min-slices", str(min_slices),
                           "--max-preemptions", "1", "--preemption-wait", "300",
                           "--env", f"CKPT_DIR={c.base / 'ckpt'}").strip()
            c.wait_for_step(run_id, 10)
            c.preempt(SLICES[1])
            c.cli("wait", run_id, timeout=900)
            good = json.loads(c.cli("goodput", run_id, "--json"))
            final = json.loads(c.cli("status", run_id, "--json"))
        finally:
            c.down()
    return {"min_slices": min_slices, "run_id": run_id, "goodput": good["goodput"], "wall_s": good["wall_s"],
            "buckets": good["buckets"], "attempts": [(a["outcome"], a.get("reason")) for a in final["attempts"]]}


def measure() -> list[dict]:
    return [scenario(2), scenario(1)]


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))

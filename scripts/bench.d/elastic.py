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

from fakecloud import cloud, step_script

SLICES, PROVISION_S, STEPS = ("el-a", "el-b"), 20.0, 200
SCRIPT = step_script(STEPS, per_host=False)


def scenario(min_slices: int) -> dict:
    with cloud("elastic", provision_s=PROVISION_S) as c:
        c.up(SLICES)
        try:
            good, final = c.preempted_run(SCRIPT, "--min-slices", str(min_slices), at_step=10, preempt=SLICES[1])
        finally:
            c.down()
    return {"min_slices": min_slices, "run_id": final["run_id"], "goodput": good["goodput"], "wall_s": good["wall_s"],
            "buckets": good["buckets"], "attempts": [(a["outcome"], a.get("reason")) for a in final["attempts"]]}


def measure() -> list[dict]:
    return [scenario(2), scenario(1)]


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))

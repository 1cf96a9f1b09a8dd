"""Recovery through preemptions, on the fake Cloud TPU API with the Ray head here (off the slice).

A spot v4-16 (2 hosts) made with `slice create --spot --wait`, `cluster up --tpu --head local`, a
detached run with `--recreate --max-preemptions 3` whose script steps every 0.3 s and saves every
2 steps (`heartbeat(step=N, checkpoint=True)`); the slice is preempted three times (the fake's
control endpoint, as Google Cloud preempts a spot slice). Per preemption: the recovery (from the
failure to the next attempt's first step, `tpulaunch goodput`) and, of it, what the fake API took to
delete, create and provision the slice again; tpulaunch's own overhead is the difference. And the
run's goodput. The fake's provisioning waits are the test suite's (0.2 s / 0.3 s).
"""

from __future__ import annotations

import json
import uuid

from fakecloud import ZONE, cloud, step_script
from fakes import closed_port

NAME, PREEMPTIONS = "bench-v4", 3
SCRIPT = step_script(60, per_host=True)


def measure() -> dict:
    with cloud("recovery") as c:
        c.cli("slice", "create", NAME, "--accelerator", "v4-16", "--spot", "--wait", "--zone", ZONE, "--project", "p")
        c.cli("cluster", "up", "--tpu", NAME, "--zone", ZONE, "--project", "p", "--head", "local", "--head-ip",
              "127.0.0.2", "--port", str(closed_port()), "--ray-temp-dir", f"/tmp/tplr-{uuid.uuid4().hex[:8]}")
        try:
            (c.base / "train.py").write_text(SCRIPT)
            (c.base / "ckpt").mkdir()
            run_id = c.cli("run", "train.py", "--address", "auto", "--framework", "none", "--detach", "--recreate",
                           "--max-preemptions", str(PREEMPTIONS), "--preemption-wait", "300",
                           "--env", f"CKPT_DIR={c.base / 'ckpt'}").strip()
            for k in range(PREEMPTIONS):
                c.wait_for_step(run_id, 4 * (k + 1), attempt=k)  # preempt once this attempt has made 4 steps
                c.preempt(NAME)
            c.cli("wait", run_id, timeout=900)
            good = json.loads(c.cli("goodput", run_id, "--json"))
            final = json.loads(c.cli("status", run_id, "--json"))
        finally:
            c.down()
    rows = []
    for a_prev, a in zip(final["attempts"], good["attempts"][1:]):
        rec = (a_prev.get("recreated") or [{}])[0].get("steps", {})
        api_s = sum(rec.get(k, 0.0) for k in ("delete_s", "create_s", "provision_s"))
        rows.append({"recovery_s": a.get("recovery_s", 0.0), "api_s": api_s, "setup_join_s": rec.get("setup_join_s", 0.0),
                     "overhead_s": a.get("recovery_s", 0.0) - api_s})
    return {"run_id": run_id, "rows": rows, "goodput": good["goodput"], "wall_s": good["wall_s"],
            "buckets": good["buckets"]}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))

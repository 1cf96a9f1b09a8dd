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
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from fakes import closed_port, cli_env, run_cli  # noqa: E402
from fakes.tpu_api_server import FakeTpuApi  # noqa: E402

ZONE, SLICES, PROVISION_S, STEPS = "us-central2-b", ("el-a", "el-b"), 20.0, 200
SCRIPT = f"""\
import json, os, time
import tpulaunch

ctx = tpulaunch.context()
ckpt = os.path.join(os.environ["CKPT_DIR"], "step.json")
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
while step < {STEPS}:
    time.sleep(0.3)
    step += 1
    tpulaunch.heartbeat(step=step)
    if step % 2 == 0:
        if ctx.process_index == 0:
            with open(ckpt + ".tmp", "w") as f:
                json.dump({{"step": step}}, f)
            os.replace(ckpt + ".tmp", ckpt)
        tpulaunch.heartbeat(step=step, checkpoint=True)
"""


def scenario(min_slices: int) -> dict:
    base = Path(tempfile.mkdtemp(prefix="tpl-bench-elastic-"))
    slices = base / "slices.json"
    with FakeTpuApi(wait_s=0.2, provision_s=PROVISION_S, suspend_s=0.5, gcloud_slices=str(slices)) as api:
        env = cli_env(base / "home", gcloud=True, TPULAUNCH_HOME=str(base / "tplhome"),
                      TPULAUNCH_TPU_API_ENDPOINT=api.url, FAKE_GCLOUD_LOG=str(base / "gcloud.log"),
                      FAKE_GCLOUD_SLICES=str(slices), RAY_health_check_period_ms="1000",
                      RAY_health_check_failure_threshold="3")

        def cli(*args: str, timeout: float = 600) -> str:
            proc = run_cli(*args, env=env, cwd=base, timeout=timeout)
            if proc.returncode != 0:
                raise SystemExit(f"bench elastic: `tpulaunch {' '.join(args[:3])}` exit {proc.returncode}: "
                                 f"{proc.stderr[-2000:]}")
            return proc.stdout

        for name in SLICES:
            cli("slice", "create", name, "--accelerator", "v4-8", "--spot", "--wait", "--zone", ZONE, "--project", "p")
        cli("cluster", "up", "--tpu", SLICES[0], "--tpu", SLICES[1], "--zone", ZONE, "--project", "p", "--head",
            "local", "--head-ip", "127.0.0.2", "--port", str(closed_port()), "--ray-temp-dir",
            f"/tmp/tplr-{uuid.uuid4().hex[:8]}")
        try:
            (base / "train.py").write_text(SCRIPT)
            (base / "ckpt").mkdir()
            run_id = cli("run", "train.py", "--address", "auto", "--framework", "none", "--detach", "--recreate",
                         "--num-slices", "2", "--dcn", "data=2", "--min-slices", str(min_slices),
                         "--max-preemptions", "1", "--preemption-wait", "300",
                         "--env", f"CKPT_DIR={base / 'ckpt'}").strip()
            while True:
                st = json.loads(cli("status", run_id, "--json"))
                if st["state"] == "running" and all((h["step"] or 0) >= 10 for h in st["hosts"]):
                    break
                time.sleep(0.3)
            req = urllib.request.Request(api.url + "/_fake/preempt", data=json.dumps({"node": SLICES[1]}).encode(),
                                         method="POST")
            urllib.request.urlopen(req, timeout=30).read()
            cli("wait", run_id, timeout=900)
            good = json.loads(cli("goodput", run_id, "--json"))
            final = json.loads(cli("status", run_id, "--json"))
        finally:
            run_cli("cluster", "down", env=env, cwd=base, timeout=120)
    return {"min_slices": min_slices, "run_id": run_id, "goodput": good["goodput"], "wall_s": good["wall_s"],
            "buckets": good["buckets"], "attempts": [(a["outcome"], a.get("reason")) for a in final["attempts"]]}


def measure() -> list[dict]:
    return [scenario(2), scenario(1)]


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))

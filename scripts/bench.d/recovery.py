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

ZONE, NAME, PREEMPTIONS = "us-central2-b", "bench-v4", 3
SCRIPT = """\
import json, os, time
import tpulaunch

ctx = tpulaunch.context()
ckpt = os.path.join(os.environ["CKPT_DIR"], f"host-{ctx.process_index}.json")
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
while step < 60:
    time.sleep(0.3)
    step += 1
    tpulaunch.heartbeat(step=step)
    if step % 2 == 0:
        with open(ckpt + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(ckpt + ".tmp", ckpt)
        tpulaunch.heartbeat(step=step, checkpoint=True)
"""


def measure() -> dict:
    base = Path(tempfile.mkdtemp(prefix="tpl-bench-recovery-"))
    slices = base / "slices.json"
    with FakeTpuApi(wait_s=0.2, provision_s=0.3, suspend_s=0.5, gcloud_slices=str(slices)) as api:
        env = cli_env(base / "home", gcloud=True, TPULAUNCH_HOME=str(base / "tplhome"),
                      TPULAUNCH_TPU_API_ENDPOINT=api.url, FAKE_GCLOUD_LOG=str(base / "gcloud.log"),
                      FAKE_GCLOUD_SLICES=str(slices), RAY_health_check_period_ms="1000",
                      RAY_health_check_failure_threshold="3")

        def cli(*args: str, timeout: float = 300) -> dict | str:
            proc = run_cli(*args, env=env, cwd=base, timeout=timeout)
            if proc.returncode != 0:
                raise SystemExit(f"bench recovery: `tpulaunch {' '.join(args[:3])}` exit {proc.returncode}: "
                                 f"{proc.stderr[-2000:]}")
            return proc.stdout

        def preempt() -> None:
            req = urllib.request.Request(api.url + "/_fake/preempt", data=json.dumps({"node": NAME}).encode(),
                                         method="POST")
            urllib.request.urlopen(req, timeout=30).read()

        cli("slice", "create", NAME, "--accelerator", "v4-16", "--spot", "--wait", "--zone", ZONE, "--project", "p")
        cli("cluster", "up", "--tpu", NAME, "--zone", ZONE, "--project", "p", "--head", "local", "--head-ip",
            "127.0.0.2", "--port", str(closed_port()), "--ray-temp-dir", f"/tmp/tplr-{uuid.uuid4().hex[:8]}")
        try:
            (base / "train.py").write_text(SCRIPT)
            (base / "ckpt").mkdir()
            run_id = str(cli("run", "train.py", "--address", "auto", "--framework", "none", "--detach", "--recreate",
                             "--max-preemptions", str(PREEMPTIONS), "--preemption-wait", "300",
                             "--env", f"CKPT_DIR={base / 'ckpt'}")).strip()
            for k in range(PREEMPTIONS):
                # preempt once this attempt has made 4 steps
                while True:
                    st = json.loads(cli("status", run_id, "--json"))
                    if st["attempt"] == k and st["state"] == "running" and all((h["step"] or 0) >= 4 * (k + 1)
                                                                                for h in st["hosts"]):
                        break
                    time.sleep(0.5)
                preempt()
            cli("wait", run_id, timeout=900)
            good = json.loads(cli("goodput", run_id, "--json"))
            final = json.loads(cli("status", run_id, "--json"))
        finally:
            run_cli("cluster", "down", env=env, cwd=base, timeout=120)
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

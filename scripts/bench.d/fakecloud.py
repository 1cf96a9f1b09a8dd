"""What the recovery benches share: the fake Cloud TPU API and fake gcloud of the test suite
(tests/fakes: every worker runs on this machine), the CLI run against them, and the script they step.

`cloud(prefix, provision_s)` yields a `Cloud`: its directory, the fake API, the CLI's environment,
`cli(...)` (stdout; a failed command ends the bench saying which), `preempt(node)` (Google
Cloud's preemption of a spot slice, through the fake's control endpoint), `up(slices)` (the slices
and a cluster over them, its head here) and `preempted_run(...)` (the scenario both benches time).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from fakes import cli_env, closed_port, run_cli  # noqa: E402
from fakes.tpu_api_server import FakeTpuApi  # noqa: E402

ZONE = "us-central2-b"


def step_script(steps: int, *, per_host: bool) -> str:
    """A script that steps every 0.3 s to `steps`, reports each step and saves every 2 (a file per
    host, or one that host 0 writes), and resumes from its save."""
    name = 'f"host-{ctx.process_index}.json"' if per_host else '"step.json"'
    save = "True" if per_host else "ctx.process_index == 0"
    return f"""\
import json, os, time
import tpulaunch

ctx = tpulaunch.context()
ckpt = os.path.join(os.environ["CKPT_DIR"], {name})
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
while step < {steps}:
    time.sleep(0.3)
    step += 1
    tpulaunch.heartbeat(step=step)
    if step % 2 == 0:
        if {save}:
            with open(ckpt + ".tmp", "w") as f:
                json.dump({{"step": step}}, f)
            os.replace(ckpt + ".tmp", ckpt)
        tpulaunch.heartbeat(step=step, checkpoint=True)
"""


@dataclass
class Cloud:
    base: Path
    api: FakeTpuApi
    env: dict[str, str]
    cli: Callable[..., str]

    def preempt(self, node: str) -> None:
        req = urllib.request.Request(self.api.url + "/_fake/preempt", data=json.dumps({"node": node}).encode(),
                                     method="POST")
        urllib.request.urlopen(req, timeout=30).read()

    def wait_for_step(self, run_id: str, step: int, attempt: int | None = None) -> None:
        """Until every host of the run (of `attempt`, if given) has reported `step`."""
        while True:
            st = json.loads(self.cli("status", run_id, "--json"))
            if (st["state"] == "running" and (attempt is None or st["attempt"] == attempt)
                    and all((h["step"] or 0) >= step for h in st["hosts"])):
                return
            time.sleep(0.3)

    def down(self) -> None:
        run_cli("cluster", "down", env=self.env, cwd=self.base, timeout=240)

    def up(self, slices: tuple[str, ...], *extra: str) -> None:
        """Spot v4-8 slices (one host each) made through the fake API, and one Ray cluster over them
        with its head here (`cluster up --tpu A --tpu B --head local`; `extra` flags added)."""
        for name in slices:
            self.cli("slice", "create", name, "--accelerator", "v4-8", "--spot", "--wait", "--zone", ZONE,
                     "--project", "p")
        tpus = [w for name in slices for w in ("--tpu", name)]
        self.cli("cluster", "up", *tpus, "--zone", ZONE, "--project", "p", "--head", "local", "--head-ip",
                 "127.0.0.2", "--port", str(closed_port()), "--ray-temp-dir", f"/tmp/tplr-{uuid.uuid4().hex[:8]}",
                 *extra)

    def preempted_run(self, script: str, *flags: str, at_step: int, preempt: str) -> tuple[dict, dict]:
        """A detached 2-slice `--recreate` run of `script` (checkpoints in ckpt/; `flags` added), slice
        `preempt` preempted once every host reached `at_step`: its goodput and final status, once
        it ended."""
        (self.base / "train.py").write_text(script)
        (self.base / "ckpt").mkdir()
        run_id = self.cli("run", "train.py", "--address", "auto", "--framework", "none", "--detach", "--recreate",
                          "--num-slices", "2", "--dcn", "data=2", "--max-preemptions", "1", "--preemption-wait",
                          "300", "--env", f"CKPT_DIR={self.base / 'ckpt'}", *flags).strip()
        self.wait_for_step(run_id, at_step)
        self.preempt(preempt)
        self.cli("wait", run_id, timeout=900)
        return json.loads(self.cli("goodput", run_id, "--json")), json.loads(self.cli("status", run_id, "--json"))


@contextmanager
def cloud(prefix: str, provision_s: float = 0.3) -> Iterator[Cloud]:
    """The fakes, with the suite's waits (0.2 s to accept, `provision_s` to provision a slice), and
    Ray's health checks at 1 s x 3 as a deployment may set them (a dead VM's node is seen sooner)."""
    base = Path(tempfile.mkdtemp(prefix=f"tpl-bench-{prefix}-"))
    slices = base / "slices.json"
    with FakeTpuApi(wait_s=0.2, provision_s=provision_s, suspend_s=0.5, gcloud_slices=str(slices)) as api:
        env = cli_env(base / "home", gcloud=True, TPULAUNCH_HOME=str(base / "tplhome"),
                      TPULAUNCH_TPU_API_ENDPOINT=api.url, FAKE_GCLOUD_LOG=str(base / "gcloud.log"),
                      FAKE_GCLOUD_SLICES=str(slices), RAY_health_check_period_ms="1000",
                      RAY_health_check_failure_threshold="3")

        def cli(*args: str, timeout: float = 600) -> str:
            proc = run_cli(*args, env=env, cwd=base, timeout=timeout)
            if proc.returncode != 0:
                raise SystemExit(f"bench {prefix}: `tpulaunch {' '.join(args[:3])}` exit {proc.returncode}: "
                                 f"{proc.stderr[-2000:]}")
            return proc.stdout

        yield Cloud(base, api, env, cli)

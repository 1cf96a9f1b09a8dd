"""A warm host's spare (`host/spare.py`) for real: processes, fds and re-parenting, without Ray.

A small program plays the host agent (a child subreaper, as the agent is): it starts a spare,
has it fork two host processes for two runs of one script, and reports what each saw. The
spare imported NumPy before the forks (a `sitecustomize` on its PYTHONPATH, as torch and JAX
import it), so the forks show that its global generator is seeded afresh in each.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from support import REPO, cli_env

AGENT = r"""
import json, os, pickle, sys, tempfile
from tpulaunch import procfs
from tpulaunch.host.spare import Adopted, Spare
from tpulaunch.plan import mesh as M, topology as T
from tpulaunch.plan.launch import build_plan
from tpulaunch.plan.slicespec import SliceSpec

work, site = sys.argv[1], sys.argv[2]
assert procfs.become_subreaper()
env = {**os.environ, "PYTHONPATH": site, "SPARE_MARK": "static"}
spare = Spare("none", env, cwd="/")
assert spare.ready(120), "the spare never imported"
out = {"spare": spare.pid, "agent": os.getpid(), "runs": []}
for k in range(2):
    mesh = M.plan_mesh(T.resolve("v6e-4"))
    state = build_plan(slices=[SliceSpec.emulated_from(mesh.topology, "s")], mesh=mesh, script=os.path.join(work, "probe.py"),
                       args=[f"arg{k}"], framework="none", run_id=f"run{k}", coordinator_port=1, emulated=True,
                       log_dir=work, workdir=work).state(0)
    fd, path = tempfile.mkstemp(dir=work)
    with os.fdopen(fd, "wb") as f:
        pickle.dump(state, f)
    pid, fds = spare.fork(path, {**env, "TPULAUNCH_RUN_ID": f"run{k}"}, work, 30)
    host = Adopted(pid)
    text = b"".join(os.read(fd, 1 << 20) for fd in fds).decode()  # the script is short: one read each
    for fd in fds:
        os.close(fd)
    out["runs"].append({"pid": pid, "code": host.wait(60), "said": text})
out["spare_alive"] = spare.alive
spare.close()
out["spare_code"] = spare.proc.returncode
print("AGENT " + json.dumps(out))
"""

PROBE = """
import json, os, random, sys
import numpy
print("PROBE " + json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "path": sys.path[:2],
                            "argv": sys.argv[1:], "run": os.environ.get("TPULAUNCH_RUN_ID"),
                            "mark": os.environ.get("SPARE_MARK"), "np": int(numpy.random.randint(2**31)),
                            "py": random.random()}), flush=True)
sys.exit(3 if sys.argv[1] == "arg1" else 0)
"""


def test_a_spare_forks_each_runs_host_process_as_the_agents_child_with_the_runs_own_world(tmp_path):
    work, site = tmp_path / "work", tmp_path / "site"
    work.mkdir()
    site.mkdir()
    (work / "probe.py").write_text(textwrap.dedent(PROBE))
    (site / "sitecustomize.py").write_text("import numpy.random\n")
    proc = subprocess.run([sys.executable, "-c", AGENT, str(work), str(site)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("AGENT ", 1)[1])
    seen = [json.loads(r["said"].split("PROBE ", 1)[1].splitlines()[0]) for r in out["runs"]]
    assert [r["code"] for r in out["runs"]] == [0, 3]  # each exit code reaches the agent, which waited for it
    for k, s in enumerate(seen):
        assert s["pid"] == out["runs"][k]["pid"] and s["ppid"] == out["agent"], (s, out)  # the agent's child
        # the script's directory first, then the working directory (not the spare's, "/")
        assert s["cwd"] == str(work) and s["path"] == [str(work)] * 2 and s["argv"] == [f"arg{k}"]
        assert s["run"] == f"run{k}" and s["mark"] == "static"
    assert seen[0]["np"] != seen[1]["np"] and seen[0]["py"] != seen[1]["py"], seen  # seeded afresh
    assert out["spare_alive"] and out["spare_code"] == 0  # it served both, then left when let go

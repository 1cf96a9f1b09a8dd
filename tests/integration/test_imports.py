"""Planning loads no framework and no Ray: `--dry-run`, `mesh inspect` and the driver stay light.

A fresh interpreter is the only place to see what an import pulls in, so this is a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys

from support import REPO


def test_planning_and_the_adapters_load_no_framework_and_no_ray():
    plan_modules = sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                          for p in (REPO / "tpulaunch" / "plan").glob("*.py") if p.name != "__init__.py")
    assert "tpulaunch.plan.mesh" in plan_modules and "tpulaunch.plan.env" in plan_modules
    code = (
        "import importlib, json, sys\n"
        f"for m in {plan_modules!r}: importlib.import_module(m)\n"
        # a host that only unpickles its plan imports no numpy (the layout is computed where asked)
        "a0 = sorted(m for m in ('ray', 'torch', 'torch_xla', 'jax', 'numpy') if m in sys.modules)\n"
        "import tpulaunch.plan.mesh as M, tpulaunch.plan.topology as T\n"
        "p = M.plan_mesh(T.resolve('v4-32'), 'data=2,model=-1')\n"
        "import tpulaunch.plan.sharding as S; S.shard(p, (8, 8), ('data', 'model'))\n"
        "a = a0 + sorted(m for m in ('ray', 'torch', 'torch_xla', 'jax') if m in sys.modules)  # numpy: plan's one dependency\n"
        "import tpulaunch.host.frameworks.torch_xla, tpulaunch.host.frameworks.jax  # lazy: import nothing yet\n"
        "b = sorted(m for m in ('ray', 'torch', 'torch_xla', 'jax') if m in sys.modules)\n"
        "print(json.dumps([a, b]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[], []]


def test_importing_tpulaunch_or_ray_train_planning_imports_no_ray():
    code = ("import sys, tpulaunch; a = ['ray.train' in sys.modules, 'ray' in sys.modules]\n"
            "from tpulaunch.ray_train import plan_for_workers  # pure: ray_train/planning.py\n"
            "print(*a, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


def test_jax_trainers_config_imports_no_torch():
    """A JaxTrainer's driver, controller and workers import `tpulaunch.ray_train` (its backend and
    worker functions): none of them needs torch, and a JAX-only environment has none."""
    code = ("import sys\nfrom tpulaunch.ray_train import JaxSpmdConfig, plan_for_workers\nJaxSpmdConfig(mesh='data=2')\n"
            "a = 'torch' in sys.modules\nfrom tpulaunch.ray_train import XlaSpmdConfig\n"
            "print(a, 'torch' in sys.modules, XlaSpmdConfig().backend_cls.framework)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.split() == ["False", "True", "torch_xla"]

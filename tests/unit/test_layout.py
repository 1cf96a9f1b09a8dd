"""The package layout is the pipeline: plan -> discover / cluster / host -> run -> cli.

Read with `ast` (nothing is imported to check it): no import cycle among tpulaunch modules, and
each stage imports only the stages the README's "How it is built" table allows.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "tpulaunch"

# Which tpulaunch packages each stage may import (itself always; `tpulaunch.errors` everywhere).
ALLOWED = {
    "plan": set(),
    "discover": {"plan", "gcloud", "kube", "cloud_tpu"},
    "cluster": {"plan", "gcloud", "kube"},
    "host": {"plan", "discover"},  # discover.metadata: preemption notices
    "provision": {"plan", "discover", "cloud_tpu"},  # creates what discover reads, through the same Cloud TPU API client
    # where slices come from (emulated, TPU VMs, GKE): the seam run/ and cli/ ask, over the stages below it
    "providers": {"plan", "discover", "cluster", "provision", "gcloud", "kube", "cloud_tpu"},
    "run": {"plan", "discover", "cluster", "host", "provision", "providers"},
    "cli": {"plan", "discover", "cluster", "host", "run", "gcloud", "provision", "providers", "kube", "rehearse",
            "client"},
    # the Python API: the runner's seam and the run's records, as the CLI uses them
    "client": {"plan", "discover", "cluster", "run"},
    # `run --rehearse`: the plan's programs compiled for the target TPU, in a process that runs the script as a host does
    "rehearse": {"plan", "host"},
    "ray_train": {"plan", "discover", "cluster", "host"},  # Ray Train's backend: run's twin for trainers
}
# Below every stage: typed errors (plan too), and for the stages that do I/O the one reader of
# environment values (`settings`) and the one /proc reader and process stopper (`procfs`).
BASE = {"errors", "settings", "procfs"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, module_level_only: bool) -> set[str]:
    """Names of the modules a file imports; TYPE_CHECKING blocks never count."""
    tree = ast.parse(path.read_text())
    name = next(n for n, p in MODULES.items() if p == path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and _is_type_checking(node):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    found.add(sub if sub in MODULES else base)
            if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], (ast.stmt, ast.excepthandler)):
                    visit(inner)  # type: ignore[arg-type]

    visit(tree.body)
    return found


def test_the_checks_read_the_package():
    """Every check below reads tpulaunch's own files (a moved test once read none, and passed)."""
    assert {"tpulaunch", "tpulaunch.cli", "tpulaunch.run.launch", "tpulaunch.plan.mesh"} <= set(MODULES)
    assert set(ALLOWED) | BASE | {"client", "envvars", "kube", "gcloud", "cloud_tpu", "__main__"} >= {
        _stage(m) for m in MODULES if _stage(m)}, "a stage the layout does not know"


def test_no_import_cycle_among_tpulaunch_modules():
    graph = {m: sorted(i for i in _imports(p, module_level_only=True) if i in MODULES) for m, p in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


@pytest.mark.parametrize("stage", sorted(ALLOWED))
def test_each_stage_imports_only_what_the_layout_allows(stage):
    """Every import in the stage's files, module level or inside functions (not TYPE_CHECKING)."""
    allowed = ALLOWED[stage] | {stage} | (BASE if stage != "plan" else {"errors"})
    bad = []
    for m, p in MODULES.items():
        if _stage(m) != stage:
            continue
        for imp in _imports(p, module_level_only=False):
            if imp == "tpulaunch":
                bad.append(f"{m} imports tpulaunch (the root)")
            elif imp.startswith("tpulaunch.") and _stage(imp) not in allowed:
                bad.append(f"{m} imports {imp}")
    assert bad == []


def test_the_base_modules_import_only_errors():
    bad = [f"{m} imports {imp}" for m, p in MODULES.items() if _stage(m) in BASE
           for imp in _imports(p, module_level_only=False)
           if imp.startswith("tpulaunch") and _stage(imp) not in ("errors", _stage(m))]
    assert bad == []


def test_plan_imports_only_the_standard_library_and_numpy():
    third_party = []
    for m, p in MODULES.items():
        if _stage(m) != "plan":
            continue
        for imp in _imports(p, module_level_only=False):
            root = imp.split(".")[0]
            if root not in sys.stdlib_module_names and root not in ("numpy", "tpulaunch"):
                third_party.append(f"{m} imports {imp}")
    assert third_party == []


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The check itself can fail: two modules importing each other are reported."""
    pkg = tmp_path / "tpulaunch"
    (pkg / "plan").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "__init__.py").write_text("")
    (pkg / "plan" / "a.py").write_text("from tpulaunch.plan import b\n")
    (pkg / "plan" / "b.py").write_text("import tpulaunch.plan.a\nfrom tpulaunch.cli import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", _modules())
    with pytest.raises(pytest.fail.Exception, match="import cycle: tpulaunch.plan.a -> tpulaunch.plan.b -> tpulaunch.plan.a"):
        test_no_import_cycle_among_tpulaunch_modules()
    with pytest.raises(AssertionError, match="tpulaunch.cli"):
        test_each_stage_imports_only_what_the_layout_allows("plan")


def _closure(root: str) -> set[str]:
    """Every tpulaunch module importing `root` loads at module level (its packages' __init__ too)."""
    seen: set[str] = set()
    todo = [root]
    while todo:
        m = todo.pop()
        if m in seen or m not in MODULES:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # a module's packages load first
        todo += [i for i in _imports(MODULES[m], module_level_only=True) if i in MODULES]
    return seen


def test_a_scripts_import_tpulaunch_loads_no_launcher():
    """`import tpulaunch` in a launched script loads its context and the errors, not the client, the
    run's supervision or the cluster code (the client's names load on first use)."""
    heavy = sorted(m for m in _closure("tpulaunch") if _stage(m) in ("run", "cluster", "providers", "discover", "cli")
                   or m == "tpulaunch.client")
    assert heavy == []


def test_every_test_module_has_a_name_of_its_own():
    """pytest imports test modules by their base name (no packages under tests/): two files of one
    name in tests/unit and tests/integration stop the whole suite at collection."""
    seen: dict[str, list[str]] = {}
    for path in (PKG.parent / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(PKG.parent)))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}

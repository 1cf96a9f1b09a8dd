"""Sphinx configuration of tpulaunch's docs. Build them strictly with `./scripts/docs`
(`sphinx-build -W --keep-going -n -b html docs <out>`): any warning fails the build."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # tpulaunch itself, for autodoc and the generated reference

project = "tpulaunch"
author = "the tpulaunch authors"
copyright = "the tpulaunch authors"  # noqa: A001 - Sphinx's name
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "tpulaunch_docs",  # docs/_ext: the CLI reference, exit codes and variables, generated
]

root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = "tpulaunch"
html_theme_options = {"description": "Gang-launch SPMD training on every host of a Cloud TPU slice", "fixed_sidebar": True}
pygments_style = "sphinx"
highlight_language = "none"  # blocks say what they are (bash, python, console, text)

# Python API (autodoc + napoleon): Google docstrings, signatures with their types.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Each directive in api.rst names its members: what is documented is chosen there, page by page.

# Nitpicky (-n): every cross-reference must resolve. The exceptions, by name: MeshPlan's first
# field is the slice's Topology, a planning type (tpulaunch.plan.topology) that the API page does not
# document (its own fields lead on to the whole catalog); and the standard library's abstract
# collections the signatures name (the build is offline, without intersphinx: Sphinx resolves
# `typing`'s names itself, not `collections.abc`'s). Nothing else is ignored.
nitpick_ignore: list[tuple[str, str]] = [("py:class", "tpulaunch.plan.topology.Topology")] + [
    ("py:class", f"collections.abc.{name}") for name in ("Callable", "Iterable", "Iterator", "Mapping", "Sequence")]

"""The docs' generated pages stay true to the code, checked without running Sphinx.

* Every `TPULAUNCH_*` name in `tpulaunch/` is in the registry `tpulaunch/envvars.py` (which the
  environment page is generated from), and the registry lists nothing the code does not mention.
* The CLI reference (`tpulaunch.cli.reference`, which the docs' extension parses) has a section
  for every command of the Click tree and an entry for every one of its arguments and options.
* The exit codes page reads every `ExitCode` with its comment.

The strict Sphinx build itself is `./scripts/docs` (CI runs it after the tests).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tpulaunch import envvars
from tpulaunch.cli import reference
from tpulaunch.errors import ExitCode

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tpulaunch"
NAME = re.compile(r"TPULAUNCH_[A-Z_]+")
# Names of that shape that are no environment variable, each with why.
NOT_VARIABLES = {
    "TPULAUNCH_VERSIONS": "the marker of the line GKE's version check prints (providers/gke.py)",
}


def _code_text() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(PKG.rglob("*.py")) if p.name != "envvars.py"}


def _names_in_code() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path, text in _code_text().items():
        for name in set(NAME.findall(text)):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_tpulaunch_variable_the_code_names_is_in_the_registry():
    listed = {v.name for v in envvars.VARIABLES}
    missing = {name: where for name, where in _names_in_code().items()
               if name not in listed and name not in NOT_VARIABLES}
    assert missing == {}, "add these to tpulaunch/envvars.py (name, who, meaning): " + repr(missing)


def test_the_registry_lists_only_variables_the_code_mentions():
    text = "\n".join(_code_text().values())
    unknown = [v.name for v in envvars.VARIABLES if not re.search(rf"\b{re.escape(v.name)}\b", text)]
    assert unknown == [], f"tpulaunch/envvars.py lists variables nothing in tpulaunch/ mentions: {unknown}"
    assert not set(NOT_VARIABLES) & {v.name for v in envvars.VARIABLES}


def test_the_registry_is_one_entry_a_variable_each_said():
    names = [v.name for v in envvars.VARIABLES]
    assert len(names) == len(set(names)), "a variable listed twice"
    assert all(v.who.strip() and v.meaning.strip() for v in envvars.VARIABLES)


def test_the_registry_check_sees_a_missing_name(tmp_path, monkeypatch):
    """The check itself can fail: a name in the code that the registry lacks is reported."""
    pkg = tmp_path / "tpulaunch"
    pkg.mkdir()
    (pkg / "x.py").write_text('os.environ.get("TPULAUNCH_NOT_LISTED")\n')
    monkeypatch.setitem(globals(), "PKG", pkg)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="TPULAUNCH_NOT_LISTED"):
        test_every_tpulaunch_variable_the_code_names_is_in_the_registry()


# -- the CLI reference -------------------------------------------------------------------------------


def _tree() -> list[tuple[str, object]]:
    """(path, command) for every command of the Click tree, walked here, not by the generator."""
    out: list[tuple[str, object]] = []

    def walk(cmd: object, path: str) -> None:
        out.append((path, cmd))
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, f"{path} {name}")

    walk(reference.root_command(), "tpulaunch")
    return out


def _sections(text: str) -> dict[str, str]:
    """The generated reST split at each command's title (``tpulaunch ...`` over a line of dashes)."""
    parts = re.split(r"^``(tpulaunch[^`]*)``\n-+\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.fixture(scope="module")
def cli_text() -> str:
    return reference.commands_rst()


def test_the_cli_reference_has_a_section_for_every_command(cli_text):
    tree = _tree()
    sections = _sections(cli_text)
    assert [path for path, _ in tree] == list(sections), "a command missing from (or extra in) the reference"
    assert {"tpulaunch run", "tpulaunch cluster up", "tpulaunch cluster repair", "tpulaunch slice create",
            "tpulaunch mesh inspect"} <= set(sections)


def test_the_cli_reference_has_every_argument_and_option_with_its_help(cli_text):
    sections = _sections(cli_text)
    missing = []
    for path, cmd in _tree():
        body = sections[path]
        signatures = re.findall(r"^\.\. option:: (.*)$", body, flags=re.M)
        for p in cmd.params:
            names = [p.metavar.strip("[]") if p.metavar else p.name.upper()] if p.param_type_name == "argument" else [
                *p.opts, *p.secondary_opts]
            if not any(all(re.search(rf"(^|[ ,]){re.escape(n)}\b", s) for n in names) for s in signatures):
                missing.append(f"{path}: {names}")
            first_words = (p.help or "").split()[:3]
            if first_words and " ".join(first_words).replace("`", "") not in body.replace("``", "").replace("\\", ""):
                missing.append(f"{path}: {names}: its help")
    assert missing == []


def test_the_cli_reference_gives_types_and_defaults(cli_text):
    run = _sections(cli_text)["tpulaunch run"]
    assert ".. option:: -t TEXT, --topology TEXT" in run
    assert re.search(r"\.\. option:: --placement TEXT\n\n.*\n\n.*Default: ``auto``", run)
    assert ".. option:: SCRIPT\n" in run and "Required." in run
    repair = _sections(cli_text)["tpulaunch cluster repair"]
    assert ".. option:: --timeout SECONDS" in repair and "Default: ``1800``." in repair
    assert "Hidden from ``--help``" in _sections(cli_text)["tpulaunch supervise"]


def test_help_text_cannot_break_the_rst():
    assert reference.rst_text("holding /dev/accel* or /dev/vfio/*") == r"holding /dev/accel\* or /dev/vfio/\*"
    assert reference.rst_text("see `tpulaunch run` or a|b") == r"see ``tpulaunch run`` or a\|b"
    assert reference.rst_text("an odd ` quote_") == r"an odd \` quote\_"


# -- exit codes ---------------------------------------------------------------------------------------


def test_the_exit_codes_page_reads_every_code_with_its_comment():
    codes = reference.exit_codes()
    declared = {k: v for k, v in vars(ExitCode).items() if not k.startswith("_") and isinstance(v, int)}
    assert {c.name: c.code for c in codes} == declared
    assert all(c.comment for c in codes if c.code != ExitCode.OK), "an exit code without its comment in errors.py"
    table = reference.exit_codes_rst(codes)
    assert all(f"* - {c.code}\n     - ``{c.name}``" in table for c in codes)
    usage = next(c for c in codes if c.name == "USAGE")
    assert usage.comment.startswith("bad flag")

"""The CLI reference and the exit codes, generated: nothing here is written by hand.

`commands()` walks the Click tree Typer builds from the app (every command, sub-command, argument
and option, hidden ones marked), `exit_codes()` reads `ExitCode` from `tpulaunch/errors.py`'s
source (name, number and the comment beside it). `commands_rst()` and `exit_codes_rst()` render
them as reStructuredText. Pure text in, text out: the docs' Sphinx extension
(`docs/_ext/tpulaunch_docs.py`) parses what they return, and `tests/unit/test_docs.py` checks the
text covers every command without running Sphinx.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Click's type names (Typer's vendored Click spells some differently) as `--help` metavars.
_TYPE_METAVARS = {"str": "TEXT", "text": "TEXT", "int": "INTEGER", "integer": "INTEGER", "float": "FLOAT",
                  "path": "PATH", "boolean": "BOOLEAN", "int range": "INTEGER", "integer range": "INTEGER",
                  "float range": "FLOAT"}


@dataclass(frozen=True)
class ParamDoc:
    """One argument or option as the reference shows it."""

    kind: str  # "argument" or "option"
    names: tuple[str, ...]  # ("-t", "--topology"); an argument's metavar
    secondary: tuple[str, ...]  # the "--no-x" of a "--x/--no-x" flag
    metavar: str  # TEXT, INTEGER, FILE, a|b, ...; "" for a flag
    default: str  # as a user would type it; "" when there is none
    help: str
    required: bool
    repeatable: bool
    hidden: bool


@dataclass(frozen=True)
class CommandDoc:
    """One command or group: its full path (``("tpulaunch", "cluster", "up")``), usage and params."""

    path: tuple[str, ...]
    help: str
    usage: str
    params: tuple[ParamDoc, ...]
    hidden: bool
    is_group: bool

    @property
    def name(self) -> str:
        return " ".join(self.path)


def root_command() -> Any:
    """The Click command Typer builds from `tpulaunch.cli.app`, with every command module imported
    (the CLI imports only the one a command line names, to start fast)."""
    import typer

    from tpulaunch import cli

    for module in dict.fromkeys(cli.COMMAND_MODULES.values()):
        importlib.import_module(f"tpulaunch.cli.{module}")
    return typer.main.get_command(cli.app)


def commands(root: Any | None = None) -> list[CommandDoc]:
    """Every command of the tree, depth first in the order `--help` lists them."""
    out: list[CommandDoc] = []

    def walk(cmd: Any, path: tuple[str, ...], hidden: bool) -> None:
        hidden = hidden or bool(getattr(cmd, "hidden", False))
        subs = getattr(cmd, "commands", None)
        params = tuple(_param(p) for p in cmd.params)
        out.append(CommandDoc(path=path, help=(cmd.help or "").strip(), usage=_usage(path, params, subs is not None),
                              params=params, hidden=hidden, is_group=subs is not None))
        for name, sub in (subs or {}).items():
            walk(sub, path + (name,), hidden)

    walk(root if root is not None else root_command(), ("tpulaunch",), False)
    return out


def _param(p: Any) -> ParamDoc:
    is_flag = bool(getattr(p, "is_flag", False))
    if p.param_type_name == "argument":
        names: tuple[str, ...] = ((p.metavar or p.name.upper()).strip("[]"),)
    else:
        names = tuple(sorted(p.opts, key=lambda n: n.startswith("--")))  # -t, --topology: as --help lists them
    default = p.default
    if callable(default) or default is None or (is_flag and default is False) or default == ():
        shown = ""
    elif is_flag and default is True:
        shown = names[0] if not p.secondary_opts else names[-1]
    elif isinstance(default, float):
        shown = f"{default:g}"
    elif isinstance(default, (list, tuple)):
        shown = ", ".join(str(d) for d in default)
    else:
        shown = str(default)
    return ParamDoc(kind=p.param_type_name, names=names, secondary=tuple(p.secondary_opts),
                    metavar="" if is_flag else _metavar(p), default=shown,
                    help=(getattr(p, "help", None) or "").strip(),
                    required=bool(p.required), repeatable=bool(getattr(p, "multiple", False)) or p.nargs == -1,
                    hidden=bool(getattr(p, "hidden", False)))


def _metavar(p: Any) -> str:
    if p.param_type_name == "argument":
        return _TYPE_METAVARS.get(p.type.name, p.type.name.upper())
    if p.metavar:
        return p.metavar
    choices = getattr(p.type, "choices", None)
    if choices:
        return "|".join(str(c) for c in choices)
    name = _TYPE_METAVARS.get(p.type.name, p.type.name.upper())
    low, high = getattr(p.type, "min", None), getattr(p.type, "max", None)
    if low is not None or high is not None:
        name += f" ({'' if low is None else low}..{'' if high is None else high})"
    return name


def _usage(path: tuple[str, ...], params: tuple[ParamDoc, ...], group: bool) -> str:
    pieces = [*path, "[OPTIONS]"]
    for p in params:
        if p.kind != "argument":
            continue
        word = p.names[0] + ("..." if p.repeatable else "")
        pieces.append(word if p.required else f"[{word}]")
    if group:
        pieces.append("COMMAND [ARGS]...")
    return " ".join(pieces)


# -- exit codes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExitCodeDoc:
    """One `ExitCode`: its name, number and the comment beside it in the source."""

    name: str
    code: int
    comment: str


def exit_codes(source: str | None = None) -> list[ExitCodeDoc]:
    """`ExitCode`'s names, numbers and the comment beside each, read from errors.py's source (a
    comment is no part of the class at run time, so the source is the only place it is)."""
    if source is None:
        from tpulaunch import errors

        source = Path(errors.__file__).read_text()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ExitCode")
    out = []
    for node in cls.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int)):
            out.append(ExitCodeDoc(node.targets[0].id, node.value.value, comments.get(node.lineno, "")))
    return out


# -- reStructuredText ------------------------------------------------------------------------------

_SPECIAL = re.compile(r"([\\*|_`])")


def _escape(text: str) -> str:
    return _SPECIAL.sub(r"\\\1", text)


def rst_text(text: str) -> str:
    """Plain help text as reST: `code` spans become literals, every other markup character is
    escaped, so no help string can break (or sneak markup into) the docs."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backquote: nothing is code
        return _escape(text)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(_escape(part))
        elif part.strip() and part == part.strip():
            out.append(f"``{part}``")
        else:
            out.append(_escape(f"`{part}`"))
    return "".join(out)


def _paragraphs(text: str) -> list[str]:
    """Help text split on blank lines, each paragraph one line of reST."""
    paras = [" ".join(line.strip() for line in block.splitlines()) for block in re.split(r"\n\s*\n", text.strip())]
    return [rst_text(p) for p in paras if p]


def _indent(lines: list[str], by: str = "   ") -> list[str]:
    return [by + line if line else "" for line in lines]


def _option_signature(p: ParamDoc) -> str:
    if p.kind == "argument":
        return p.names[0] + ("..." if p.repeatable else "")
    names = [f"{n} {p.metavar}" if p.metavar else n for n in p.names]
    return ", ".join(names + list(p.secondary))


def _param_body(p: ParamDoc) -> list[str]:
    lines = _paragraphs(p.help) if p.help else ["(no help text)"]
    facts = []
    if p.required:
        facts.append("Required.")
    if p.default:
        facts.append(f"Default: ``{p.default}``." if p.default.strip() == p.default
                     else f"Default: {rst_text(repr(p.default))}.")
    if p.repeatable:
        facts.append("Repeatable." if p.kind == "option" else "Takes any number of values.")
    if p.hidden:
        facts.append("Hidden from ``--help``.")
    if facts:
        lines += ["", " ".join(facts)]
    return lines


def command_rst(cmd: CommandDoc) -> str:
    """One command as a reST section: title, usage, help, then every argument and option."""
    title = f"``{cmd.name}``"
    lines = [f".. _cli-{'-'.join(cmd.path)}:", "", title, "-" * len(title), ""]
    if cmd.hidden:
        lines += ["Hidden from ``--help``: an internal command, which tpulaunch runs itself.", ""]
    lines += ["::", "", f"   {cmd.usage}", ""]
    for para in _paragraphs(cmd.help):
        lines += [para, ""]
    if not cmd.params:
        lines += ["No options of its own besides ``--help``.", ""]
        return "\n".join(lines)
    lines += [f".. program:: {cmd.name}", ""]
    for p in cmd.params:
        lines += [f".. option:: {_option_signature(p)}", "", *_indent(_param_body(p)), ""]
    return "\n".join(lines)


def commands_rst(docs: list[CommandDoc] | None = None) -> str:
    """The whole CLI reference, one section per command (``-h``/``--help`` is on every one)."""
    docs = commands() if docs is None else docs
    return "\n".join(command_rst(cmd) for cmd in docs)


def exit_codes_rst(codes: list[ExitCodeDoc] | None = None) -> str:
    """`ExitCode` as a reST table: code, name, and the comment from the source."""
    codes = exit_codes() if codes is None else codes
    lines = [".. list-table::", "   :header-rows: 1", "   :widths: 8 22 70", "",
             "   * - code", "     - ``ExitCode``", "     - meaning (the comment in ``tpulaunch/errors.py``)"]
    for c in codes:
        lines += [f"   * - {c.code}", f"     - ``{c.name}``",
                  f"     - {rst_text(c.comment) if c.comment else '(none)'}"]
    return "\n".join(lines) + "\n"

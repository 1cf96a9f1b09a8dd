"""Terminal output rules, in one place.

* The result of a command (JSON, a table) goes to stdout; progress, warnings and errors to stderr.
* On a terminal: rich tables and colors. Piped: plain lines, no color, no spinners.
  `NO_COLOR` / `FORCE_COLOR` are honoured by rich.
* `--json`: exactly one JSON document on stdout, nothing else there.
* User strings are never read as rich markup (`markup=False` unless we build the Text ourselves).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.text import Text

HOST_COLORS = (
    "cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta",
    "bright_green", "bright_yellow", "bright_blue", "bright_red",
)


def host_color(index: int) -> str:
    return HOST_COLORS[index % len(HOST_COLORS)]


def _console(stderr: bool) -> Console:
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False, soft_wrap=False)


class Output:
    """Where a command writes. Built once per invocation from the global flags."""

    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.out = _console(stderr=False)
        self.err = _console(stderr=True)

    @property
    def rich(self) -> bool:
        """True when stdout is an interactive terminal (tables, colors)."""
        return self.out.is_terminal and not self.json_mode

    @property
    def interactive(self) -> bool:
        return self.err.is_terminal and not os.environ.get("CI")

    def json(self, doc: Any) -> None:
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")
        sys.stdout.flush()

    def result(self, renderable: Any) -> None:
        """Print the command's result to stdout."""
        self.out.print(renderable)

    def line(self, text: str | Text) -> None:
        """A plain result line on stdout."""
        self.out.print(text, overflow="ignore", crop=False)

    def raw(self, text: str) -> None:
        """Text as it came (another process's output, already formatted), on stdout, unchanged."""
        sys.stdout.write(text)
        sys.stdout.flush()

    def info(self, text: str | Text) -> None:
        if not self.quiet:
            self.err.print(text, overflow="ignore", crop=False)

    def warn(self, text: str) -> None:
        self.err.print(Text("warning: ", style="yellow bold") + Text(text), soft_wrap=True)

    def error(self, text: str) -> None:
        self.err.print(Text("error: ", style="red bold") + Text(text), soft_wrap=True)

    @contextlib.contextmanager
    def spinner(self, message: str) -> Iterator[Any]:
        """A spinner on a terminal; nothing in a pipe (a quick read whose result, or one error line, follows)."""
        if self.interactive and not self.quiet:
            with self.err.status(message) as st:
                yield st
        else:
            yield None

    @contextlib.contextmanager
    def status(self, message: str) -> Iterator[Any]:
        """A spinner on a terminal; one plain line on stderr otherwise."""
        if self.interactive and not self.quiet:
            with self.err.status(message) as st:
                yield st
        else:
            self.info(message)
            yield None

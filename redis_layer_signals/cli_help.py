"""How ``rls --help`` reads: plain text, as pip's or redis-cli's does.

typer's own rendering puts a type tag after every option (``--json <bool>``, ``--layers
<int range> [x>=1]``), keeps the line breaks of the docstrings it shows, and prints nothing for an
option without help. Here a command prints its usage, its summary wrapped to the terminal, and
one row per option: the option with the value it takes named (``--layers <n>``; nothing after a
flag), then what it does with its range, default and environment variable in words::

    --batch <n>    Engine slots per rank (1-512; default: 8).

A range shows in ``--help`` only with both ends; ``describe``, what the documentation's CLI
reference prints, says every range. Only the help formatter's
public methods are used (usage, text, definition lists), so the layout survives typer's releases
within the range pyproject.toml pins.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

F = TypeVar("F", bound=Callable[..., Any])

VALUE_NAMES: dict[type, str] = {int: "n", float: "number", Path: "file", str: "value"}
"""The value an option takes, by type, when it names none itself (``metavar=``)."""
UNIT_SUFFIXES = {"_s": "seconds", "_ms": "ms"}
"""Options whose name ends so take a duration in that unit (``--timeout-s <seconds>``)."""
OPTION_COLUMN = 30
"""Widest option column before its description moves to the next line."""


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def range_words(param: Any) -> str:
    """The values a number option accepts, in words: ``1-512``, ``at least 1``, ``at most 5``."""
    low, high = getattr(param, "min", None), getattr(param, "max", None)
    if low is not None and high is not None:
        return f"{_number(low)}-{_number(high)}" if low >= 0 else f"from {_number(low)} to {_number(high)}"
    if low is not None:
        return f"at least {_number(low)}"
    if high is not None:
        return f"at most {_number(high)}"
    return ""


def _annotation(param: Any) -> Any:
    return getattr(getattr(param, "type_descriptor", None), "annotation", None)


def value_name(param: Any) -> str:
    """``<n>``, ``<url>``, ``<redis|drop|local>`` after the option, or nothing for a flag."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    if param.metavar:
        return f"<{param.metavar.strip('<>')}>"
    annotation = _annotation(param)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "<" + "|".join(str(member.value) for member in annotation) + ">"
    name = param.name or ""
    for suffix, unit in UNIT_SUFFIXES.items():
        if name.endswith(suffix) and annotation in (int, float):
            return f"<{unit}>"
    return f"<{VALUE_NAMES.get(annotation, 'value')}>"


def default_words(param: Any) -> str:
    """The default as a user types it, or "" where showing one says nothing (a lone flag)."""
    default = param.default
    if not getattr(param, "show_default", True) or default is None or callable(default) or default == "":
        return ""
    if getattr(param, "is_flag", False):
        if not param.secondary_opts:
            return ""
        return str(param.opts[0] if default else param.secondary_opts[0])
    if isinstance(default, Enum):
        return str(default.value)
    if isinstance(default, float):
        return _number(default)
    return str(default)


def _sentence(text: str, notes: list[str]) -> str:
    """``text`` on one line, with ``notes`` in parentheses before its closing full stop."""
    text = " ".join(text.split())
    if not notes:
        return text
    joined = "; ".join(notes)
    if not text:
        return f"({joined})"
    body, stop = (text[:-1], ".") if text.endswith(".") and not text.endswith("..") else (text, "")
    if body.endswith(")"):  # one pair of parentheses: "Write the PNG (needs matplotlib; default: --plot)."
        return f"{body[:-1]}; {joined}){stop}"
    return f"{body} ({joined}){stop}"


def describe(param: Any) -> str:
    """What an option does, with its range: "Engine slots per rank (1-512)." (the docs' reference
    shows default and variable in columns of their own)."""
    words = range_words(param)
    return _sentence(param.help or "", [words] if words else [])


def help_line(param: Any) -> str:
    """``describe`` with the default and the environment variable, for ``--help``. A range
    shows only with both its ends (``1-512``): a lower bound alone (``at least 1``) rarely
    tells a reader anything, and a value below it is refused naming it."""
    both_ends = getattr(param, "min", None) is not None and getattr(param, "max", None) is not None
    notes = [range_words(param)] if both_ends else []
    if default := default_words(param):
        notes.append(f"default: {default}")
    if isinstance(param.envvar, str):
        notes.append(f"env: {param.envvar}")
    if param.required:
        notes.append("required")
    return _sentence(param.help or "", notes)


def _option_names(param: Any) -> str:
    names = " / ".join([", ".join(param.opts), *param.secondary_opts][: 2 if param.secondary_opts else 1])
    value = value_name(param)
    return f"{names} {value}" if value else names


def _summary(text: str | None) -> str:
    """A command's first paragraph, on one line (the commands list of a group)."""
    first = (text or "").strip().split("\n\n", 1)[0]
    return " ".join(first.split())


def _write_parameters(command: Any, ctx: Any, formatter: Any) -> None:
    params = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
    arguments = [p for p in params if p.param_type_name == "argument"]
    options = [p for p in params if p.param_type_name == "option"]
    if arguments:
        with formatter.section("Arguments"):
            rows = [(param.metavar or (param.name or "").upper(), help_line(param)) for param in arguments]
            formatter.write_dl(rows, col_max=OPTION_COLUMN)
    if options:
        with formatter.section("Options"):
            formatter.write_dl([(_option_names(p), help_line(p)) for p in options], col_max=OPTION_COLUMN)


class HelpCommand(TyperCommand):
    """A command whose ``--help`` is plain text (see the module docstring)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self.format_usage(ctx, formatter)
        self.format_help_text(ctx, formatter)  # paragraphs re-wrapped to the terminal's width
        _write_parameters(self, ctx, formatter)


class HelpGroup(TyperGroup):
    """A group (``rls``, ``rls library``) whose ``--help`` is plain text, listing its commands."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self.format_usage(ctx, formatter)
        self.format_help_text(ctx, formatter)
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, _summary(command.short_help or command.help)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows, col_max=OPTION_COLUMN)
        _write_parameters(self, ctx, formatter)


class HelpTyper(typer.Typer):
    """``typer.Typer`` whose groups and commands print the plain help of this module."""

    def __init__(self, **options: Any) -> None:
        options.setdefault("cls", HelpGroup)
        super().__init__(**options)

    def command(self, *args: Any, **options: Any) -> Callable[[F], F]:
        options.setdefault("cls", HelpCommand)
        decorate: Callable[[F], F] = super().command(*args, **options)
        return decorate

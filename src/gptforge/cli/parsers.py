"""The one way a subcommand's options reach the command line: `add_options` makes an argparse argument of every field
of the command's options dataclass (its name, type, default, allowed values, help text, --help section; how it is
spelled: core/settings.py `setting`), and `parsed` turns the parsed arguments back into that dataclass, checked.
Standard library and core only, so `gptforge --help` imports no torch."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from gptforge.core.settings import REQUIRED, check_fields, default_of, sections

TYPES = {"str": str, "int": int, "float": float, "bool": bool}


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each help text, only where it tells the reader something, and once: not for
    None or no values (the help says what happens without the option), not for flags (giving the flag is the setting:
    --no_cache would read "(default: True)"), not where the help states its own default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, []) or action.nargs == 0 or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def formatter(prog: str) -> argparse.HelpFormatter:
    return DefaultsFormatter(prog, max_help_position=30, width=110)


def value_type(annotation: str) -> tuple[type, bool]:
    """A field's type as written ('int | None', 'list[str]') -> (the type of one value, whether it takes several)."""
    kinds = [k.strip() for k in annotation.split("|") if k.strip() != "None"]
    assert len(kinds) == 1, f"an option has one type (and None), not {annotation!r}"
    many = kinds[0].startswith("list[")
    return TYPES[kinds[0][5:-1] if many else kinds[0]], many


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Every field of `cls` as an argument of `parser`, in field order, under its section's title when it has one."""
    for title, fields in sections(cls):
        group = parser.add_argument_group(title) if title else parser
        for f in fields:
            add_option(group, f)


def add_option(parser: Any, f: dataclasses.Field) -> None:
    """One field as an argument: positional (`positional=True`; a list takes one or more, or any number when it has
    a default) or --name (or its `flags`); a bool is a flag (store_true; store_false when on by default, e.g.
    --no_cache; with default None, True when given); a list option may be repeated; no default: required."""
    meta, default = f.metadata, default_of(f)
    kind, many = value_type(f.type)
    extra = {key: meta[key] for key in ("metavar", "choices") if meta.get(key)}
    if meta.get("positional"):
        if many:
            extra["nargs"] = "+" if default is REQUIRED else "*"
        if default is not REQUIRED:
            extra["default"] = default
        parser.add_argument(f.name, type=kind, help=meta["doc"], **extra)
        return
    flags = meta.get("flags") or (f"--{f.name}",)
    if kind is bool:
        action = {True: "store_false", False: "store_true", None: "store_const"}[default]
        const = {"const": True} if default is None else {}
        parser.add_argument(*flags, dest=f.name, action=action, default=default, help=meta["doc"], **const)
        return
    if many:
        extra["action"] = "append"
    if default is REQUIRED:
        extra["required"] = True
    else:
        extra["default"] = default
    parser.add_argument(*flags, dest=f.name, type=kind, help=meta["doc"], **extra)


def parsed(cls: type, args: argparse.Namespace) -> Any:
    """The options object of a parsed command line, each field checked (check_fields: a UserError naming the
    option)."""
    options = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    check_fields(options)
    return options

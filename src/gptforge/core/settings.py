"""How a setting is declared: a dataclass field carrying its documentation, its allowed values, its check and its
--help section, so that adding a key or an option is one line, `check_fields` validates every field from the
fields themselves, and the help texts (`help_text`, `key_table`, the subcommands' parsers in cli/) are generated
from them. Every command's options are such a dataclass: TrainConfig (core/config.py) and one per subcommand."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from gptforge.core.errors import UserError

Check = Callable[[Any], "str | None"]  # the value -> what it must be, or None when it is fine
REQUIRED: Any = dataclasses.MISSING  # the default of an option the user must give (the command line says so)


def setting(
    default: Any,
    doc: str,
    check: Check | None = None,
    section: str | None = None,
    *,
    choices: Sequence[Any] | None = None,
    **meta: Any,
) -> Any:
    """A dataclass field with its documentation (shown by --help), its allowed values (`choices`: the one list of
    them; --help shows them, `check_fields` holds them), an optional check run by `check_fields`, and, on the first
    key of a --help section, that section's title. A list default is copied for each object.

    Extra metadata is kept: the model's `frozen` and `switch` (core/shape.py), and how the command line shows an
    option (cli/parsers.py): `flags` (its names, e.g. ("-p", "--prompt") or ("--no_cache",) for a switch that turns
    a default-on behaviour off), `metavar`, `positional` (an argument without a name), and `finite=False` (a float
    that may be inf: bench's --max_seconds; or whose limits its command checks itself, with its own message)."""
    metadata = {"doc": doc, "check": check, "section": section, "choices": tuple(choices) if choices else None, **meta}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def default_of(f: dataclasses.Field) -> Any:
    """A field's default (REQUIRED when it has none)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def positive(value: Any) -> str | None:
    return "must be a positive integer" if value <= 0 else None


def not_negative(value: Any) -> str | None:
    return "must not be negative" if value < 0 else None


def below_one(value: Any) -> str | None:
    return "must be in [0, 1)" if not 0.0 <= value < 1.0 else None


def port_number(value: Any) -> str | None:
    return "must be a port number 0-65535 (0 = any free port)" if not 0 <= value <= 65535 else None


def check_fields(obj: Any) -> None:
    """Every field's allowed values (or None) and own check, and that every float is finite: a UserError naming the
    first key that fails."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type == "float" and f.metadata.get("finite", True) and not math.isfinite(value):
            raise UserError(f"--{f.name} must be a finite number, got {value}")
        choices, check = f.metadata.get("choices"), f.metadata.get("check")
        off = not choices or value is None or value in choices  # None: not given (the command's own default)
        problem = None if off else f"must be one of {', '.join(map(str, choices))}"
        problem = problem or (check(value) if check else None)
        if problem:
            raise UserError(f"--{f.name} {problem}, got {value!r}")


def sections(cls: type) -> list[tuple[str, list[dataclasses.Field]]]:
    """The fields of a settings dataclass grouped by their section titles, in field order."""
    groups: list[tuple[str, list[dataclasses.Field]]] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("section") or not groups:
            groups.append((f.metadata.get("section") or "", []))
        groups[-1][1].append(f)
    return groups


def help_text(cls: type) -> str:
    """Every key with its default, type and meaning, by section: `gptforge train --help`'s list."""
    lines = []
    for title, fields in sections(cls):
        lines.append(f"\n{title}:")
        for f in fields:
            lines.append(f"  --{f.name}={default_of(f)!r}  ({f.type})\n      {f.metadata['doc']}")
    return "\n".join(lines)


def key_table(cls: type) -> str:
    """Every key with its default and meaning as a Markdown table, in field order: docs/USAGE.md's "Config keys"
    (tests/test_config.py holds the two equal)."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{f.name}` | `{default_of(f)!r}` | {f.metadata['doc']} |" for f in dataclasses.fields(cls)]
    return "\n".join(rows)

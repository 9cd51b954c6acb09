"""How a setting is declared: a dataclass field carrying its documentation, its check and its --help section, so
that adding a key is one line and `check_fields` validates every key from the fields themselves."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from gptforge.core.errors import UserError

Check = Callable[[Any], "str | None"]  # the value -> what it must be, or None when it is fine


def setting(default: Any, doc: str, check: Check | None = None, section: str | None = None, **meta: Any) -> Any:
    """A dataclass field with its documentation (shown by --help), an optional check run by `check_fields`, and,
    on the first key of a --help section, that section's title. Extra metadata (e.g. frozen=True) is kept."""
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check, "section": section, **meta})


def positive(value: Any) -> str | None:
    return "must be a positive integer" if value <= 0 else None


def not_negative(value: Any) -> str | None:
    return "must not be negative" if value < 0 else None


def below_one(value: Any) -> str | None:
    return "must be in [0, 1)" if not 0.0 <= value < 1.0 else None


def port_number(value: Any) -> str | None:
    return "must be a port number 0-65535 (0 = any free port)" if not 0 <= value <= 65535 else None


def check_fields(obj: Any) -> None:
    """Every field's own check, and that every float is finite: a UserError naming the first key that fails."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type == "float" and not math.isfinite(value):
            raise UserError(f"--{f.name} must be a finite number, got {value}")
        check = f.metadata.get("check")
        problem = check(value) if check else None
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

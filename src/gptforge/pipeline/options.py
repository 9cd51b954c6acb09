"""`gptforge pipeline`'s own options and the settings of its `text` stage (the one stage that is not a gptforge
command of its own: it writes the texts the tokenizer and pretraining read). No torch here."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from gptforge.core.errors import UserError
from gptforge.core.settings import setting

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TEXT_SOURCES = ("shakespeare", "chitchat")


def _sources(value: list[str]) -> str | None:
    unknown = [s for s in value if s not in TEXT_SOURCES]
    return f"must list built-in texts ({', '.join(TEXT_SOURCES)}); unknown: {', '.join(unknown)}" if unknown else None


def _files(value: list[str]) -> str | None:
    missing = [f for f in value if not os.path.isfile(f)]
    return f"names files that do not exist: {', '.join(missing)}" if missing else None


def _file(value: str) -> str | None:
    return f"{value} is not a file" if value and not os.path.isfile(value) else None


@dataclass(frozen=True, kw_only=True)
class TextArgs:
    sources: list[str] = setting(
        [],
        "built-in texts: shakespeare (Tiny Shakespeare, 1.1 MB), chitchat (the chitchat-dataset package's 4,017 "
        "conversations as plain text, 11.9 MB)",
        _sources,
    )
    files: list[str] = setting(
        [], "your own UTF-8 text files (in a recipe relative to its folder; on the command line to yours)", _files
    )
    shakespeare: str = setting(
        "", "a local copy of Tiny Shakespeare's input.txt (else it is downloaded from karpathy/char-rnn)", _file
    )


@dataclass(frozen=True)
class PipelineArgs:
    recipe: str
    out_dir: str | None
    dry_run: bool
    overrides: dict[str, Any]


def parse_pipeline_args(args: list[str]) -> PipelineArgs:
    """RECIPE [--out_dir=FOLDER] [--dry_run] [--STAGE.KEY=VALUE ...]; a VALUE is read as a TOML value (a number,
    true, a "string", a [list]), else taken as a string."""
    recipe, out_dir, dry_run, overrides = None, None, False, {}
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if not arg.startswith("--"):
            if recipe is not None:
                raise UserError(f"one recipe at a time: got {recipe!r} and {arg!r}")
            recipe = arg
            continue
        key, sep, text = arg[2:].partition("=")
        if key == "dry_run" and not sep:
            dry_run = True
            continue
        if not sep:
            if i >= len(args):
                raise UserError(f"--{key} needs a value: --{key}=VALUE")
            text, i = args[i], i + 1
        if key == "out_dir":
            out_dir = text
        elif "." in key:
            overrides[key] = toml_value(text)
        else:
            raise UserError(f"--{key}: not an option of gptforge pipeline; a stage's setting is --STAGE.{key}=VALUE")
    if recipe is None:
        raise UserError("gptforge pipeline needs a RECIPE: a recipe file, or chat-cpu, chat-quick or chat-gpu")
    return PipelineArgs(recipe, out_dir, dry_run, overrides)


def toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text

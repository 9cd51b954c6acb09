"""A pipeline recipe: a TOML file whose tables are the stages, in the order they run. A table's `kind` says what the
stage does (the table's name when it names a kind); keys that name another stage (`text`, `tokenizer`, `data`,
`init_from`, `model`) are its inputs, which must come earlier; every other key is a setting of the stage's own
command, checked here as that command checks it, so a bad recipe stops before anything runs, naming its file, line
and key. The built-in recipes sit in pipeline/recipes/; docs/USAGE.md "One command" has every kind's keys."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

from gptforge.core.config import FIELDS as TRAIN_FIELDS
from gptforge.core.config import load_config
from gptforge.core.config_file import load_settings
from gptforge.core.errors import UserError
from gptforge.pipeline.kinds import KINDS, MODELS, RESERVED, Stage
from gptforge.pipeline.stages import check_argv
from gptforge.rl.options import RLConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

BUILT_IN = os.path.join(os.path.dirname(__file__), "recipes")


@dataclass(frozen=True)
class Recipe:
    path: str
    out_dir: str
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def recipe_path(name: str) -> str:
    """A recipe file, or a built-in recipe's name (chat-cpu, chat-quick, chat-gpu)."""
    if os.path.isfile(name):
        return name
    built_in = os.path.join(BUILT_IN, f"{name}.toml")
    if os.path.isfile(built_in):
        return built_in
    names = ", ".join(sorted(f[:-5] for f in os.listdir(BUILT_IN) if f.endswith(".toml")))
    raise UserError(f"recipe {name!r}: no such file and no built-in recipe of that name (built in: {names})")


def read_recipe(name: str, overrides: dict[str, Any] | None = None, out_dir: str | None = None) -> Recipe:
    """The recipe's stages, checked; `overrides` {'stage.key': value} from the command line win over the file."""
    path = recipe_path(name)
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8")
        tables = tomllib.loads(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"{path}: not a TOML recipe ({e})") from None
    lines = text.splitlines()
    meta = tables.pop("pipeline", {})
    for name, table in tables.items():  # the file's paths are relative to its folder, the command line's to the cwd
        _absolute(name, table, os.path.dirname(os.path.abspath(path))) if isinstance(table, dict) else None
    _apply(tables, overrides or {}, path)
    stages: list[Stage] = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise UserError(f"{path}:{_line(lines, None, name)}: {name} = ... is not a stage; stages are [tables]")
        stages.append(_stage(path, lines, name, dict(table), stages))
    if not stages:
        raise UserError(f"{path}: no stages; each [table] of a recipe is a stage (docs/USAGE.md, One command)")
    _check_folders(path, stages)
    folder = out_dir or meta.get("out_dir") or os.path.splitext(os.path.basename(path))[0]
    return Recipe(path, folder, stages)


def _apply(tables: dict[str, Any], overrides: dict[str, Any], path: str) -> None:
    for dotted, value in overrides.items():
        stage, _, key = dotted.partition(".")
        if stage not in tables or not key:
            close = difflib.get_close_matches(stage, list(tables), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; {path} has {', '.join(tables)}"
            raise UserError(f"--{dotted}: not a STAGE.KEY of the recipe{hint}")
        tables[stage][key] = value
        _absolute(stage, tables[stage], os.getcwd(), only=key)


PATHS = {  # each kind's keys that hold paths (reward: FILE.py:FUNCTION)
    "text": ("shakespeare", "files"),
    "prepare_text": ("input_path",),
    "rl": ("prompts", "eval_prompts", "reward"),
    "eval_hellaswag": ("hellaswag_path",),
}


def _absolute(name: str, table: dict[str, Any], base: str, only: str | None = None) -> None:
    keys = PATHS.get(table.get("kind", name), ())
    for key in keys if only is None else (only,) if only in keys else ():
        value = table.get(key)
        if isinstance(value, list):
            table[key] = [os.path.join(base, v) if isinstance(v, str) else v for v in value]
        elif isinstance(value, str) and value:
            table[key] = os.path.join(base, value)


def _stage(path: str, lines: list[str], name: str, table: dict[str, Any], before: list[Stage]) -> Stage:
    """One table checked: its kind, its inputs (earlier stages of the right kinds), its settings."""
    head = _line(lines, name, None)
    kind = table.pop("kind", name if name in KINDS else None)
    if kind not in KINDS:
        got = f"kind {kind!r}" if kind else "no kind"
        raise UserError(f"{path}:{head}: stage [{name}] has {got}; give kind = one of {', '.join(KINDS)}")
    spec, earlier = KINDS[kind], {s.name: s for s in before}
    minutes = table.pop("minutes", 0)
    config = table.pop("config", None) if spec.config_file else None
    if config is not None:
        config = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), str(config)))
        if not os.path.isfile(config):
            where = f"{path}:{_line(lines, name, 'config')}"
            raise UserError(f"{where}: [{name}] config = {config!r}: no such file")
    inputs = {}
    for key, kinds in spec.inputs.items():
        value = table.get(key)
        folder_only = kind == "rl" and not (isinstance(value, str) and os.path.isdir(value))  # a HF chat folder
        if key in spec.outside and (value is None or value not in earlier) and not folder_only:
            continue  # left out, or gpt2 / a folder: the stage's command checks it
        if not isinstance(value, str) or value not in earlier or earlier[value].kind not in kinds:
            where = f"{path}:{_line(lines, name, key if key in table else None)}"
            said = f"{key} = {value!r} must name" if key in table else f"needs {key} = the name of"
            raise UserError(
                f"{where}: [{name}] {said} an earlier stage of kind {' or '.join(kinds)}"
                f" (earlier stages: {', '.join(earlier) or 'none'})"
            )
        inputs[key] = table.pop(key)
    for key in spec.fixed:
        if key in table:
            raise UserError(f"{path}:{_line(lines, name, key)}: [{name}] {key}: the pipeline sets it; leave it out")
    for key in spec.own:
        value = table.get(key)
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise UserError(f"{path}:{_line(lines, name, key)}: [{name}] needs {key} = a list of texts")
    stage = Stage(name, kind, table, inputs, float(minutes), config, head)
    _check_settings(path, lines, stage, {n: earlier[n] for n in inputs.values()})
    return stage


def _check_settings(path: str, lines: list[str], stage: Stage, inputs: dict[str, Stage]) -> None:
    """The stage's settings as its own command would read them: an unknown key (with the nearest), a wrong type or
    value is named with the recipe's line."""
    try:
        kind, argv = check_argv(stage, inputs)
        if kind is None:
            load_config(argv)
        else:
            load_settings(kind, argv, stage.kind)
    except UserError as e:
        message = str(e)
        key = next((k for k in stage.settings if re.search(rf"\b{re.escape(k)}\b", message)), None)
        if key is None:  # an unknown key is named by its command-line spelling
            key = next((k for k in stage.settings if f"--{k}" in message or f"'{k}'" in message), None)
        message = message.replace(f"--{key}", key) if key else message
        fields = TRAIN_FIELDS if stage.kind == "train" else {f.name for f in dataclasses.fields(kind or RLConfig)}
        hint = "" if key is None or key in fields else " (see `gptforge pipeline --help` for each kind's keys)"
        raise UserError(f"{path}:{_line(lines, stage.name, key)}: [{stage.name}] {message}{hint}") from None


def _check_folders(path: str, stages: list[Stage]) -> None:
    seen: dict[str, str] = {}
    for s in stages:
        top = s.folder.split(os.sep)[0]
        if s.kind in MODELS + ("eval_chat", "export") and (top in RESERVED or s.folder.startswith("..")):
            raise UserError(f"{path}:{s.line}: [{s.name}] would write {s.folder!r}, a folder the pipeline keeps itself")
        for folder, other in seen.items():
            if folder == s.folder or folder.startswith(s.folder + os.sep) or s.folder.startswith(folder + os.sep):
                raise UserError(f"{path}:{s.line}: [{s.name}] and [{other}] would both write {s.folder!r}")
        seen[s.folder] = s.name


def _line(lines: list[str], table: str | None, key: str | None) -> int:
    """The 1-based line of [table] (or of `key = ` inside it; key alone: at the top level)."""
    inside = table is None
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if line.startswith("["):
            inside = line.strip("[] ") == table
            if inside and key is None:
                return n
            continue
        if inside and key is not None and re.match(rf"{re.escape(key)}\s*=", line):
            return n
    return _line(lines, table, None) if key is not None and table is not None else 1

"""nanoGPT's config files read as data: `name = value` lines whose values are literals (numbers, strings, bools,
arithmetic on numbers), parsed with `ast` and never executed; `load_settings`: any settings dataclass from such
files and --key=value options (`gptforge rl`; train's own keys and aliases: core/config.py)."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gptforge.core.errors import UserError
from gptforge.core.settings import REQUIRED, check_fields, default_of


def read_config_file(path: str) -> list[tuple[str, Any, str]]:
    """Parse a nanoGPT config file as data: [(key, value, 'file:line')]. Nothing in it is executed; the keys are
    the caller's to check."""
    if os.path.isdir(path):
        raise UserError(f"config file {path!r} is a folder; give a config file in it (e.g. {path}/train_gpt2.py)")
    if not os.path.isfile(path):
        hint = " (options start with --, e.g. --device=cpu)" if "=" in path else ""
        raise UserError(f"config file {path!r} not found{hint}; check the path (relative to {os.getcwd()})")
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except UnicodeDecodeError as e:
        raise UserError(
            f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start}): a config file "
            "holds `name = value` lines; was another file given in its place?"
        ) from None
    except SyntaxError as e:
        raise UserError(f"{path}:{e.lineno}: not a valid config file: {e.msg}") from None
    except ValueError as e:  # e.g. NUL bytes: a binary file
        raise UserError(f"config file {path} is not text ({e}); a config file holds `name = value` lines") from None
    out = []
    for node in tree.body:
        where = f"{path}:{node.lineno}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue  # nanoGPT configs sometimes import time; harmless when nothing is executed
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring or a bare string
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise UserError(f"{where}: config files hold only `name = value` lines; found {ast.unparse(node)!r}")
        key = node.targets[0].id
        try:
            value = _literal(node.value)
        except ValueError:
            raise UserError(
                f"{where}: the value of {key} must be a literal (number, string, bool, or arithmetic on numbers); "
                f"got {ast.unparse(node.value)!r}. Config files are read as data, never run."
            ) from None
        out.append((key, value, where))
    return out


_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
}


def _literal(node: ast.AST) -> Any:
    """ast.literal_eval plus arithmetic on numbers and + on strings (nanoGPT writes `5 * 8`, `2**19`)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _literal(node.left), _literal(node.right)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
        strings = isinstance(node.op, ast.Add) and isinstance(a, str) and isinstance(b, str)
        if not (numbers or strings) or (isinstance(node.op, ast.Pow) and abs(b) > 1024):
            raise ValueError("unsupported operands")
        return _BINOPS[type(node.op)](a, b)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _literal(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    return ast.literal_eval(node)


TRUE_WORDS, FALSE_WORDS = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}  # how a flag says a bool


def given_settings(
    args: Sequence[str], is_flag: Callable[[str], bool], check: Callable[[str, str], None] | None = None
) -> Iterator[tuple[str, Any, str, bool, int]]:
    """Each setting in config files and --key=value / --key value options, in order: (key, value, where,
    from_text, source), source being the config file's position among args or len(args) + 1 for the command
    line. A bare `--key` whose is_flag(key) is true means True (as does `--key` before another option);
    `check(key, where)` sees each command-line key first (an unknown key named before its value is read)."""
    words = TRUE_WORDS | FALSE_WORDS | {"auto"}
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if not arg.startswith("--"):
            for key, value, where in read_config_file(arg):
                yield key, value, where, False, i
            continue
        key, sep, text = arg[2:].partition("=")
        key = key.replace("-", "_")
        if check:
            check(key, f"--{key}")
        if not sep:
            nxt = args[i] if i < len(args) else None
            if is_flag(key) and (nxt is None or nxt.lower() not in words):
                text = "True"
            elif nxt is None or (nxt.startswith("--") and len(nxt) > 2):
                raise UserError(f"--{key} needs a value: --{key}=VALUE or --{key} VALUE")
            else:
                text, i = nxt, i + 1
        yield key, text, f"--{key}", True, len(args) + 1


def load_settings(cls: type, args: Sequence[str], command: str) -> Any:
    """A settings dataclass (core/settings.py) from config files (read as data, as above) and --key=value /
    --key value options, in order, the last one winning; each value checked against its field's type, then every
    field's own check (check_fields). An unknown key is named with where it was given and the nearest known keys."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    given: dict[str, Any] = {}
    is_flag = lambda key: key in fields and fields[key].type == "bool"  # noqa: E731
    for key, value, where, from_text, _ in given_settings(args, is_flag):
        given[key] = _typed(fields, key, value, where, command, from_text=from_text)
    missing = [k for k, f in fields.items() if default_of(f) is REQUIRED and k not in given]
    if missing:
        raise UserError(f"gptforge {command} needs --{missing[0]} ({fields[missing[0]].metadata['doc']})")
    obj = cls(**given)
    check_fields(obj)
    return obj


def _typed(fields: dict[str, Any], key: str, value: Any, where: str, command: str, from_text: bool) -> Any:
    """`value` as the type of settings field `key` (text from the command line parsed as a literal first)."""
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; `gptforge {command} --help` lists them"
        raise UserError(f"{where}: unknown key {key!r}{hint}")
    kind = fields[key].type.replace(" | None", "")
    if from_text:
        if kind == "bool" and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
            return value.strip().lower() in TRUE_WORDS
        if kind != "str":
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                pass
    ok = {
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
    }.get(kind, True)
    if not ok:
        raise UserError(f"{where}: {key} must be {kind}, got {value!r}")
    return float(value) if kind == "float" else value

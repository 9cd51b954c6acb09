"""The command line's declaration: every subcommand's options come from one dataclass of settings (cli/args.py
COMMANDS), whose fields are exactly the parameters of the stage that does the work (no option parsed and then
dropped, no default written twice); --help is generated from the fields, each option with its default and allowed
values, and neither `gptforge --help` nor any `gptforge SUB --help` imports torch; train's keys name their allowed
values in their docs, and docs/USAGE.md's key table is TrainConfig's fields."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import math
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

from gptforge.bench.options import BenchArgs
from gptforge.cli.args import COMMANDS, Command, bench_parser, build_parser
from gptforge.cli.parsers import parsed
from gptforge.core.config import TrainConfig, load_config
from gptforge.core.errors import UserError
from gptforge.core.settings import REQUIRED, default_of

ROOT = Path(__file__).resolve().parent.parent


def leaves(commands: tuple[Command, ...], path: tuple[str, ...] = ()):
    """(path of names, command) of every subcommand that runs: one with options and a handler."""
    for command in commands:
        if command.tasks:
            yield from leaves(command.tasks, (*path, command.name))
        elif command.options is not None:
            yield (*path, command.name), command


LEAVES = list(leaves(COMMANDS))
IDS = [" ".join(path) for path, _ in LEAVES]


def subparser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def test_every_argparse_subcommand_has_options_and_a_handler():
    assert set(IDS) == {
        "prepare",
        "sample",
        "chat",
        "serve",
        "export",
        "dashboard",
        "eval hellaswag",
        "eval loss",
        "eval lm-eval",
        "eval chat",
        "tokenizer train",
        "tokenizer stats",
        "tokenizer encode",
        "tokenizer decode",
    }
    for _, command in LEAVES:
        assert dataclasses.is_dataclass(command.options) and callable(command.handler)


@pytest.mark.parametrize("path,command", LEAVES, ids=IDS)
def test_every_option_comes_from_its_options_class(path, command):
    """The parser's arguments are the class's fields, and parsing nothing (but what is required) gives the class's
    own defaults: one declaration, nothing added beside it."""
    parser = subparser(path)
    fields = dataclasses.fields(command.options)
    assert {a.dest for a in parser._actions if a.dest != "help"} == {f.name for f in fields}
    required = {"tasks": ["--tasks=x"], "to": ["--to=x"], "vocab_size": ["--vocab_size=9"], "name": ["--name=x"]}
    required |= {"recipe": ["text"], "files": ["a"], "tokenizer": ["--tokenizer=t"], "file": ["f"], "text": ["t"]}
    required |= {"ids": ["1"]}
    argv = [arg for f in fields if default_of(f) is REQUIRED for arg in required[f.name]]
    options = parsed(command.options, build_parser().parse_args([*path, *argv]))
    assert isinstance(options, command.options)
    for f in fields:
        if default_of(f) is not REQUIRED:
            assert getattr(options, f.name) == default_of(f), f.name


def stage_of(handler) -> tuple[str, str]:
    """The (module, function) a thin handler imports and calls."""
    body = textwrap.dedent(inspect.getsource(handler))
    imports = [line.split() for line in body.splitlines() if line.strip().startswith("from gptforge.")]
    assert len(imports) == 1, f"{handler.__name__} imports one stage function: {imports}"
    _, module, _, name = imports[0]
    return module, name


@pytest.mark.parametrize("path,command", LEAVES, ids=IDS)
def test_the_handler_hands_every_option_to_its_stage_which_has_no_defaults_of_its_own(path, command):
    """The handler takes the options object and gives it to its stage: whole (the stage's first parameter is of the
    options class) or as the stage's parameters, which are then exactly the fields, none with a default (the
    class's default is the one)."""
    hints = typing.get_type_hints(command.handler)
    assert list(inspect.signature(command.handler).parameters) == ["options"]
    assert hints["options"] is command.options, f"{command.handler.__name__} takes {command.options.__name__}"
    module, name = stage_of(command.handler)
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    first = next(iter(params.values()))
    if first.annotation in (command.options.__name__, command.options):
        return
    fields = {f.name for f in dataclasses.fields(command.options)}
    assert set(params) == fields, f"{module}.{name}: parameters {sorted(set(params) ^ fields)} are not the options'"
    defaults = [p.name for p in params.values() if p.default is not inspect.Parameter.empty]
    assert not defaults, f"{module}.{name}: defaults {defaults} are written again (the options class has them)"


PARSERS = [(" ".join(path), subparser(path), command.options) for path, command in LEAVES]
PARSERS.append(("bench", bench_parser(), BenchArgs))


@pytest.mark.parametrize("name,parser,options", PARSERS, ids=[name for name, _, _ in PARSERS])
def test_help_shows_each_option_with_its_help_default_and_choices(name, parser, options):
    text = " ".join(parser.format_help().split())
    squeezed = "".join(text.split())  # a help text is wrapped, its words broken at hyphens
    for f in dataclasses.fields(options):
        meta, default = f.metadata, default_of(f)
        choices = "{" + ",".join(map(str, meta["choices"])) + "}" if meta.get("choices") else None
        flag = (meta.get("metavar") or choices or f.name) if meta.get("positional") else None
        flag = flag or (meta.get("flags") or (f"--{f.name}",))[-1]
        assert flag in text, f"{name}: {flag}"
        assert "".join(meta["doc"].split()) in squeezed, f"{name} {flag}: its help text"
        if choices:
            assert choices in text, f"{name} {flag}: its choices"
        shown = default not in (None, REQUIRED, []) and not isinstance(default, bool) and "(default:" not in meta["doc"]
        if shown:
            assert "".join(meta["doc"].split()) + f"(default:{default})" in squeezed, f"{name} {flag}: its default"


def test_the_parsed_options_are_checked():
    from gptforge.infer.options import SampleArgs

    with pytest.raises(UserError, match=r"--top_p must be in \(0, 1\] \(1 = off\), got 2.0"):
        parsed(SampleArgs, build_parser().parse_args(["sample", "--top_p=2"]))
    with pytest.raises(UserError, match="--window must be one of slide, half, stream, got 'full'"):
        parsed(SampleArgs, argparse.Namespace(**{**vars(build_parser().parse_args(["sample"])), "window": "full"}))
    assert parsed(BenchArgs, bench_parser().parse_args([])).max_seconds == math.inf  # bench's default: no limit


def test_no_help_imports_torch():
    """`gptforge --help` and every `gptforge SUB --help` are instant: none imports torch (or numpy)."""
    paths = [[], ["eval"], ["tokenizer"], ["train"], ["bench"], *[list(path) for path, _ in LEAVES]]
    code = f"""
import contextlib, io, sys
from gptforge.cli.main import run
heavy = []
for path in {paths!r}:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            run([*path, "--help"])
        except SystemExit:
            pass
    heavy += [" ".join(path) or "gptforge --help"] if {{"torch", "numpy"}} & set(sys.modules) else []
print(heavy)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"--help imported torch or numpy first in: {r.stdout}"


def test_every_setting_with_choices_names_each_in_its_doc():
    """A key's allowed values are written once, as its field's `choices` (load_config and check_fields hold them);
    its doc, which --help and docs/USAGE.md show, names every one of them."""
    from gptforge.core.config import CHOICES

    assert set(CHOICES) >= {"dtype", "backend", "lr_schedule", "optimizer", "gelu", "resume"}
    for f in dataclasses.fields(TrainConfig):
        for choice in f.metadata["choices"] or ():
            assert f"'{choice}'" in f.metadata["doc"], f"{f.name}: its doc does not name {choice!r}"
    with pytest.raises(UserError, match=r"backend must be one of auto, nccl, gloo, mpi, ucc; got 'tcp'"):
        load_config(["--backend=tcp"])


def test_usage_key_table_is_the_fields():
    """docs/USAGE.md's "Config keys" table is TrainConfig's fields (key, default, doc, in order): a key added or a
    doc changed without the table fails here. To update it, paste the table printed by
    `python -c "from gptforge.core.config import TrainConfig; from gptforge.core.settings import key_table;
    print(key_table(TrainConfig))"`."""
    from gptforge.core.settings import key_table

    text = (ROOT / "docs" / "USAGE.md").read_text(encoding="utf-8")
    start = text.index("| key | default | meaning |", text.index("## Config keys"))
    table = text[start : text.index("\n\n", start)]
    expected = key_table(TrainConfig)
    differ = sorted(set(expected.splitlines()) ^ set(table.splitlines()))
    assert table == expected, f"docs/USAGE.md's key table differs from TrainConfig's fields: {differ}"

"""The command line's dispatch table: every subcommand names a handler that exists, and every one of its options
reaches a parameter of that handler (or of its options class), so no option can be parsed and then dropped."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from gptforge.cli.args import build_parser
from gptforge.cli.main import NOT_OPTIONS, call, load


def subcommands(parser: argparse.ArgumentParser, path=()):
    """(path of names, parser) of every leaf subcommand: one that sets a handler."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs and parser.get_default("handler"):
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from subcommands(child, (*path, name))


LEAVES = list(subcommands(build_parser()))


def test_every_argparse_subcommand_has_a_handler():
    names = {" ".join(path) for path, _ in LEAVES}
    assert names == {
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


@pytest.mark.parametrize("path,parser", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_every_option_reaches_a_parameter_of_its_handler(path, parser):
    handler = load(parser.get_default("handler"))
    options_class = parser.get_default("options")
    if options_class:
        params = {f.name for f in dataclasses.fields(load(options_class))}
        assert list(inspect.signature(handler).parameters)[:1], f"{path}: its handler takes the options object"
    else:
        params = set(inspect.signature(handler).parameters)
    dests = {a.dest for a in parser._actions if a.dest not in ("help", *NOT_OPTIONS)}
    assert dests <= params, f"gptforge {' '.join(path)}: options {sorted(dests - params)} reach no parameter"


def test_an_option_without_a_parameter_is_a_bug_not_a_silent_drop():
    def handler(a):
        return a

    with pytest.raises(AssertionError, match=r"takes no parameter for option\(s\) \['b'\]"):
        call(handler, argparse.Namespace(a=1, b=2, command="x", handler="h"))
    assert call(handler, argparse.Namespace(a=1, command="x", handler="h")) == 1

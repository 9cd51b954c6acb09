"""Tokenizers behind one interface (encode, decode, vocab_size, eot_token, spec), each described by a plain dict, its
`spec()`, which meta.json and every checkpoint store: `from_spec` builds the tokenizer back from it."""

from __future__ import annotations

from typing import Any

from gptforge.core.errors import UserError
from gptforge.tokenizer.char import CharTokenizer
from gptforge.tokenizer.gpt2 import GPT2Tokenizer

Tokenizer = CharTokenizer | GPT2Tokenizer


def from_spec(spec: dict[str, Any]) -> Tokenizer:
    kind = spec.get("tokenizer")
    if kind == "char":
        return CharTokenizer(spec["itos"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise UserError(f"unknown tokenizer kind {kind!r}: expected 'char' or 'gpt2'")


def tokenizer_spec(meta: dict[str, Any]) -> dict[str, Any]:
    """The spec `from_spec` reads, from a dataset's meta (checkpoints store it)."""
    return {"tokenizer": meta["tokenizer"], **({"itos": meta["itos"]} if meta["tokenizer"] == "char" else {})}

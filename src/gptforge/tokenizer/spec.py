"""Tokenizers behind one interface (encode, decode, vocab_size, eot_token, spec), each described by a plain dict, its
`spec()`, which meta.json and every checkpoint store: `from_spec` builds the tokenizer back from it."""

from __future__ import annotations

from typing import Any

from gptforge.core.errors import UserError
from gptforge.tokenizer.bpe import BPETokenizer
from gptforge.tokenizer.char import CharTokenizer
from gptforge.tokenizer.gpt2 import GPT2Tokenizer

Tokenizer = CharTokenizer | GPT2Tokenizer | BPETokenizer


def from_spec(spec: dict[str, Any]) -> Tokenizer:
    kind = spec.get("tokenizer")
    if kind == "char":
        return CharTokenizer(spec["itos"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "bpe":
        return BPETokenizer.from_spec(spec)
    raise UserError(f"unknown tokenizer kind {kind!r}: expected 'char', 'gpt2' or 'bpe'")


def tokenizer_spec(meta: dict[str, Any]) -> dict[str, Any]:
    """The spec `from_spec` reads, from a dataset's meta (checkpoints store it)."""
    own = {"char": ("itos",), "bpe": ("name", "pattern", "ranks", "specials")}.get(meta["tokenizer"], ())
    return {"tokenizer": meta["tokenizer"], **{key: meta[key] for key in own}}

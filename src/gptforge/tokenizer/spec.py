"""Tokenizers behind one interface (encode, decode, vocab_size, eot_token, spec), each described by a plain dict, its
`spec()`, which meta.json and every checkpoint store: `from_spec` builds the tokenizer back from it."""

from __future__ import annotations

import json
import os
from typing import Any

from gptforge.core.errors import UserError
from gptforge.tokenizer.bpe import BPETokenizer, load_tokenizer
from gptforge.tokenizer.char import CharTokenizer
from gptforge.tokenizer.gpt2 import GPT2Tokenizer
from gptforge.tokenizer.hf_format import GPTFORGE_FILE

Tokenizer = CharTokenizer | GPT2Tokenizer | BPETokenizer
BUILT_IN = ("char", "gpt2")  # --tokenizer values that name no own tokenizer (and names `tokenizer train` refuses)


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


def folder_tokenizer(folder: str) -> Tokenizer:
    """The tokenizer a Hugging Face model folder's model reads: the one its gptforge_tokenizer.json names (every
    `gptforge export` writes it: a character vocabulary, GPT-2 BPE, or an own BPE whose files are beside it); a
    folder without one (OpenAI's GPT-2, say) reads GPT-2 BPE."""
    path = os.path.join(folder, GPTFORGE_FILE)
    if not os.path.isfile(path):
        return GPT2Tokenizer()
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
        kind = record["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{path}: not a readable tokenizer record ({type(e).__name__}: {e}); export the run again"
        ) from None
    return BPETokenizer.load(folder) if kind == "bpe" else from_spec(record)


def named_tokenizer(value: str, flag: str = "--tokenizer", root: str = "tokenizers") -> Tokenizer:
    """What a --tokenizer flag names: 'gpt2' (GPT-2's BPE), or an own tokenizer by name (under `root`) or folder.
    'char' is no fixed vocabulary (it is built from a dataset's text), so the caller handles it first."""
    assert value != "char", "a character vocabulary is built from the text: the caller makes it"
    if value == "gpt2":
        return GPT2Tokenizer()
    try:
        return load_tokenizer(value, root)
    except UserError as e:
        raise UserError(f"{flag} {value}: {e}") from None


def token_byte_table(tok: Tokenizer, rows: int | None = None) -> list[int]:
    """How many bytes of text each id stands for, for `rows` ids (a model's vocabulary, padded past the
    tokenizer's: those rows and the special tokens count 0). Bits per byte divide by these."""
    lengths = tok.token_byte_lengths()
    rows = len(lengths) if rows is None else rows
    assert rows >= len(lengths), f"{rows} rows cannot hold a vocabulary of {len(lengths)} tokens"
    return lengths + [0] * (rows - len(lengths))

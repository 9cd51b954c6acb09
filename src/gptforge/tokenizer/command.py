"""`gptforge tokenizer train|stats|encode|decode`: thin commands over tokenizer/train.py. Results go to stdout (a
folder, a table, ids, text), so they can be piped; progress and notes go to stderr."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from gptforge.core.console import log
from gptforge.core.errors import UserError
from gptforge.tokenizer.bpe import resolve_folder
from gptforge.tokenizer.spec import BUILT_IN, named_tokenizer
from gptforge.tokenizer.train import tokenizer_stats, train_tokenizer


def train_command(
    files: Sequence[str],
    vocab_size: int,
    name: str,
    max_chars: int | None,
    doc_chars: int | None,
    force: bool,
    text_field: str,
    max_digits: int,
) -> str:
    """`gptforge tokenizer train FILE_OR_FOLDER... --vocab_size N --name NAME`: prints the tokenizer's folder."""
    folder = train_tokenizer(
        list(files),
        vocab_size,
        name,
        max_chars=max_chars,
        doc_chars=doc_chars,
        force=force,
        text_field=text_field,
        max_digits=max_digits,
    )
    print(folder)
    return folder


def stats_command(tokenizer: str, file: str) -> dict[str, Any]:
    """`gptforge tokenizer stats --tokenizer NAME FILE`: bytes per token on FILE, beside GPT-2's and char-level's
    (higher is better: fewer tokens for the same text)."""
    if tokenizer in BUILT_IN:
        raise UserError(
            f"--tokenizer {tokenizer}: give an own tokenizer (a name or folder); gpt2 and char are shown beside it"
        )
    try:
        resolve_folder(tokenizer)
    except UserError as e:
        raise UserError(f"--tokenizer {tokenizer}: {e}") from None
    if not os.path.isfile(file):
        raise UserError(f"FILE {file!r} not found; give a UTF-8 text file to measure on")
    s = tokenizer_stats(tokenizer, file)
    print(f"{s['file']}: {s['bytes']:,} bytes, {s['characters']:,} characters")
    rows = [(f"{s['tokenizer']} ({s['vocab_size']:,} tokens)", s["tokens"], s["bytes_per_token"])]
    if s["gpt2_tokens"] is not None:
        rows.append(("gpt2 (50,257 tokens)", s["gpt2_tokens"], s["gpt2_bytes_per_token"]))
    rows.append(("char (one per character)", s["characters"], s["char_bytes_per_token"]))
    width = max(len(label) for label, _, _ in rows)
    for label, tokens, per_token in rows:
        print(f"  {label:<{width}}  {tokens:>12,} tokens  {per_token:6.3f} bytes/token")
    if s.get("gpt2_note"):
        log(f"GPT-2 left out: {s['gpt2_note']}")
    return s


def encode_command(tokenizer: str, text: str) -> list[int]:
    """`gptforge tokenizer encode --tokenizer T TEXT`: the ids on stdout; how the text was cut on stderr."""
    tok = named_tokenizer(tokenizer)
    ids = tok.encode(text)
    print(" ".join(map(str, ids)))
    n_bytes = len(text.encode("utf-8"))
    per_token = f" ({n_bytes / len(ids):.2f} bytes per token)" if ids else ""
    log(f"{len(ids)} tokens for {n_bytes} bytes{per_token}: " + " ".join(repr(piece(tok, i)) for i in ids))
    return ids


def decode_command(tokenizer: str, ids: Sequence[int]) -> str:
    """`gptforge tokenizer decode --tokenizer T IDS...`: the text of the ids on stdout."""
    tok = named_tokenizer(tokenizer)
    bad = [i for i in ids if not 0 <= i < tok.vocab_size]
    if bad:
        raise UserError(
            f"IDS: {', '.join(map(str, bad[:5]))} not an id of --tokenizer {tokenizer} (0 to {tok.vocab_size - 1})"
        )
    text = tok.decode(list(ids))
    print(text)
    return text


def piece(tok: Any, i: int) -> str:
    """Token i's own text; bytes short of a whole UTF-8 character as \\x.. escapes."""
    return tok.enc.decode_single_token_bytes(i).decode("utf-8", "backslashreplace")

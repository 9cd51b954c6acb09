"""Dataset recipes held in memory (shakespeare_char, shakespeare, text): text in, train.bin / val.bin / meta.json
out. Commands in README.md; the format and the write order in docs/ARCHITECTURE.md, "Files"."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

from gptforge.core.console import log
from gptforge.core.errors import UserError
from gptforge.core.files import atomic_write, download
from gptforge.data import RECIPES
from gptforge.data.sources import read_txt
from gptforge.tokenizer.char import CharTokenizer
from gptforge.tokenizer.spec import Tokenizer, named_tokenizer

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
OFFLINE_HINT = "Pass --input PATH to a local copy of the file"
MIN_SPLIT_TOKENS = 9  # below this no block_size that makes sense (8 is the smallest) fits in a split


def prepare(
    recipe: str,
    data_dir: str = "data",
    input_path: str | None = None,
    files: Sequence[str] = (),
    name: str | None = None,
    tokenizer: str | None = None,
    val_fraction: float = 0.1,
) -> dict[str, Any]:
    """Run a recipe; returns the meta.json it wrote. tokenizer: 'char', 'gpt2' or an own tokenizer's name or
    folder (text: default char; shakespeare: default gpt2); name: the dataset folder (default: the recipe's)."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    if recipe in ("shakespeare_char", "shakespeare"):
        folder = os.path.join(data_dir, name or recipe)
        text = read_txt(existing(shakespeare_input(os.path.join(data_dir, recipe), input_path)))
        n_train = int(len(text) * (1.0 - val_fraction))
        kind = "char" if recipe == "shakespeare_char" else tokenizer or "gpt2"
        tok = CharTokenizer.from_text(text) if kind == "char" else named_tokenizer(kind)
        train, val = tok.encode(text[:n_train]), tok.encode(text[n_train:])
    elif recipe == "text":
        if not files or not name:
            raise UserError("`gptforge prepare text` needs one or more FILEs and --name NAME")
        folder = os.path.join(data_dir, name)
        tok = None if (tokenizer or "char") == "char" else named_tokenizer(tokenizer)  # before reading the files
        docs = [read_txt(existing(f)) for f in files]
        tok = tok or CharTokenizer.from_text("".join(docs))
        ids = document_ids(tok, docs)
        n_train = int(len(ids) * (1.0 - val_fraction))
        train, val = ids[:n_train], ids[n_train:]
    else:
        raise UserError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    if min(len(train), len(val)) < MIN_SPLIT_TOKENS:
        source = ", ".join(map(str, files)) if recipe == "text" else input_path or os.path.join(folder, "input.txt")
        raise UserError(
            f"too little text in {source}: {len(train)} train and {len(val)} val tokens, and each split needs at "
            f"least {MIN_SPLIT_TOKENS} (one window of block_size {MIN_SPLIT_TOKENS - 1} and its next token) to train "
            f"on at all; give more text (or another --val_fraction than {val_fraction})"
        )
    meta = dataset_meta(tok, {"train": len(train), "val": len(val)})
    write_dataset(folder, {"train": train, "val": val}, meta)
    log(f"vocab size {meta['vocab_size']:,} ({meta['tokenizer']}); train {len(train):,} tokens, val {len(val):,}")
    log(f"wrote {folder}/train.bin, val.bin, meta.json")
    return meta


def document_ids(tok: Tokenizer, docs: list[str]) -> list[int]:
    """The files' tokens in one stream: char-level text joined as it is; GPT-2 BPE with <|endoftext|> after each
    file (as nanoGPT's data); an own BPE with <|bos|> before each (as its shards: every document starts with it)."""
    if tok.kind == "char":
        return tok.encode("".join(docs))
    if tok.kind == "gpt2":
        return [t for doc in tok.encode_batch(docs) for t in (*doc, tok.eot_token)]
    return [t for doc in tok.encode_batch(docs) for t in (tok.eot_token, *doc)]


def dataset_meta(tok: Tokenizer, tokens: dict[str, int]) -> dict[str, Any]:
    """meta.json: the vocabulary and its tokenizer's spec (from_spec builds it back), the ids' dtype, the document
    boundary token and the split sizes."""
    return {
        "vocab_size": tok.vocab_size,
        **tok.spec(),
        "dtype": token_dtype(tok.vocab_size),
        "eot_token": tok.eot_token,
        "tokens": tokens,
    }


def token_dtype(vocab_size: int) -> str:
    """uint16 while every id fits (GPT-2's 50,257 do), uint32 past 65,536 tokens."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def shakespeare_input(folder: str, input_path: str | None) -> str:
    """Tiny Shakespeare's path: --input, else input.txt in the dataset folder, else that file downloaded first."""
    if input_path:
        return input_path
    local = os.path.join(folder, "input.txt")
    if not os.path.isfile(local):
        download(SHAKESPEARE_URL, local, OFFLINE_HINT)
    return local


def existing(path: str) -> str:
    """`path` when it exists: a missing input is named as such, not as a file that cannot be read."""
    if not os.path.exists(path):
        raise UserError(f"input file {path!r} not found")
    return path


def write_dataset(folder: str, splits: dict[str, Sequence[int]], meta: dict[str, Any]) -> None:
    """Write every split and meta.json, meta.json renamed last; a failed write leaves the old files as they were."""
    # meta.json first: nested atomic_write blocks rename in reverse order, so it takes its name last
    contents = {"meta.json": (json.dumps(meta, ensure_ascii=False) + "\n").encode("utf-8")}
    contents |= {f"{split}.bin": np.asarray(ids, dtype=meta["dtype"]).tobytes() for split, ids in splits.items()}
    try:
        os.makedirs(folder, exist_ok=True)
        with contextlib.ExitStack() as staged:
            for name, data in contents.items():
                write_file(staged.enter_context(atomic_write(os.path.join(folder, name))), data)
    except OSError as e:
        raise UserError(
            f"cannot write the dataset into {folder!r}: {e.strerror}; check the folder and free space"
        ) from None


def write_file(fh: IO[bytes], data: bytes) -> None:
    # flushed and synced here so that a full disk fails while nothing has been renamed yet
    fh.write(data)
    fh.flush()
    os.fsync(fh.fileno())

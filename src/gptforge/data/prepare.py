"""Dataset recipes: raw text in, `train.bin` / `val.bin` / `meta.json` out (see data/loader.py for the format).

    gptforge prepare shakespeare_char [--input PATH] [--data_dir DIR]   # 65 characters, ~1M train tokens
    gptforge prepare shakespeare [--input PATH] [--data_dir DIR]        # GPT-2 BPE, ~302k train tokens
    gptforge prepare text FILE... --name NAME [--tokenizer char|gpt2]   # your own text

The Shakespeare recipes use Tiny Shakespeare: `--input PATH` if given, else `input.txt` already in the dataset
folder, else a download from karpathy/char-rnn. The first 90% of the text trains, the last 10% validates.
Every file is written under a temporary name and renamed into place, meta.json last, so an interrupted run
never leaves a truncated dataset that looks whole. Corpora too big for memory (files, openwebtext,
fineweb_edu) go through data/shards.py instead, into token shards.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np

from gptforge.data.sources import read_txt
from gptforge.errors import UserError
from gptforge.tokenizer import CharTokenizer, GPT2Tokenizer

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
RECIPES = ("shakespeare_char", "shakespeare", "text")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prepare(
    recipe: str,
    data_dir: str = "data",
    input_path: str | None = None,
    files: Sequence[str] = (),
    name: str | None = None,
    tokenizer: str = "char",
    val_fraction: float = 0.1,
) -> dict[str, Any]:
    """Run a recipe; returns the meta.json it wrote."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    if recipe in ("shakespeare_char", "shakespeare"):
        folder = os.path.join(data_dir, recipe)
        text = read_text(shakespeare_input(folder, input_path))
        n_train = int(len(text) * (1.0 - val_fraction))
        tok = CharTokenizer.from_text(text) if recipe == "shakespeare_char" else GPT2Tokenizer()
        train, val = tok.encode(text[:n_train]), tok.encode(text[n_train:])
    elif recipe == "text":
        if not files or not name:
            raise UserError("`gptforge prepare text` needs one or more FILEs and --name NAME")
        if tokenizer not in ("char", "gpt2"):
            raise UserError(f"--tokenizer must be 'char' or 'gpt2', got {tokenizer!r}")
        folder = os.path.join(data_dir, name)
        docs = [read_text(f) for f in files]
        if tokenizer == "char":
            tok = CharTokenizer.from_text("".join(docs))
            ids = tok.encode("".join(docs))
        else:
            tok = GPT2Tokenizer()
            ids = [t for doc in tok.encode_batch(docs) for t in (*doc, tok.eot_token)]  # EOT after each file
        n_train = int(len(ids) * (1.0 - val_fraction))
        train, val = ids[:n_train], ids[n_train:]
    else:
        raise UserError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    if not train or not val:
        source = ", ".join(map(str, files)) if recipe == "text" else input_path or os.path.join(folder, "input.txt")
        raise UserError(f"too little text in {source}: {len(train)} train and {len(val)} val tokens; give more text "
                        f"(or another --val_fraction than {val_fraction})")
    meta = {
        "vocab_size": tok.vocab_size,
        **tok.spec(),
        "dtype": "uint16" if tok.vocab_size < 2**16 else "uint32",
        "eot_token": tok.eot_token,
        "tokens": {"train": len(train), "val": len(val)},
    }
    write_dataset(folder, {"train": train, "val": val}, meta)
    log(f"vocab size {meta['vocab_size']:,} ({meta['tokenizer']}); train {len(train):,} tokens, val {len(val):,}")
    log(f"wrote {folder}/train.bin, val.bin, meta.json")
    return meta


def shakespeare_input(folder: str, input_path: str | None) -> str:
    if input_path:
        return input_path
    local = os.path.join(folder, "input.txt")
    if not os.path.isfile(local):
        download(SHAKESPEARE_URL, local)
    return local


def download(url: str, dest: str) -> None:
    """Fetch url into dest atomically (a partial download never takes dest's name)."""
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    tmp = dest + ".part"
    log(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=30) as resp, open(tmp, "wb") as out:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(
            f"could not download {url} ({e}). Offline? Pass --input PATH to a local copy of the file"
        ) from None
    os.replace(tmp, dest)


def read_text(path: str) -> str:
    if not os.path.exists(path):
        raise UserError(f"input file {path!r} not found")
    return read_txt(path)


def write_dataset(folder: str, splits: dict[str, Sequence[int]], meta: dict[str, Any]) -> None:
    """Write every split and meta.json under temporary names, then rename them into place, meta.json last."""
    contents = {f"{split}.bin": np.asarray(ids, dtype=meta["dtype"]).tobytes() for split, ids in splits.items()}
    contents["meta.json"] = (json.dumps(meta, ensure_ascii=False) + "\n").encode("utf-8")
    staged = []
    try:
        os.makedirs(folder, exist_ok=True)
        for name, data in contents.items():
            final = os.path.join(folder, name)
            staged.append((final + ".tmp", final))
            write_file(final + ".tmp", data)
    except OSError as e:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise UserError(
            f"cannot write the dataset into {folder!r}: {e.strerror}; check the folder and free space"
        ) from None
    for tmp, final in staged:
        os.replace(tmp, final)


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())

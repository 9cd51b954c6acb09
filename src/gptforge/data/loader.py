"""Reading prepared datasets: meta.json (or nanoGPT's meta.pkl) and batches of token windows.

A dataset folder `<data_dir>/<dataset>/` holds `train.bin` and `val.bin` (flat arrays of token ids, uint16
when the vocabulary fits, else uint32) and `meta.json`. nanoGPT's folders (meta.pkl, or no meta at all for
GPT-2 BPE data) are read as they are.

    batches = RandomBatches("data/shakespeare_char/train.bin", batch_size=12, block_size=64,
                            vocab_size=65, device="cpu")
    x, y = batches.next_batch()      # (B, T) int64 each; y is x shifted left by one token
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import numpy as np
import torch

from gptforge.errors import UserError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dataset_dir(data_dir: str, dataset: str) -> str:
    folder = os.path.join(data_dir, dataset)
    if not os.path.isdir(folder):
        raise UserError(
            f"dataset folder {folder!r} not found: create it with `gptforge prepare {dataset}` "
            "(or `gptforge prepare text FILE --name NAME`), or point --data_dir / --dataset at an existing one"
        )
    return folder


def read_meta(folder: str) -> dict[str, Any]:
    """The dataset's meta: vocab_size, tokenizer ('char' + itos, or 'gpt2'), dtype, eot_token.

    meta.json first; else nanoGPT's meta.pkl (char-level); else nanoGPT's GPT-2 BPE default.
    """
    path = os.path.join(folder, "meta.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                meta = json.load(fh)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not readable JSON ({e}); re-run `gptforge prepare`") from None
        _check_meta(meta, path)
        return meta
    pkl = os.path.join(folder, "meta.pkl")
    if os.path.isfile(pkl):
        return _read_meta_pkl(pkl)
    return {"vocab_size": 50257, "tokenizer": "gpt2", "dtype": "uint16", "eot_token": 50256}


def _check_meta(meta: Any, path: str) -> None:
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int) or meta["vocab_size"] <= 0:
        raise UserError(f"{path}: needs a positive integer 'vocab_size'; re-run `gptforge prepare`")
    if meta.get("tokenizer") not in ("char", "gpt2"):
        raise UserError(f"{path}: 'tokenizer' must be 'char' or 'gpt2', got {meta.get('tokenizer')!r}")
    if meta.get("dtype", "uint16") not in DTYPES:
        raise UserError(f"{path}: 'dtype' must be one of {', '.join(DTYPES)}, got {meta.get('dtype')!r}")
    if meta["tokenizer"] == "char":
        itos = meta.get("itos")
        if not isinstance(itos, list) or len(itos) != meta["vocab_size"]:
            raise UserError(f"{path}: a char dataset needs 'itos', a list of vocab_size={meta['vocab_size']} chars")
    meta.setdefault("dtype", "uint16")


class _NoObjects(pickle.Unpickler):
    """Unpickles plain containers only: dict, list, str, int need no classes, so any class lookup is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: meta.pkl may hold only dicts, str and int")


def _read_meta_pkl(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = _NoObjects(fh).load()
    except Exception as e:  # any unpickling failure is the file's fault, never a reason to run its code
        raise UserError(f"{path}: not a plain nanoGPT meta.pkl ({e})") from None
    itos = raw.get("itos") if isinstance(raw, dict) else None
    ok = isinstance(raw.get("vocab_size") if isinstance(raw, dict) else None, int) and isinstance(itos, dict)
    if not ok or sorted(itos) != list(range(len(itos))) or not all(isinstance(c, str) for c in itos.values()):
        raise UserError(f"{path}: expected nanoGPT's {{'vocab_size': int, 'itos': {{int: str}}, 'stoi': ...}}")
    meta = {"vocab_size": raw["vocab_size"], "tokenizer": "char", "itos": [itos[i] for i in range(len(itos))]}
    _check_meta(meta, path)
    return meta


def open_tokens(path: str, dtype: str = "uint16") -> np.memmap:
    """A read-only view of a token file, checked for being whole tokens."""
    if not os.path.isfile(path):
        raise UserError(f"token file {path!r} not found; run `gptforge prepare` for this dataset")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise UserError(
            f"{path}: {size} bytes is not a whole number of {dtype} tokens; the file is truncated or "
            "not this dataset's format. Re-run `gptforge prepare`"
        )
    if size == 0:
        raise UserError(f"{path} is empty; re-run `gptforge prepare` with more text")
    return np.memmap(path, dtype=DTYPES[dtype], mode="r")


class RandomBatches:
    """nanoGPT's get_batch: each batch is batch_size windows of block_size + 1 tokens at random offsets.

    A fresh memmap per batch (numpy memmaps hold on to pages otherwise); one vectorised fancy-index read.

    Offsets come from torch's global generator, as in nanoGPT, so a run draws exactly the batches nanoGPT
    draws for the same seed and reproduces its losses. The loader's resumable state is then that generator's
    state before the next draw (state_dict); with `seed`, a private generator is used instead.
    """

    def __init__(
        self, path: str, batch_size: int, block_size: int, vocab_size: int, device: str, seed: int | None = None,
        dtype: str = "uint16",
    ):
        self.path, self.dtype = path, dtype
        self.batch_size, self.block_size, self.vocab_size = batch_size, block_size, vocab_size
        self.device = torch.device(device)
        self.n_tokens = len(open_tokens(path, dtype))
        if self.n_tokens <= block_size:
            raise UserError(
                f"{path} holds {self.n_tokens} tokens, not more than block_size={block_size}; "
                "use a smaller --block_size or more data"
            )
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.offsets = np.arange(block_size + 1, dtype=np.int64)  # (T+1,)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
        ix = torch.randint(self.n_tokens - self.block_size, (self.batch_size,), generator=self.generator)
        windows = data[ix.numpy()[:, None] + self.offsets]  # (B, T+1), one gather from the page cache
        top = int(windows.max())
        if top >= self.vocab_size:
            raise UserError(
                f"{self.path} holds token id {top}, but the model's vocab_size is {self.vocab_size}: the data "
                "and the model do not match. Re-run `gptforge prepare`, or check the dataset's meta.json"
            )
        buf = torch.from_numpy(windows.astype(np.int64))  # (B, T+1)
        x, y = buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # (B, T) each
        if self.device.type == "cuda":
            # Page-locked host memory lets the copy overlap with the GPU's work on the previous batch.
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict[str, Any]:
        """Where the batch sequence stands: the generator's state before the next draw."""
        state = self.generator.get_state() if self.generator is not None else torch.get_rng_state()
        return {"kind": "random", "generator": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the sequence; with the global generator this sets torch's global RNG state."""
        assert state.get("kind") == "random", f"data state of kind {state.get('kind')!r} given to RandomBatches"
        if self.generator is not None:
            self.generator.set_state(state["generator"])
        else:
            torch.set_rng_state(state["generator"])

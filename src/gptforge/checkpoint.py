"""Checkpoints: atomic writes, safe reads, and the random-number state a resumed run needs.

A checkpoint is a dict with nanoGPT's keys (`model`, `optimizer`, `model_args`, `iter_num`, `best_val_loss`,
`config`) plus ours (`scaler`, `rng`, `data_state`, `tokenizer`, `format_version`). It holds only plain
containers, numbers, strings and tensors, so it loads with `torch.load(weights_only=True)`, which refuses
pickled code. nanoGPT's own checkpoints load as they are.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from gptforge.errors import UserError

FORMAT_VERSION = 1
_PREFIXES = ("_orig_mod.", "module.")  # added by torch.compile and by DDP wrappers


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write to a temporary file in the same folder, fsync, rename over `path`, fsync the folder.

    A crash at any moment leaves either the previous checkpoint or the new one, never a torn file.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"cannot write checkpoint {path}: {e.strerror}; the previous checkpoint is intact") from None
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with weights_only=True; every failure is a clear error naming the file."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} not found; train first, or point --out_dir at a run folder")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError... for unreadable files
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            reason = "it holds pickled objects other than tensors and plain data, and such files can run code"
        raise UserError(f"cannot read checkpoint {path}: {reason}") from None
    if not isinstance(ckpt, dict) or not {"model", "model_args"} <= set(ckpt):
        raise UserError(f"{path} is not a gptforge or nanoGPT checkpoint (no 'model' and 'model_args' keys)")
    ckpt["model"] = clean_state_dict(ckpt["model"])
    return ckpt


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip torch.compile / DDP prefixes and drop the causal-mask buffers older nanoGPT versions saved."""
    out = {}
    for key, value in state.items():
        while key.startswith(_PREFIXES):  # in any order and nesting: DDP(compile(model)) gives both
            key = key.split(".", 1)[1]
        if key.endswith((".attn.bias", ".attn.masked_bias")) and value.dim() == 4:
            continue  # a (1, 1, T, T) mask buffer, not a parameter
        out[key] = value
    return out


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    """load_state_dict with a clear error naming the file when the shapes or names do not match."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = [line.strip() for line in str(e).splitlines() if line.strip()][1:3]
        raise UserError(
            f"{path} does not fit this model ({'; '.join(first)}): it was saved with other model settings "
            "(n_layer, n_head, n_embd, block_size, vocab_size, bias)"
        ) from None


def capture_rng() -> dict[str, Any]:
    """Every random-number generator a training step draws from, in plain containers and tensors."""
    keys, pos, has_gauss, gauss = np.random.get_state()[1:]
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])

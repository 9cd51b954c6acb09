"""The model a command reads: a run's checkpoint (--out_dir / --ckpt) or Hugging Face weights (--init_from), with
its tokenizer, for sample, eval and export."""

from __future__ import annotations

import os
from typing import Any

from gptforge.core.console import log
from gptforge.core.errors import UserError
from gptforge.data.loader import read_meta
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokenizer.spec import Tokenizer, folder_tokenizer, from_spec
from gptforge.weights.checkpoint import checkpoint_model_args, checkpoint_path, load_checkpoint


def load_checkpoint_model(path: str, device: str) -> tuple[GPT, Tokenizer, dict[str, Any]]:
    """A checkpoint file's model (eval mode, on `device`), its tokenizer, and the checkpoint itself."""
    ckpt = load_checkpoint(path, map_location="cpu")
    model, _ = checkpoint_model(ckpt, path)
    model.eval().to(device)
    return model, checkpoint_tokenizer(ckpt), ckpt


def checkpoint_model(ckpt: dict[str, Any], path: str, dropout: float = 0.0) -> tuple[GPT, dict[str, Any]]:
    """The GPT a loaded checkpoint (read from `path`) holds, with its weights, and its model_args; a clear error
    naming the file when its weights' shapes or names do not fit the model its model_args describe."""
    args = checkpoint_model_args(ckpt, path)
    model = GPT(GPTConfig(**args, dropout=dropout))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        first = [line.strip() for line in str(e).splitlines() if line.strip()][1:3]
        raise UserError(
            f"{path} does not fit this model ({'; '.join(first)}): it was saved with other model settings "
            "(n_layer, n_head, n_embd, block_size, vocab_size, bias)"
        ) from None
    return model, args


def checkpoint_tokenizer(ckpt: dict[str, Any]) -> Tokenizer:
    """The tokenizer a checkpoint records; for nanoGPT's (which record none) its dataset's meta, else GPT-2 BPE."""
    if ckpt.get("tokenizer"):
        return from_spec(ckpt["tokenizer"])
    config = ckpt.get("config") or {}
    if "dataset" in config:  # nanoGPT: the dataset folder's meta.pkl, if it is still where it was
        folder = os.path.join(config.get("data_dir", "data"), config["dataset"])
        if os.path.isdir(folder):
            return from_spec(read_meta(folder))
    log("no tokenizer recorded in the checkpoint and no dataset meta found: assuming GPT-2 BPE")
    return from_spec({"tokenizer": "gpt2"})


def load_model(
    out_dir: str, ckpt: str | None, init_from: str, device: str
) -> tuple[GPT, Tokenizer, dict[str, Any] | None]:
    """The model `sample` and `eval` read, in eval mode on `device`: a run's checkpoint (init_from 'resume':
    --ckpt, else <out_dir>/ckpt.pt) or Hugging Face weights (a GPT-2 hub name, or a folder, read with the tokenizer
    its gptforge_tokenizer.json names: an export of a character-level or own-BPE run round-trips). Returns
    (model, tokenizer, the checkpoint or None)."""
    if ckpt and init_from != "resume":
        raise UserError(f"--ckpt={ckpt} and --init_from={init_from} each name the model to load; give one of them")
    if init_from == "resume":
        return load_checkpoint_model(checkpoint_path(out_dir, ckpt), device)
    if init_from.endswith(".gguf"):
        from gptforge.weights.gguf_file import read_gguf

        if not os.path.isfile(init_from):
            raise UserError(f"--init_from={init_from}: no such file; give a GGUF file `gptforge export` wrote")
        model, tok, chat = read_gguf(init_from)
        return model.to(device), tok, {"config": {"task": "sft"} if chat else {}}
    from gptforge.weights.pretrained import load_pretrained

    tok = folder_tokenizer(init_from) if os.path.isdir(init_from) else from_spec({"tokenizer": "gpt2"})
    model, _ = load_pretrained(init_from)
    return model.eval().to(device), tok, None

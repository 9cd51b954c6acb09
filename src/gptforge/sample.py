"""Sample text from a trained run.

    gptforge sample --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 --max_new_tokens=200

Prints each sample to stdout followed by a line of dashes, and nothing else on stdout (information goes to
stderr), so the output can be piped. The tokenizer comes from the checkpoint (gptforge stores it); for a
nanoGPT checkpoint, from the dataset folder named in its config (meta.pkl / meta.json), else GPT-2 BPE.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

from gptforge.checkpoint import load_checkpoint, load_model_state
from gptforge.data.loader import read_meta
from gptforge.distributed import autocast_context, resolve_device, resolve_dtype
from gptforge.errors import UserError
from gptforge.model import GPT, MODEL_ARGS, GPTConfig
from gptforge.tokenizer import Tokenizer, from_spec

SEPARATOR = "---------------"


@dataclass
class SampleArgs:
    out_dir: str = "out"
    init_from: str = "resume"  # 'resume' (out_dir/ckpt.pt), a GPT-2 name ('gpt2', ...) or a Hugging Face folder
    start: str = "\n"
    num_samples: int = 10
    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: int = 200
    top_p: float = 1.0
    stop_token: int = -1
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    use_cache: bool = True


def load_run(out_dir: str, device: str) -> tuple[GPT, Tokenizer]:
    """The model of `<out_dir>/ckpt.pt` in eval mode on `device`, and the tokenizer it was trained with."""
    model, tok, _ = load_checkpoint_model(os.path.join(out_dir, "ckpt.pt"), device)
    return model, tok


def load_checkpoint_model(path: str, device: str) -> tuple[GPT, Tokenizer, dict]:
    """A checkpoint file's model (eval mode, on `device`), its tokenizer, and the checkpoint itself."""
    ckpt = load_checkpoint(path, map_location="cpu")
    model = GPT(GPTConfig(**{k: ckpt["model_args"][k] for k in MODEL_ARGS}, dropout=0.0))
    load_model_state(model, ckpt["model"], path)
    model.eval().to(device)
    return model, checkpoint_tokenizer(ckpt), ckpt


def checkpoint_tokenizer(ckpt: dict) -> Tokenizer:
    if ckpt.get("tokenizer"):
        return from_spec(ckpt["tokenizer"])
    config = ckpt.get("config") or {}
    if "dataset" in config:  # nanoGPT: the dataset folder's meta.pkl, if it is still where it was
        folder = os.path.join(config.get("data_dir", "data"), config["dataset"])
        if os.path.isdir(folder):
            meta = read_meta(folder)
            return from_spec(meta)
    print("no tokenizer recorded in the checkpoint and no dataset meta found: assuming GPT-2 BPE", file=sys.stderr)
    return from_spec({"tokenizer": "gpt2"})


def read_start(start: str) -> str:
    """--start is the prompt itself, or FILE:path to read it from a file."""
    if not start.startswith("FILE:"):
        return start
    path = start[len("FILE:") :]
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as e:
        raise UserError(f"--start=FILE:{path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--start=FILE:{path}: not UTF-8 text ({e}); convert it to UTF-8 first") from None


def load_model(args: SampleArgs, device: str) -> tuple[GPT, Tokenizer]:
    if args.init_from == "resume":
        return load_run(args.out_dir, device)
    from gptforge.pretrained import load_pretrained

    model, _ = load_pretrained(args.init_from)
    return model.eval().to(device), from_spec({"tokenizer": "gpt2"})


def sample(args: SampleArgs, out=None) -> list[str]:
    """Generate args.num_samples continuations of args.start, streaming each to `out` (stdout) as it grows.

    Samples are drawn one after another, each from its own generator seeded args.seed + i, so sample i is the
    same whatever num_samples is. Returns the texts.
    """
    out = out or sys.stdout
    for key in ("num_samples", "max_new_tokens"):
        if getattr(args, key) <= 0:
            raise UserError(f"--{key} must be a positive integer, got {getattr(args, key)}")
    if not 0.0 <= args.temperature < math.inf:
        raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise UserError(f"--top_k must not be negative (0 = all tokens), got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        raise UserError(f"--top_p must be in (0, 1], got {args.top_p} (1 = off)")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device.split(":")[0])
    model, tok = load_model(args, device)
    start = read_start(args.start)
    try:
        prompt = tok.encode(start)
    except UserError as e:
        raise UserError(f"--start: {e}") from None
    if not prompt:
        if tok.eot_token is None:
            raise UserError("--start is empty; give a prompt (a char-level model has no end-of-text token)")
        prompt = [tok.eot_token]
    if args.stop_token >= model.config.vocab_size:
        raise UserError(f"--stop_token={args.stop_token} is not below the model's vocab_size {model.config.vocab_size}")
    print(f"generating {args.num_samples} sample(s) of up to {args.max_new_tokens} tokens on {device} ({dtype}"
          f"{', KV cache' if args.use_cache else ''})", file=sys.stderr, flush=True)
    texts = []
    for i in range(args.num_samples):
        generator = torch.Generator(device=device).manual_seed(args.seed + i)
        idx = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
        ids, shown = list(prompt), start if tok.decode(prompt) == start else tok.decode(prompt)
        out.write(shown)
        with autocast_context(device.split(":")[0], dtype):
            for token in model.generate_stream(idx, args.max_new_tokens, temperature=args.temperature,
                                               top_k=args.top_k or None, top_p=args.top_p, generator=generator,
                                               stop_token=args.stop_token if args.stop_token >= 0 else None,
                                               use_cache=args.use_cache):
                ids.append(int(token))
                text = tok.decode(ids)
                if not text.endswith("\ufffd"):  # hold back a multi-byte character until it is whole
                    out.write(text[len(shown):])
                    out.flush()
                    shown = text
        text = tok.decode(ids)
        out.write(text[len(shown):] + "\n" + SEPARATOR + "\n")
        out.flush()
        texts.append(text)
    return texts

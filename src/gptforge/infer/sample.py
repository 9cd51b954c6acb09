"""`gptforge sample`: continuations of a prompt from a run's checkpoint or GPT-2's weights, streamed to stdout
(information goes to stderr, so the output can be piped); and Sampler, the samples drawn during training."""

from __future__ import annotations

import sys
from typing import Any

import torch

from gptforge.core.console import log
from gptforge.core.device import autocast_context, device_type, inference_dtype, resolve_device
from gptforge.core.distributed import DistEnv
from gptforge.core.errors import UserError
from gptforge.core.settings import check_fields
from gptforge.data.sources import read_txt
from gptforge.infer.engine import generate, generate_stream
from gptforge.infer.options import SampleArgs
from gptforge.model.cache import evaluating
from gptforge.model.gpt import GPT
from gptforge.tokenizer.spec import from_spec, tokenizer_spec
from gptforge.weights.load import load_model

SEPARATOR = "---------------"


def read_start(start: str) -> str:
    """--start is the prompt itself, or FILE:path to read it from a file."""
    if not start.startswith("FILE:"):
        return start
    path = start[len("FILE:") :]
    return read_txt(path, f"--start=FILE:{path}")


def sample(args: SampleArgs, out=None) -> list[str]:
    """Generate args.num_samples continuations of args.start, streaming each to `out` (stdout) as it grows.

    Samples are drawn one after another, each from its own generator seeded args.seed + i, so sample i is the
    same whatever num_samples is. Returns the texts.
    """
    out = out or sys.stdout
    check_fields(args)
    device = resolve_device(args.device)
    model, tok, _ = load_model(args.out_dir, args.ckpt, args.init_from, device)
    dtype = inference_dtype(args.dtype, device_type(device), model.config.n_embd)  # train's rule, for this model
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
    log(
        f"generating {args.num_samples} sample(s) of up to {args.max_new_tokens} tokens on {device} ({dtype}"
        f"{', KV cache' if args.use_cache else ''}, {args.window} window)"
    )
    if args.window == "stream" and not (model.config.rotary and args.use_cache):
        raise UserError(
            "--window=stream slides the KV cache, which needs a rotary model (this one has learned positions, "
            "which end at block_size) and the cache (no --no_cache): use --window=slide or half"
            if not model.config.rotary
            else "--window=stream is the KV cache's own window: drop --no_cache"
        )
    with autocast_context(device_type(device), dtype):
        return [stream_one(model, tok, prompt, start, args, args.seed + i, out) for i in range(args.num_samples)]


def stream_one(model: GPT, tok: Any, prompt: list[int], start: str, args: SampleArgs, seed: int, out) -> str:
    """One sample from its own generator (seeded `seed`), written to `out` as it grows; returns its text."""
    device = str(next(model.parameters()).device)
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    ids, shown = list(prompt), start if tok.decode(prompt) == start else tok.decode(prompt)
    out.write(shown)
    for token in generate_stream(
        model,
        idx,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        generator=generator,
        stop_token=args.stop_token if args.stop_token >= 0 else None,
        use_cache=args.use_cache,
        window=args.window,
    ):
        ids.append(int(token))
        text = tok.decode(ids)
        if not text.endswith("\ufffd"):  # hold back a multi-byte character until it is whole
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    text = tok.decode(ids)
    out.write(text[len(shown) :] + "\n" + SEPARATOR + "\n")
    out.flush()
    return text


class Sampler:
    """Text samples during training from a private generator (seed 42 + rank): training's RNG is untouched."""

    def __init__(self, prompt: str, n: int, tokens: int, meta: dict[str, Any], env: DistEnv, given: bool = True):
        """n samples of `tokens` tokens after `prompt`; a prompt the vocabulary cannot encode is a UserError when it
        was `given` (--sample_prompt), else (build-nanogpt's default, for a character vocabulary that lacks some of
        its letters) token 0 instead."""
        self.tok, self.text = from_spec(tokenizer_spec(meta)), prompt
        try:
            self.prompt = self.tok.encode(prompt) or [self.tok.eot_token or 0]
        except UserError as e:
            if given:
                raise UserError(f"--sample_prompt: {e}") from None
            self.text, self.prompt = self.tok.decode([0]), [0]
        self.n, self.tokens, self.device = n, tokens, env.device
        self.generator = torch.Generator(device=env.device).manual_seed(42 + env.rank)

    def sample(self, model: GPT, ctx) -> list[str]:
        idx = torch.tensor([self.prompt] * self.n, dtype=torch.long, device=self.device)  # (n, T)
        with evaluating(model), ctx:
            out = generate(model, idx, self.tokens, temperature=1.0, top_k=50, generator=self.generator)
        return [self.tok.decode(row.tolist()) for row in out]

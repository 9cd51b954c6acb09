"""The one-token decode step as a compiled graph (`chat` and `serve`'s --compile). A small model's token is a few
hundred small operators, each paying eager PyTorch's dispatch: compiled over a cache of fixed shape, they become a
handful of fused kernels, and the weights are packed once for the CPU's matrix kernels (inductor's freezing).

The cache is read whole: each row's new key and value go to its own position, every one of the cache's max_len keys
is attended to and a mask hides those past each row's length, so the shapes do not change from one step to the
next and one graph serves every step (and, marked dynamic, every batch size from 2 up). Prefills (a prompt, a turn
of several tokens) stay eager: their lengths vary and they are rare."""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gptforge.core.console import log
from gptforge.core.errors import UserError
from gptforge.model.cache import KVCache
from gptforge.model.gpt import GPT


class WholeCache:
    """GPT's cache protocol over whole per-layer caches ks, vs (slots, nh, max_len, hs): row b's new key goes to
    position lengths[b]; every key of rows 0..B-1 is returned (the mask hides those past each row's length)."""

    ring = False
    position = 0  # read by GPT only without explicit positions: never here

    def __init__(self, ks: list[torch.Tensor], vs: list[torch.Tensor], lengths: torch.Tensor):
        self.ks, self.vs, self.lengths = ks, vs, lengths
        self.length = ks[0].size(2) - 1  # more than 0: one token after cached ones, not a causal prefill

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = k.size(0)
        K, V = self.ks[layer], self.vs[layer]
        rows = torch.arange(B, device=k.device)
        K[rows, :, self.lengths] = k[:, :, 0].to(K.dtype)  # into the whole cache, not a view of it: written in place
        V[rows, :, self.lengths] = v[:, :, 0].to(V.dtype)
        return K[:B], V[:B]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per row over all max_len keys, written out: two batched matrix-vector products and a softmax
        (in float32) that the compiler fuses; SDPA's CPU kernel took several times as long in bf16 with a few rows
        (docs/lab/2026-11-25-serve.md)."""
        scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5  # (B, nh, 1, max_len)
        weights = scores.float().masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return weights.to(v.dtype) @ v  # (B, nh, 1, hs)

    def advance(self, T: int) -> None:
        """Each row's length is the caller's to keep."""


def decode_logits(
    model: GPT, tokens: torch.Tensor, lengths: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]
) -> torch.Tensor:
    """Next-token logits (B, V) in float32 for tokens (B, 1) fed after the lengths[b] tokens each row holds."""
    keys = torch.arange(ks[0].size(2), device=tokens.device)
    mask = (keys <= lengths[:, None])[:, None, None, :]  # (B, 1, 1, max_len): a row's own keys and the new one
    hidden = model.hidden_states(tokens, cache=WholeCache(ks, vs, lengths), positions=lengths[:, None], mask=mask)
    return model.logits(hidden[:, -1]).float()


class DecodeStep:
    """`step(tokens (B, 1), lengths (B,), ks, vs)`: decode_logits, compiled once per model and shared by every
    cache of the same shape (a chat's, the server's slots)."""

    def __init__(self, model: GPT):
        # here, not at the top: a slow import eager decoding never needs (docs/lab/2026-11-30-epyc-zen4-suite.md)
        import torch._inductor.config

        self.model = model
        self.compiled = torch.compile(self._run)

    def _run(self, tokens, lengths, ks, vs):
        return decode_logits(self.model, tokens, lengths, ks, vs)

    def __call__(self, tokens, lengths, ks, vs) -> torch.Tensor:
        if tokens.size(0) > 1:  # one graph for every batch size from 2 (1 is a shape of its own to the compiler)
            torch._dynamo.mark_dynamic(tokens, 0)
            torch._dynamo.mark_dynamic(lengths, 0)
        # Freezing: the weights become constants of the graph, packed once for the CPU's matrix kernels (inference
        # only: the weights must not change afterwards). Read when a graph is compiled, inside this call (~16 us).
        with torch._inductor.config.patch(freezing=True):  # imported by __init__
            return self.compiled(tokens, lengths, ks, vs)


def compiler_missing(device: str) -> str | None:
    """Why torch.compile cannot work on `device` here, or None."""
    if device.startswith("cuda"):
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed"
        return None
    if device == "cpu":
        return None if any(shutil.which(c) for c in ("g++", "c++", "clang++")) else "no C++ compiler (g++) found"
    return f"torch.compile is not used on {device}"


def enable_compile(lm: Any, setting: str, slots: int, batch_sizes: tuple[int, ...] = (1,)) -> None:
    """Compile lm's decode step for caches of `slots` rows and warm it up on each batch size (the compile happens
    here, before the first user waits); sets lm.decode. setting 'off' leaves decoding eager; 'auto' falls back to
    eager (and says why) where compiling is impossible or fails; 'on' makes that an error."""
    if setting == "off":
        return
    missing = compiler_missing(lm.device)
    if missing:
        if setting == "on":
            raise UserError(f"--compile on: {missing}; use --compile=off")
        log(f"decode: eager ({missing})")
        return
    step = DecodeStep(lm.model)
    log("decode: compiling the one-token step (once, a few seconds)...")
    try:
        with ctrl_c_kept():
            warm_up(lm, step, slots, batch_sizes)
    except Exception as e:  # inductor's many ways to fail on an unusual machine: eager still works
        if setting == "on":
            raise UserError(f"--compile on: compiling the decode step failed ({type(e).__name__}: {e})") from e
        log(f"decode: eager (compiling failed: {type(e).__name__}: {str(e).splitlines()[0][:200]})")
        return
    lm.decode = step


@contextlib.contextmanager
def ctrl_c_kept() -> Iterator[None]:
    """Ctrl-C inside the block raises KeyboardInterrupt as usual, and once more when the block ends if it was
    lost: torch.compile's tracing can swallow one (seen in `gptforge serve`: a Ctrl-C while the decode step
    compiled, and the server started anyway). Outside the main thread, where no signal arrives, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit: list[int] = []

    def interrupted(signum: int, frame: Any) -> None:
        hit.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if hit:
        raise KeyboardInterrupt


def warm_up(lm: Any, step: Callable, slots: int, batch_sizes: tuple[int, ...]) -> None:
    """Prefill two tokens into a throw-away cache of `slots` rows, then step each batch size once."""
    config = lm.model.config
    with torch.no_grad(), lm.autocast():
        cache = KVCache(config.n_layer, config.block_size)
        lm.model(torch.zeros(slots, 2, dtype=torch.long, device=lm.device), cache=cache)
        for b in batch_sizes:
            tokens = torch.zeros(b, 1, dtype=torch.long, device=lm.device)
            step(tokens, torch.full((b,), 2, device=lm.device), cache.k, cache.v)

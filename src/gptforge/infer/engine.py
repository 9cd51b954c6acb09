"""Generation from a GPT, apart from the network: the sampling rule (temperature, top-k, top-p), the KV cache, the
context windows once a sequence outgrows block_size, and streaming. `generate` / `generate_stream` serve sample,
samples during training and lm-eval; `Rows` is the cached, step-by-step interface that chat and serve build on:
prefill a batch of prompts, step the rows one token at a time, extend them with more tokens later (the next turn
of a conversation), all against one KV cache."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.nn import functional as F

from gptforge.infer.options import WINDOWS  # the context windows once a sequence outgrows block_size
from gptforge.model.cache import KVCache
from gptforge.model.gpt import GPT


@torch.no_grad()
def generate(
    model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, **options
) -> torch.Tensor:
    """Append up to max_new_tokens sampled tokens to idx (B, T); returns (B, T + n).

    temperature 0 = greedy; top_k keeps the k likeliest tokens; `options` are generate_stream's: top_p (the
    smallest set holding p of the probability), stop_token (generation ends early once every row has
    produced it; finished rows are padded with it), generator (draws from it leave the global RNG alone),
    use_cache, window ('slide', nanoGPT's context, or 'half', faster on long samples).
    """
    return torch.cat([idx, *generate_stream(model, idx, max_new_tokens, temperature, top_k, **options)], dim=1)


@torch.no_grad()
def generate_stream(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    window: str = "slide",
) -> Iterator[torch.Tensor]:
    """Yield each new token (B, 1) as it is sampled; see generate().

    The context each token is predicted from (`window`), once the sequence no longer fits in block_size:
    - 'slide' (nanoGPT's sample.py): the last block_size tokens at every step. Positions are absolute, so
      every cached key shifts by one each step: the window is run from scratch per token.
    - 'half': only the last block_size // 2 tokens, growing again from there until it fills: one pass per
      block_size // 2 tokens, then cached steps, so faster on long samples but a shorter context.
    - 'stream' (rotary models, with the cache): the cache keeps the last block_size tokens' keys and values
      and drops the oldest, so every step is one cached token. Each kept key keeps the context it was
      computed in: sliding-window attention over the whole sequence, not 'slide's recomputed window.
    While the sequence fits, all feed the whole sequence. With the cache, a window is run once (prefill),
    then one token per step; without it, the same window is recomputed at every step: same tokens.
    """
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")
    if window == "stream" and not (model.config.rotary and use_cache):
        raise ValueError("window 'stream' needs a rotary model (learned positions end at block_size) and the cache")
    block_size = model.config.block_size
    cache, cache_start, start = None, -1, max(0, idx.size(1) - block_size)
    seq = idx
    done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        start = context_start(seq.size(1), start, block_size, window)
        if window == "stream" and cache is None:
            cache = KVCache(model.config.n_layer, block_size, ring=True)
            logits, _ = model(seq[:, start:], cache=cache)  # prefill: the last block_size tokens at most
        elif window == "stream" or (use_cache and cache is not None and start == cache_start):
            logits, _ = model(seq[:, -1:], cache=cache)  # one new token against the cached ones
        elif use_cache and (window == "half" or seq.size(1) < block_size):
            # a window that later steps extend: 'half' always, 'slide' only until the sequence fills it
            cache, cache_start = KVCache(model.config.n_layer, block_size), start
            logits, _ = model(seq[:, start:], cache=cache)  # prefill the window
        else:
            cache = None  # a sliding window's cache would be stale at the next step: free it
            logits, _ = model(seq[:, start:])
        token = sample_next(logits[:, -1, :].float(), temperature, top_k, top_p, generator)  # (B, 1)
        if stop_token is not None:
            token = token.masked_fill(done.unsqueeze(1), stop_token)
            done |= token.squeeze(1) == stop_token
        seq = torch.cat((seq, token), dim=1)
        yield token
        if stop_token is not None and bool(done.all()):
            return


def context_start(length: int, start: int, block_size: int, window: str) -> int:
    """Where the context of the next token begins in a sequence of `length` tokens, given the previous step's
    `start`: 'slide' keeps the last block_size tokens; 'half' keeps its window until the window outgrows
    block_size, then restarts it from the last block_size // 2 tokens."""
    if window in ("slide", "stream"):
        return max(0, length - block_size)
    if length - start > block_size:
        return length - max(1, block_size // 2)
    return start


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from logits (B, V): greedy at temperature 0, else softmax sampling after top-k / top-p."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[:, [-1]]  # (B, 1): the k-th largest logit
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # (B, V)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already hold top_p: the likeliest one always stays
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, -float("inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)


class Rows:
    """A batch of rows generated step by step against one KV cache, for callers that choose each next token
    themselves (chat, serve). `feed(idx)` runs idx (B, T) after everything fed before: the prompt first (the
    prefill), then each sampled token (B, 1), or several tokens at once (the next turn of a conversation: only
    those are computed, the cached ones are not read again). Returns the next-token logits (B, V) in float32.
    `room` says how many more tokens fit (block_size in all: positions past it do not exist for learned
    position tables)."""

    def __init__(self, model: GPT, max_len: int | None = None, step=None):
        self.model, self.step = model, step  # step: a compiled one-token step (infer/decode.py) or None
        self.cache = KVCache(model.config.n_layer, max_len or model.config.block_size)

    @property
    def length(self) -> int:
        return self.cache.position

    @property
    def room(self) -> int:
        return self.cache.max_len - self.cache.position

    def truncate(self, length: int) -> None:
        """Forget every token after the first `length` (a conversation rewound or re-rendered): the next feed
        continues from there, writing over what was held."""
        assert 0 <= length <= self.cache.position, f"cannot keep {length} of {self.cache.position} tokens"
        self.cache.position = length

    @torch.no_grad()
    def feed(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.size(1) > self.room:
            raise ValueError(f"{idx.size(1)} more tokens do not fit: {self.length} held of {self.cache.max_len}")
        if self.step is not None and idx.size(1) == 1 and self.cache.position > 0:
            lengths = torch.full((idx.size(0),), self.cache.position, device=idx.device)
            logits = self.step(idx, lengths, self.cache.k, self.cache.v)
            self.cache.advance(1)
            return logits
        logits, _ = self.model(idx, cache=self.cache)  # (B, 1, V): the last position's
        return logits[:, -1, :].float()

"""The KV cache and the attention rules of what it holds (cached_rule) and of packed documents (document_mask), and
eval mode for a while (evaluating). Torch only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """The model in eval mode (no dropout) inside the block, back in the mode it had after it, even on an error."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class KVCache:
    """Keys and values of the tokens seen so far, per layer, so generation feeds one new token per step.

    Filled by a prefill (the whole prompt, causal) and then one token at a time. `position` tokens have been
    seen (the next one's position); `length` are held. A `ring` cache (rotary models, window 'stream') holds the
    last max_len and overwrites the oldest once full: attention of one query over its keys does not depend on
    their order, and rotary keys carry their own positions. Allocated on first use in the dtype the attention
    produces (float32, or bf16 / fp16 under autocast).
    """

    def __init__(self, n_layer: int, max_len: int, ring: bool = False):
        self.n_layer, self.max_len, self.ring = n_layer, max_len, ring
        self.position = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) after the cached ones; return every key and value held (B, nh, L, hs)."""
        B, nh, T, hs = k.shape
        if len(self.k) <= layer:
            self.k.append(k.new_zeros(B, nh, self.max_len, hs))  # zeros: a compiled step reads whole caches
            self.v.append(v.new_zeros(B, nh, self.max_len, hs))
        if self.position + T > self.max_len:
            assert self.ring and T == 1, "KV cache overflow: generate() re-prefills before this happens"
            slot = self.position % self.max_len  # the oldest token's place
            self.k[layer][:, :, slot : slot + 1] = k
            self.v[layer][:, :, slot : slot + 1] = v
            return self.k[layer], self.v[layer]
        self.k[layer][:, :, self.position : self.position + T] = k
        self.v[layer][:, :, self.position : self.position + T] = v
        return self.k[layer][:, :, : self.position + T], self.v[layer][:, :, : self.position + T]

    def advance(self, T: int) -> None:
        """After every layer has stored T new tokens."""
        self.position += T

    @property
    def length(self) -> int:
        """Tokens held: every one seen, up to max_len."""
        return min(self.position, self.max_len)


def cached_rule(cache, T: int, mask: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor | None, bool]:  # noqa: ANN001
    """(mask, causal) for T new queries after what `cache` holds (any cache speaking KVCache's protocol): a prefill
    (empty cache) is causal over the prompt; one new token attends to every cached one, all in its past; several new
    tokens after cached ones (a conversation's next turn) see all the cached ones and, among themselves, their past."""
    past = cache.length
    assert past == 0 or T == 1 or not cache.ring, "a ring cache takes one token at a time after its prefill"
    if mask is None and past and T > 1:
        mask = torch.ones(T, past + T, dtype=torch.bool, device=device).tril(diagonal=past)  # (T, past + T)
    return mask, mask is None and past == 0


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) attention mask of packed documents whose positions restart at each document start: token i
    sees token j when j <= i and j is in i's document (j >= i - positions[i])."""
    T = positions.size(1)
    i = torch.arange(T, device=positions.device)
    start = (i - positions).unsqueeze(-1)  # (B, T, 1): where each token's document starts
    return ((i[None, :] <= i[:, None]) & (i[None, None, :] >= start)).unsqueeze(1)

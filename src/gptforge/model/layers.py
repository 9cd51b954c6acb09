"""The model's parts that are not GPT-2's blocks themselves: the KV cache, dropout with cheap masks, attention
with dropout, parameter-free RMSNorm and rotary position embeddings; and `evaluating`, eval mode for a while.
Torch only."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.nn import functional as F


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


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """A bool mask of `shape`, False with probability p (to 1/65536): 16 random bits per element, four from each
    64-bit draw of torch's generator (seeded and checkpointed like the rest of torch's random state).

    torch's own dropout draws one float per element through bernoulli_, 17-25% of a CPU training step with
    dropout 0.2 (docs/PERFORMANCE.md); this makes a quarter of the draws and one comparison, and the
    mask is applied by torch.where (docs/PERFORMANCE.md).
    """
    if torch.compiler.is_compiling():  # inductor fuses its own draws into the kernel; random_ would break the graph
        return torch.rand(shape, device=device) >= p
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), 2**63 - 1)
    return words.view(torch.int16)[:n].view(shape) >= round(p * 65536) - 32768


class Dropout(nn.Dropout):
    """nn.Dropout, or with `fast_dropout` the same rule (zeros with probability p, the rest scaled by 1 / (1 - p)) on
    keep_mask's cheaper draws. Autograd keeps only the one-byte mask for the backward pass. The mask is applied by
    torch.where: multiplying by a bool mask converts it to the tensor's dtype first (4x the time in bf16)."""

    fast_dropout = False  # GPT.use_fast_dropout sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.fast_dropout and self.training and 0.0 < self.p < 1.0):
            return super().forward(x)
        return torch.where(keep_mask(x.shape, self.p, x.device), x, 0.0).mul_(1.0 / (1.0 - self.p))


def attention_fast_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """Causal softmax attention whose probabilities go through keep_mask's dropout: what SDPA's math path does
    with dropout_p, without its bernoulli draws (SDPA's fused CPU kernel has no dropout). The scores (B, nh, T, T)
    are the big tensor here, so every scaling goes to the smaller ones: 1 / sqrt(hs) to the queries, 1 / (1 - p)
    to the (B, nh, T, hs) output; under autocast the scores stay in its dtype through the softmax (computed with
    float accumulation, as SDPA's own kernels do) and the dropout, and SoftmaxDropout passes over them once
    forward and twice backward."""
    T, S = q.size(-2), k.size(-2)
    scores = (q * (1.0 / math.sqrt(q.size(-1)))) @ k.transpose(-2, -1)
    future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu_(S - T + 1)
    with torch.autocast(q.device.type, enabled=False):
        att = SoftmaxDropout.apply(scores, future, keep_mask(scores.shape, p, scores.device))
        return (att @ v.to(att.dtype)).mul_(1.0 / (1.0 - p))


class SoftmaxDropout(torch.autograd.Function):
    """softmax(scores with the `future` positions at -inf) with the positions `keep` says False zeroed. Backward
    keeps the probabilities and the one-byte mask: the masked positions' gradient is the softmax's own zero (their
    probability is 0), so no masked_fill is needed there, and the dropout's gradient is one torch.where."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, future: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        ctx.save_for_backward(probs, keep)
        return torch.where(keep, probs, 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        probs, keep = ctx.saved_tensors
        return torch._softmax_backward_data(torch.where(keep, grad, 0.0), probs, -1, probs.dtype), None, None


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dimension (eps 1e-6, as Hugging Face's NanoChat)."""
    return F.rms_norm(x, (x.size(-1),), eps=1e-6)


class RMSNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x)


def rotary_angles(positions: torch.Tensor, head_size: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles pos * base^(-2i / head_size), in float32: (T, head_size / 2) for
    positions (T,), (B, 1, T, head_size / 2) for positions (B, T) (one row each, broadcast over the heads)."""
    inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float32, device=positions.device) / head_size)
    angles = positions.float()[..., None] * inv_freq  # (..., T, head_size / 2)
    if angles.dim() == 3:
        angles = angles.unsqueeze(1)  # (B, 1, T, head_size / 2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + hs/2]) of x (B, nh, T, hs) by its position's angle, nanochat's way round:
    (a, b) -> (a cos + b sin, b cos - a sin). q.k then depends on the positions' difference only."""
    a, b = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((a * cos + b * sin, b * cos - a * sin), dim=-1)

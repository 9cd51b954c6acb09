"""Attention as plain tensor functions: `attention_heads` (the one projection into heads, rotated and normalised as
the model asks, laid out for the attention that follows) and `attend` (SDPA, or gptforge's own softmax attention),
with `own_attention` choosing between them. gptforge's own is for CPU training, where SDPA falls short: with dropout
(SDPA's fused CPU kernel has none, and its math path draws torch's bernoulli masks) and, in bf16, at dropout 0 too
(the fused kernel's bf16 backward is twice this path's time). Causal, or any bool mask; queries in blocks where the
mask allows. Torch, and cpu_kernels.c for the causal blocks' softmax with dropout.
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch.nn import functional as F

from gptforge.core.cpu import cpu_has_amx
from gptforge.kernels.masks import apply_mask, keep_mask, mask_seed
from gptforge.kernels.native import native_kernels
from gptforge.kernels.reference import keep_threshold
from gptforge.kernels.rotary import Rope, rotate_and_norm

QUERY_BLOCKS = 2  # attention goes in this many query blocks when T >= MIN_BLOCKED_T and the mask allows
MIN_BLOCKED_T = 128
OWN_ATTENTION_MAX_T = 512  # at dropout 0, bf16 on a CPU takes `attention` up to this many tokens


def own_attention(qkv: torch.Tensor, p: float, fast_dropout: bool, cached: bool) -> bool:
    """Whether `attend` takes gptforge's own attention for this layer rather than SDPA: in training with fast dropout
    masks (SDPA's would be bernoulli draws), or at dropout 0 where own_attention_pays; never with a KV cache."""
    return not cached and (fast_dropout and 0.0 < p < 1.0 or p == 0.0 and own_attention_pays(qkv))


def attention_heads(
    qkv: torch.Tensor, n_head: int, rope: Rope | None, qk_norm: bool, own: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, nh, T, hs) from the projection qkv (B, T, 3 C), q and k rotated (rope) and normalised (qk_norm).
    For own attention without either, three contiguous copies in one step (split_heads); otherwise views. Under
    torch.compile q and k are rotated and normalised before the heads move to dimension 1 (rope broadcast over
    (B, T, nh, hs / 2): heads_second): the gradients of q, k and v then come back in qkv's own (B, T, 3 C) order,
    and attention's inputs and output are strided views of it (no copy that transposes them, either way)."""
    B, T, C3 = qkv.size()
    compiling = torch.compiler.is_compiling()
    if own and rope is None and not qk_norm and not compiling:
        return split_heads(qkv, n_head)
    q, k, v = (t.view(B, T, n_head, C3 // (3 * n_head)) for t in qkv.split(C3 // 3, dim=2))  # (B, T, nh, hs)
    if compiling:
        q, k = rotate_and_norm(q, k, None if rope is None else (heads_second(rope[0]), heads_second(rope[1])), qk_norm)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
    if not compiling:
        q, k = rotate_and_norm(q, k, rope, qk_norm)
    return q, k, v


def heads_second(angles: torch.Tensor) -> torch.Tensor:
    """Rotary cos or sin, (T, hs / 2) or (B, 1, T, hs / 2), made to broadcast over (B, T, nh, hs / 2)."""
    return angles.unsqueeze(-2) if angles.dim() == 2 else angles.transpose(1, 2)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, mask: torch.Tensor | None, causal: bool, own: bool
) -> torch.Tensor:
    """Attention of q over k, v (B, nh, T, hs) -> (B, nh, T, hs): gptforge's own (`attention`: cheap dropout masks,
    bf16 CPU training) where `own`, else SDPA, which picks a fused (flash / memory-efficient) kernel where one
    exists. mask: bool, True where a query may attend (the whole rule); else causal when `causal`."""
    if own:
        return attention(q, k, v, p, mask)
    masked = {"attn_mask": mask} if mask is not None else {}
    # a Python bool, also when the compiler traces T as a symbol (a branch guards on it; SDPA refuses a SymBool)
    is_causal = True if causal and q.size(-2) > 1 else False  # noqa: SIM210
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal, **masked)


def own_attention_pays(q: torch.Tensor) -> bool:
    """Whether attention without dropout goes through `attention` instead of SDPA's fused kernel: on a CPU in bf16,
    T <= OWN_ATTENTION_MAX_T, not compiled; in training, and in evaluation too except on a CPU with AMX (no KV cache:
    the caller decides). There the fused kernel is slow in bf16, about twice this path's time forward and backward,
    with or without packed documents' mask (docs/lab/2026-11-25-epyc-bf16.md). On an AMX Xeon the fused
    kernel's forward is the faster and its training step the slower (docs/lab/2026-11-27-amx.md): q without
    gradients (evaluation, no_grad) takes it there. The scores are materialised, (B, nh, T, T), so longer sequences
    keep SDPA; in float32 it ties or wins.
    q: the queries (B, nh, T, hs) or the projection (B, T, 3 C) they come from: T is the second-to-last dimension."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and q.size(-2) <= OWN_ATTENTION_MAX_T
        and not torch.compiler.is_compiling()
        and (q.requires_grad or not cpu_has_amx())
    )


def saved_score_bytes(
    T: int, n_head: int, dropout: float, fast_dropout: bool, device_type: str, bf16: bool, compiled: bool
) -> int:
    """Bytes that `attention` keeps for backward per sequence and layer in training (no mask): the probabilities
    (B, nh, T, T), over the causal blocks only; with dropout also the dropped probabilities and the one-byte mask.
    0 where training takes SDPA instead (GPT's CausalSelfAttention decides, own_attention_pays at dropout 0) and
    under torch.compile (inductor decides what to keep): the memory estimate adds this, and stays a lower bound."""
    own = fast_dropout and 0.0 < dropout < 1.0 or dropout == 0.0 and device_type == "cpu" and bf16
    if compiled or not own or dropout == 0.0 and T > OWN_ATTENTION_MAX_T:
        return 0
    if T >= MIN_BLOCKED_T and T % QUERY_BLOCKS == 0:
        size = T // QUERY_BLOCKS
        scores = size * size * QUERY_BLOCKS * (QUERY_BLOCKS + 1) // 2  # block b scores its size rows x b * size
    else:
        scores = T * T
    width = 2 if bf16 else 4
    return n_head * scores * (2 * width + 1 if dropout > 0.0 else width)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float = 0.0, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention of q over k, v (B, nh, T, hs), causal or by `mask` (bool, broadcastable to (B, nh, T, S),
    True where a query may attend: the whole rule, as SDPA's attn_mask; every query must see a key), its
    probabilities through keep_mask's dropout when p > 0: what SDPA's math path does with dropout_p, without its
    bernoulli draws. The scores (B, nh, T, S) are the big tensor here, so every scaling goes to the smaller ones:
    1 / sqrt(hs) to the queries, 1 / (1 - p) to the (B, nh, T, hs) output; under autocast the scores stay in its
    dtype through the softmax (computed with float accumulation, as SDPA's own kernels do; the probabilities are
    rounded to it before the product with v, as flash attention's are) and the dropout, and SoftmaxDropout passes
    over them once forward and twice backward, masks as additions and multiplications (no where / masked_fill).

    Over T keys each (T >= MIN_BLOCKED_T, T divisible), the queries go in QUERY_BLOCKS blocks, each scored
    against the keys up to its own end only, where one block computes every score and masks the future half
    away: 3/4 of the scores' products, softmax and draws with 2 blocks (4 blocks do 5/8 of the work but took
    longer on a 2-core CPU: smaller products, more slices; docs/lab/2026-11-25-epyc-bf16.md). With a mask, only when it
    lets no query of a block see a key after the block (packed documents' masks are causal: they never do).
    Causal blocks outside torch.compile are one autograd step (CausalBlocks)."""
    T, S = q.size(-2), k.size(-2)
    scale = 1.0 / math.sqrt(q.size(-1))
    if mask is not None:
        mask = mask.expand(*mask.shape[:-2], T, S)  # a query or key dimension of 1 stands for all of them
    size = T // QUERY_BLOCKS
    if T != S or T < MIN_BLOCKED_T or T % QUERY_BLOCKS or not _blocks_fit(mask, size):
        return _attend(q * scale, k, v, p, mask)
    if mask is None and not torch.compiler.is_compiling():
        with torch.autocast(q.device.type, enabled=False):
            return CausalBlocks.apply(q, k.to(q.dtype), v.to(q.dtype), p, scale)
    q = q * scale
    outputs = [
        _attend(q[:, :, i : i + size], k[:, :, : i + size], v[:, :, : i + size], p, _rows(mask, i, i + size))
        for i in range(0, T, size)
    ]
    return torch.cat(outputs, dim=-2)


def split_heads(qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, nh, T, hs), each contiguous, from the attention's one projection qkv (B, T, 3 C): what
    split + view + transpose give, in one copy forward and one pass back (SplitHeads), where `attention` would
    copy the transposed views anyway and autograd's backward of the split copies each gradient and then
    concatenates them."""
    return SplitHeads.apply(qkv, n_head)


class SplitHeads(torch.autograd.Function):
    """(B, T, 3 C) -> three contiguous (B, nh, T, hs); backward writes the three gradients into (B, T, 3 C)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
        B, T, C3 = qkv.shape
        heads = qkv.view(B, T, 3, n_head, C3 // (3 * n_head)).unbind(2)  # (B, T, nh, hs) views
        q, k, v = (h.transpose(1, 2).contiguous() for h in heads)  # three copies: faster than one of all three
        return q, k, v

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        B, nh, T, hs = dq.shape
        dqkv = torch.empty(B, T, 3, nh, hs, dtype=dq.dtype, device=dq.device)
        for i, d in enumerate((dq, dk, dv)):
            if d is None:
                dqkv[:, :, i].zero_()
            else:
                dqkv[:, :, i].copy_(d.transpose(1, 2))
        return dqkv.view(B, T, 3 * nh * hs), None


def _blocks_fit(mask: torch.Tensor | None, size: int) -> bool:
    """No query of a block of `size` may see a key after its block's end (always so without a mask: causal)."""
    if mask is None:
        return True
    return not any(bool(mask[..., i : i + size, i + size :].any()) for i in range(0, mask.size(-2) - size, size))


def _rows(mask: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """The mask's queries start:end over the keys up to `end` (None: causal)."""
    return None if mask is None else mask[..., start:end, :end]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, mask: torch.Tensor | None) -> torch.Tensor:
    """attention of t queries (already scaled) over s keys: by the bool mask, or causally as the last t of s
    (query i sees keys <= i + s - t). The rule becomes an addition of 0 / -inf to the scores."""
    t, s = q.size(-2), k.size(-2)
    scores = q @ k.transpose(-2, -1)
    if mask is None:
        rule = torch.full((t, s), float("-inf"), dtype=scores.dtype, device=q.device).triu_(s - t + 1)  # 0 below
    else:
        rule = torch.zeros(mask.shape, dtype=scores.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    with torch.autocast(q.device.type, enabled=False):
        if p == 0.0:
            att = torch.softmax(scores + rule, dim=-1)
            return att @ v.to(att.dtype)
        att = SoftmaxDropout.apply(scores, rule, keep_mask(scores, p))
        return (att @ v.to(att.dtype)).mul_(1.0 / (1.0 - p))


class SoftmaxDropout(torch.autograd.Function):
    """softmax(scores + rule) (rule: 0, or -inf where a query may not look) with the positions `keep` says False
    zeroed. Backward keeps the probabilities and the one-byte mask: the masked positions' gradient is the softmax's
    own zero (their probability is 0), and the dropout's gradient is one multiplication by the mask."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, rule: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        probs = torch.softmax(scores + rule, dim=-1)
        ctx.save_for_backward(probs, keep)
        return apply_mask(probs, keep)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        probs, keep = ctx.saved_tensors
        dropped = apply_mask(grad, keep)
        return torch._softmax_backward_data(dropped, probs, -1, probs.dtype), None, None


class CausalBlocks(torch.autograd.Function):
    """Causal attention of q over k, v (B, nh, T, hs), one dtype, in QUERY_BLOCKS query blocks, as one autograd
    step: what `_attend` per block and a concatenation compute, without autograd's bookkeeping around the blocks.
    That bookkeeping (each block's slice of k and v gets a zero-filled full-size gradient that is then added up, the
    concatenation's backward, the causal rule added to all of a block's scores) cost what the blocks saved. Here the
    rule goes onto each block's diagonal square only, in place; backward runs the blocks from the widest, writing
    dk, dv and each block's rows of dq directly and adding the narrower blocks' shares of dk and dv into their rows
    (baddbmm). The scalings ride on the products (their alpha, applied to the float accumulators before rounding):
    `scale` (1 / sqrt(hs)) on the scores and on dq, dk, 1 / (1 - p) on the output and on the gradient's products,
    instead of passes of their own over q, the output and the gradient. Saved: each block's probabilities, its mask
    and, with dropout, the dropped probabilities, as before, and the contiguous copies of its queries and of the
    keys and values up to its end that its products take (a product copies a strided operand each time it gets one:
    six copies a layer fewer, the same bits). With dropout on a CPU the block's softmax, mask and
    dropped probabilities are cpu_kernels.c's one pass over each row, and its gradient one pass back
    (_causal_softmax), where torch's operations take three passes forward (softmax, draw, the mask's application)
    and two back."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, scale: float) -> torch.Tensor:  # noqa: ANN001
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # once: every block's products take slices of them
        B, nh, T, hs = q.shape
        size = T // QUERY_BLOCKS
        q3, k3, v3 = (x.view(B * nh, T, hs) for x in (q, k, v))
        out = torch.empty(B, nh, T, hs, dtype=q.dtype, device=q.device)
        out3 = out.view(B * nh, T, hs)
        saved, kernels = [], _softmax_kernels(q, p)
        if kernels is None:  # the torch operations' causal rule (the kernel has its own)
            rule = torch.full((size, size), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)  # 0 on and below
        # the products copy a strided operand (a block's rows of q, the first keys of k and v) to a contiguous one
        # each time: copied once here and kept, backward's products take the same copies
        queries = [q3[:, start : start + size].contiguous() for start in range(0, T, size)]
        keys = [k3[:, :end].contiguous() if end < T else k3 for end in range(size, T + 1, size)]
        values = [v3[:, :end].contiguous() if end < T else v3 for end in range(size, T + 1, size)]
        for block, start in enumerate(range(0, T, size)):
            end = start + size
            scores = torch.empty(B, nh, size, end, dtype=q.dtype, device=q.device)
            scores.view(B * nh, size, end).baddbmm_(queries[block], keys[block].mT, beta=0.0, alpha=scale)
            if kernels is not None:
                probs, att, keep = _causal_softmax(kernels[0], scores, size, p)
            else:
                scores[..., start:end] += rule
                probs = torch.softmax(scores, dim=-1)
                keep = keep_mask(probs, p) if p > 0.0 else None
                att = apply_mask(probs, keep) if keep is not None else probs
            out3[:, start:end].baddbmm_(att.view(B * nh, size, end), values[block], beta=0.0, alpha=_undrop(p))
            saved += [probs, att, keep, queries[block], keys[block], values[block]]
        ctx.p, ctx.scale, ctx.kernels, ctx.shape = p, scale, kernels, q.shape
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:  # noqa: ANN001
        saved = ctx.saved_tensors
        p, scale, (B, nh, T, hs) = ctx.p, ctx.scale, ctx.shape
        size = T // QUERY_BLOCKS
        flat = lambda x: x.reshape(B * nh, *x.shape[2:])  # noqa: E731 - (B, nh, ...) as a batch of matrices
        dtype, device = saved[0].dtype, saved[0].device
        g3 = flat(grad.to(dtype))
        dq3 = torch.empty(B * nh, T, hs, dtype=dtype, device=device)
        dk3, dv3 = torch.empty_like(dq3), torch.empty_like(dq3)
        for block in reversed(range(QUERY_BLOCKS)):  # the widest first: it writes all of dk and dv
            start, end = block * size, block * size + size
            probs, att, keep, queries, keys, values = saved[6 * block : 6 * block + 6]
            probs3, att3 = flat(probs), flat(att)
            rows = g3[:, start:end].contiguous()  # once for both products (each would copy the strided rows)
            beta = 0.0 if end == T else 1.0  # beta 0 ignores what the output held
            dv3[:, :end].baddbmm_(att3.mT, rows, beta=beta, alpha=_undrop(p))
            dprobs = torch.empty(B * nh, size, end, dtype=dtype, device=device)
            dprobs.baddbmm_(rows, values.mT, beta=0.0, alpha=_undrop(p))
            if ctx.kernels is not None:  # in place: dprobs becomes dscores
                ctx.kernels[1](dprobs.data_ptr(), keep.data_ptr(), probs3.data_ptr(), dprobs.data_ptr(), 0,
                               B * nh * size, size, end)  # fmt: skip
                dscores = dprobs
            else:
                if keep is not None:
                    apply_mask(dprobs, flat(keep), out=dprobs)
                dscores = torch._softmax_backward_data(dprobs, probs3, -1, probs3.dtype)
            dq3[:, start:end].baddbmm_(dscores, keys, beta=0.0, alpha=scale)
            dk3[:, :end].baddbmm_(dscores.mT, queries, beta=beta, alpha=scale)
        shape = (B, nh, T, hs)
        return dq3.view(shape), dk3.view(shape), dv3.view(shape), None, None


def _undrop(p: float) -> float:
    """Dropout's scaling of what is kept: 1 / (1 - p), 1 without dropout."""
    return 1.0 / (1.0 - p) if p > 0.0 else 1.0


def _softmax_kernels(q: torch.Tensor, p: float):  # noqa: ANN202 - cpu_kernels.c's (forward, backward) or None
    """cpu_kernels.c's causal softmax with dropout for q's dtype (float32, bf16) on a CPU, where it compiled. Without
    dropout torch's softmax, already one pass forward and one backward, stays: the kernel's exponential and threads
    gained nothing there (docs/lab/2026-11-27-amx.md)."""
    native = native_kernels() if q.device.type == "cpu" and p > 0.0 else None
    return None if native is None else native.softmax.get(q.dtype)


def _causal_softmax(forward, scores: torch.Tensor, rows: int, p: float):  # noqa: ANN001, ANN202
    """A query block's (probabilities, dropped probabilities, mask) by cpu_kernels.c in one pass over each row, its rows
    split across torch's threads by the kernel: scores (B, nh, rows, cols), contiguous, the last `rows` queries of
    `cols` positions, become the probabilities (the causal rule is the kernel's: no -inf is added); the mask is
    keep_mask's, from a seed drawn as keep_mask draws it: the same masks as the torch operations' path."""
    n, cols = scores.numel() // scores.size(-1), scores.size(-1)
    keep, att = torch.empty(scores.shape, dtype=torch.bool), torch.empty_like(scores)
    failed = ctypes.c_int32(0)  # ctypes lets go of Python's lock meanwhile
    forward(scores.data_ptr(), scores.data_ptr(), att.data_ptr(), keep.data_ptr(), 0, n, rows, cols, mask_seed(),
            keep_threshold(p), ctypes.byref(failed))  # fmt: skip
    if failed.value:
        raise MemoryError(f"attention's softmax: no memory for a row buffer of {cols} floats")
    return scores, att, keep

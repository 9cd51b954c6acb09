"""The training loss of the LM head's logits in one autograd step: soft-cap, log-softmax, the targets' losses and
their gradient, row chunk by row chunk. Torch only.

On a CPU the plain expression passes over the (tokens, vocabulary) logits about ten times (division, tanh and
multiplication of the soft-cap, the float32 copy, log-softmax, the loss, and as many backward), each a trip
through main memory: a quarter of a 4,096-token chat model's step. Here the logits are made by one product as
before, and then each chunk of rows, small enough to stay in the core's cache, goes from logits to loss and to
the logits' gradient at once, in float32, written back over the logits (docs/lab/2026-11-25-epyc-bf16.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_ELEMENTS = 1 << 18  # float32 logits per chunk of rows: 1 MiB, inside a core's L2 cache
MIN_VOCAB = 1024  # below, the plain expression is as fast (docs/lab/2026-11-25-epyc-bf16.md)


def loss_without_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    cap: float,
    reduction: str,
) -> torch.Tensor | None:
    """Training's loss straight from the hidden states x (..., C), the logits never handed back: head_loss's chunks on
    a CPU where head_loss_pays, compiled_loss's two kernels under torch.compile (head: the LM head's product, its
    uncapped logits); None elsewhere, where the caller's logits and cross-entropy are nanoGPT's arithmetic."""
    if head_loss_pays(x, weight.size(0), cap):
        return head_loss(x, weight, targets, cap, reduction)
    if torch.compiler.is_compiling():  # the loss's passes in as few kernels as inductor fuses
        return compiled_loss(head(x), targets, cap, reduction)
    return None


def head_loss_pays(x: torch.Tensor, vocab: int, cap: float) -> bool:
    """Whether training (gradients on, not compiled) takes head_loss: see head_loss_used."""
    used = head_loss_used(x.device.type, vocab, torch.is_autocast_enabled(x.device.type), cap)
    return used and torch.is_grad_enabled() and not torch.compiler.is_compiling()


def head_loss_used(device_type: str, vocab: int, autocast: bool, cap: float) -> bool:
    """On a CPU (about half the time of the head's plain forward + backward at a 4,096-token vocabulary in bf16:
    docs/lab/2026-11-25-epyc-bf16.md), with a vocabulary of MIN_VOCAB or more, under autocast or with a soft-cap.
    float32 without one is nanoGPT's arithmetic: torch's expression stays, rounding for rounding."""
    return device_type == "cpu" and vocab >= MIN_VOCAB and (autocast or cap > 0)


def head_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cap: float, reduction: str) -> torch.Tensor:
    """cross_entropy(cap * tanh((x @ weight.T) / cap), targets) (no soft-cap when cap is 0), targets of -1 not
    scored (nor computed); reduction 'mean' over the scored targets (nan when there are none, as F.cross_entropy)
    or 'sum'. x (..., C), weight (V, C), targets (...). Under autocast the product runs in its dtype, the rest in
    float32."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        return HeadLoss.apply(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1), cap, reduction, dtype)


class HeadLoss(torch.autograd.Function):
    """head_loss. Only the scored rows go through the head (SFT trains ~30% of its tokens: the rest would be
    products and softmaxes thrown away). Forward computes the loss and, when gradients are wanted, d loss / d logits
    in the logits' own buffer (dtype); backward is two products with it, scaled by the incoming gradient."""

    @staticmethod
    def forward(ctx, x, weight, targets, cap, reduction, dtype):  # noqa: ANN001, ANN205
        scored = (targets != -1).nonzero().squeeze(1)  # the rows whose target is scored
        x_, w_ = x[scored].to(dtype), weight.to(dtype)
        logits = x_ @ w_.t()  # (scored, V): becomes the gradient in place
        targets = targets[scored]
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        rows = max(1, CHUNK_ELEMENTS // logits.size(1))
        for start in range(0, logits.size(0), rows):
            total += _chunk_loss(logits[start : start + rows], targets[start : start + rows], cap)
        count = len(scored)
        ctx.save_for_backward(logits, x_, w_, scored)
        ctx.scale = 1.0 / max(count, 1) if reduction == "mean" else 1.0
        ctx.rows, ctx.dtypes = x.size(0), (x.dtype, weight.dtype)
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        dlogits, x_, w_, scored = ctx.saved_tensors
        factor = float(grad) * ctx.scale  # a Python float: bf16 products are scaled in float32, rounded once
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.zeros(ctx.rows, x_.size(1), dtype=ctx.dtypes[0], device=x_.device)
            dx.index_copy_(0, scored, (dlogits @ w_).mul_(factor).to(ctx.dtypes[0]))
        if ctx.needs_input_grad[1]:
            dw = (dlogits.t() @ x_).mul_(factor).to(ctx.dtypes[1])
        return dx, dw, None, None, None, None


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> torch.Tensor:
    """The summed loss of these rows' targets; their logits are overwritten with d loss / d logits (the softmax
    minus the target's one, times the soft-cap's derivative 1 - tanh^2)."""
    z = logits.float()
    if cap > 0:
        t = z.mul_(1.0 / cap).tanh_()  # z's storage: tanh(l / cap)
        z = t * cap
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    picked = targets.unsqueeze(1)
    loss = (lse - z.gather(1, picked)).sum()
    probs = z.sub_(lse).exp_()
    probs.scatter_add_(1, picked, torch.full_like(picked, -1.0, dtype=probs.dtype))
    if cap > 0:
        probs.mul_(t.mul_(t).neg_().add_(1.0))
    logits.copy_(probs)
    return loss


def compiled_loss(logits: torch.Tensor, targets: torch.Tensor, cap: float, reduction: str) -> torch.Tensor:
    """The training loss under torch.compile: cross_entropy(cap * tanh(logits / cap), targets) (no soft-cap when
    cap is 0) in float32 from the head's raw logits (..., V) in their own dtype; targets of -1 not scored,
    reduction 'mean' (nan when none is scored, as F.cross_entropy) or 'sum'. See CompiledLoss."""
    return CompiledLoss.apply(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), cap, reduction)


# With a soft-cap of at most this, |z| <= cap and V e^cap stays inside float32 for any vocabulary under 10^12 (e^60 x
# 50,304 < 1e31; float32 ends at 3.4e38, e^-60 is a normal number), so CompiledLoss sums exp(z) with no row maximum
# taken first: one pass over the logits instead of logsumexp's two (the 124M speedrun's step 1.9% shorter on an
# H200: docs/lab/2026-11-28-h200-h100.md)
ONE_PASS_CAP = 60.0


class CompiledLoss(torch.autograd.Function):
    """compiled_loss as one autograd step that inductor fuses into two kernels over the (tokens, V) logits: one
    reading them for each row's log-sum-exp and target, and in backward one reading them again and writing their
    gradient (the softmax minus the target's one, times the soft-cap's 1 - tanh^2), the target's one compared in
    the same kernel. The model's plain expression under compile also writes the capped logits (it returns them),
    takes a zero-filled (tokens, V) gradient for them in backward, and peaks 19 GB higher at GPT-2's vocabulary and
    64 x 1024 tokens a micro-batch (docs/lab/2026-11-26-h100.md)."""

    @staticmethod
    def forward(ctx, logits, targets, cap, reduction):  # noqa: ANN001, ANN205
        z = logits.float()
        if cap > 0:
            z = torch.tanh(z / cap) * cap
        if 0 < cap <= ONE_PASS_CAP:  # |z| <= cap: the sum of exp(z) stays in float32 with no max taken first
            lse = torch.log(torch.exp(z).sum(dim=-1))
        else:
            lse = torch.logsumexp(z, dim=-1)  # (N,)
        scored = targets != -1
        index = torch.where(scored, targets, 0)
        losses = torch.where(scored, lse - z.gather(1, index.unsqueeze(1)).squeeze(1), 0.0)
        count = scored.sum()
        ctx.save_for_backward(logits, lse, index, scored, count)
        ctx.cap, ctx.mean = cap, reduction == "mean"
        return losses.sum() / count if ctx.mean else losses.sum()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        logits, lse, index, scored, count = ctx.saved_tensors
        z = logits.float()
        if ctx.cap > 0:
            t = torch.tanh(z / ctx.cap)
            z = t * ctx.cap
        probs = torch.exp(z - lse.unsqueeze(1))
        one = torch.arange(logits.size(1), device=logits.device) == index.unsqueeze(1)
        d = torch.where(one, probs - 1.0, probs)
        if ctx.cap > 0:
            d = d * (1.0 - t * t)
        row = torch.where(scored, grad / count if ctx.mean else grad, 0.0)  # (N,)
        return (d * row.unsqueeze(1)).to(logits.dtype), None, None, None

"""Dropout as plain tensor functions, each choosing its path: `dropout` (torch's, or with fast masks keep_mask's
cheaper draws applied by MaskedScale) and `residual_add`, a residual connection x + dropout(y) (one pass each way
by cpu_kernels.c in CPU training with fast masks, ResidualDropout; a float32 x plus a bf16 y in one pass without
dropout, ResidualAdd; with the LayerNorm that follows the sum in the same pass where both have kernels, AddNorm).
The same masks and the same bits on every path. Torch, and cpu_kernels.c where it builds."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptforge.kernels import masks
from gptforge.kernels.masks import apply_mask, keep_mask
from gptforge.kernels.native import cpu_kernels, native_kernels
from gptforge.kernels.norms import NORMED, layer_norm_to_bf16
from gptforge.kernels.reference import keep_threshold, layer_norm_chunks

Norm = tuple[nn.Parameter, nn.Parameter | None, float]  # a LayerNorm's weight, bias and eps


def dropout(x: torch.Tensor, p: float, training: bool, fast: bool) -> torch.Tensor:
    """F.dropout(x, p, training); with `fast` the same rule (zeros with probability p, the rest scaled by 1 / (1 - p))
    on keep_mask's cheaper draws, applied by MaskedScale (autograd keeps only the one-byte mask)."""
    if not (fast and training and 0.0 < p < 1.0):
        return F.dropout(x, p, training)
    keep = keep_mask(x, p)
    if torch.compiler.is_compiling():  # inductor fuses the select itself
        return torch.where(keep, x, 0.0).mul_(1.0 / (1.0 - p))
    return MaskedScale.apply(x, keep, 1.0 / (1.0 - p))


def residual_add(
    x: torch.Tensor, y: torch.Tensor, p: float, training: bool, fast: bool, then: Norm | None = None
) -> torch.Tensor:
    """x + dropout(y): a residual connection with dropout on its branch. With fast masks in training on a CPU (x
    float32, y float32 or bf16, the compiled kernel), one pass forward and one back by cpu_kernels.c
    (ResidualDropout): the same mask and the same bits as the sum of dropout's output, in half the passes over
    memory. Without dropout (p 0 or evaluation), a float32 x and a bf16 y (autocast's branch output) on a CPU: their
    sum in one pass (ResidualAdd), its bits. `then`: the LayerNorm that the sum goes through next (its weight, bias,
    eps); where ResidualDropout runs on a bf16 y and that norm is written into bf16 by cpu_kernels.c, the sum and the
    norm in one pass each way (AddNorm: the same bits, the sum's gradient from the next residual and the norm's
    added there instead of by autograd), the normalised sum left for norms.layer_norm to take."""
    if _residual_kernel(x, y, p, training, fast):
        if then is not None and y.dtype == torch.bfloat16 and layer_norm_to_bf16(x, then[0], then[1]):
            s, h = AddNorm.apply(x, y, p, *then)
            s.__dict__[NORMED] = (then[0], h)
            return s
        return ResidualDropout.apply(x, y, p)
    if (not training or p == 0.0) and _add_kernel(x, y) is not None:
        return ResidualAdd.apply(x, y)  # no dropout: the sum, in one pass
    return x + dropout(y, p, training, fast)


def _residual_kernel(x: torch.Tensor, y: torch.Tensor, p: float, training: bool, fast: bool) -> bool:
    """ResidualDropout's conditions: fast dropout in training, a float32 x and a float32 or bf16 y of its shape on a
    CPU, outside torch.compile, with the compiled kernels."""
    return (
        fast
        and training
        and 0.0 < p < 1.0
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and y.dtype in (torch.float32, torch.bfloat16)
        and x.shape == y.shape
        and not torch.compiler.is_compiling()
        and native_kernels() is not None
    )


class MaskedScale(torch.autograd.Function):
    """x times `scale` where keep is True, 0 elsewhere (dropout on a drawn mask); backward keeps the one-byte mask
    only. x times the mask, then the scale (1 / (1 - p) in float arithmetic, rounded once, as before): apply_mask."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return apply_mask(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        (keep,) = ctx.saved_tensors
        return apply_mask(grad, keep, ctx.scale), None, None


class ResidualDropout(torch.autograd.Function):
    """x + dropout(y) by cpu_kernels.c (Dropout.add_to): keep_mask's mask from a seed drawn as it draws it, y's
    masked values rounded to y's dtype as MaskedScale rounds them, added in float32; backward: x's gradient is the
    sum's, y's the sum's rounded to y's dtype (autograd's conversion), then masked and scaled. Keeps the mask."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, p: float) -> torch.Tensor:  # noqa: ANN001
        forward, _ = native_kernels().residual[y.dtype]
        x, y = x.contiguous(), y.contiguous()
        keep, out = torch.empty(x.shape, dtype=torch.bool), torch.empty_like(x)
        forward(x.data_ptr(), y.data_ptr(), keep.data_ptr(), out.data_ptr(), x.numel(), masks.mask_seed(),
                keep_threshold(p), 1.0 / (1.0 - p))  # fmt: skip
        ctx.save_for_backward(keep)
        ctx.p, ctx.y_dtype = p, y.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        (keep,) = ctx.saved_tensors
        _, backward = native_kernels().residual[ctx.y_dtype]
        grad = grad.contiguous()
        dy = torch.empty(grad.shape, dtype=ctx.y_dtype)
        backward(grad.data_ptr(), keep.data_ptr(), dy.data_ptr(), grad.numel(), 1.0 / (1.0 - ctx.p))
        return grad, dy, None


def _add_kernel(x: torch.Tensor, y: torch.Tensor):  # noqa: ANN202 - a ctypes function or None
    """cpu_kernels.c's float32 + bf16 sum for plain CPU tensors of one shape, outside torch.compile."""
    if not (x.dtype == torch.float32 and y.dtype == torch.bfloat16 and x.shape == y.shape):
        return None
    native = cpu_kernels(x, y)
    return None if native is None else native.add_bf16


class ResidualAdd(torch.autograd.Function):
    """x + y, x float32 and y bf16, by cpu_kernels.c (Dropout.add_to without dropout): y's values read as they are,
    where torch's sum converts them into a float32 copy first; backward: x's gradient is the sum's, y's the sum's
    rounded to bf16 (autograd's conversion). torch's bits both ways."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        x, y = x.contiguous(), y.contiguous()
        out = torch.empty_like(x)
        native_kernels().add_bf16(x.data_ptr(), y.data_ptr(), out.data_ptr(), x.numel())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        return grad, grad.to(torch.bfloat16)


class AddNorm(torch.autograd.Function):
    """s = x + dropout(y) and h = LayerNorm(s) in bf16 by cpu_kernels.c in one pass over the rows (Dropout.add_to
    with norm_after): ResidualDropout's mask and bits, then LayerNormToBf16's. Backward: s's whole gradient (its
    own, from the next residual, plus the norm's: the sum autograd would take) is x's, and masked y's; the norm's
    weight and bias gradients as LayerNormToBf16's. Keeps s, the mask and the rows' statistics."""

    @staticmethod
    def forward(ctx, x, y, p, weight, bias, eps):  # noqa: ANN001, ANN205
        forward, _ = native_kernels().add_norm
        x, y = x.contiguous(), y.contiguous()
        n = x.size(-1)
        rows = x.numel() // n
        keep, s, h = torch.empty(x.shape, dtype=torch.bool), torch.empty_like(x), torch.empty_like(y)
        mean, rstd = torch.empty(rows), torch.empty(rows)
        forward(x.data_ptr(), y.data_ptr(), keep.data_ptr(), s.data_ptr(), weight.data_ptr(),
                None if bias is None else bias.data_ptr(), h.data_ptr(), mean.data_ptr(), rstd.data_ptr(), rows, n,
                masks.mask_seed(), keep_threshold(p), 1.0 / (1.0 - p), eps)  # fmt: skip
        ctx.save_for_backward(s, weight, mean, rstd, keep)
        ctx.p, ctx.has_bias = p, bias is not None
        ctx.set_materialize_grads(False)  # s may have no use of its own (before ln_f): no gradient, not zeros
        return s, h

    @staticmethod
    def backward(ctx, grad_s, grad_h):  # noqa: ANN001, ANN205
        s, weight, mean, rstd, keep = ctx.saved_tensors
        n, rows = s.size(-1), mean.numel()
        _, backward = native_kernels().add_norm
        grad_h = torch.zeros_like(s, dtype=torch.bfloat16) if grad_h is None else grad_h.contiguous()
        grad_s = None if grad_s is None else grad_s.contiguous()
        dx, dy, dw, db = torch.empty_like(s), torch.empty_like(grad_h), torch.empty(n), torch.empty(n)
        partial = torch.empty(layer_norm_chunks(rows), 2, n)  # the kernel's scratch
        backward(grad_h.data_ptr(), None if grad_s is None else grad_s.data_ptr(), s.data_ptr(), weight.data_ptr(),
                 mean.data_ptr(), rstd.data_ptr(), keep.data_ptr(), dx.data_ptr(), dy.data_ptr(), dw.data_ptr(),
                 db.data_ptr(), partial.data_ptr(), rows, n, 1.0 / (1.0 - ctx.p))  # fmt: skip
        return dx, dy, None, dw, db if ctx.has_bias else None, None

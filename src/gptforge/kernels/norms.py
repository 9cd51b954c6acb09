"""Norms as plain tensor functions, each choosing its path: `rms_norm` (parameter-free RMSNorm: one pass each way by
cpu_kernels.c on a CPU, the plain expression under torch.compile, torch operations elsewhere) and `layer_norm`
(torch's, or on a CPU under bf16 autocast written straight into bf16 by cpu_kernels.c; a LayerNorm that
dropout.residual_add computed together with the sum before it is taken from there). Torch, and cpu_kernels.c where
it builds."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptforge.core.cpu import cpu_bf16_autocast
from gptforge.kernels.native import native_kernels
from gptforge.kernels.reference import layer_norm_chunks

# where dropout.residual_add leaves the LayerNorm of its sum that cpu_kernels.c computed in the same pass (AddNorm):
# (the norm's weight, the normalised tensor), read once by layer_norm
NORMED = "_gptforge_normed"


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """F.layer_norm over the last dimension. Where the sum that made x was normalised by this weight in the same pass
    (dropout.residual_add's `then`), that result; on a CPU under bf16 autocast, with the compiled kernel, written
    straight in bf16 (LayerNormToBf16), where torch computes it in float32 and the next layer rounds it to bf16 (two
    passes and a conversion each way): torch's values to one bf16 rounding (the mean and variance summed in another
    order); otherwise torch's."""
    done = None if torch.compiler.is_compiling() else x.__dict__.pop(NORMED, None)
    if done is not None and done[0] is weight:
        return done[1]
    if layer_norm_to_bf16(x, weight, bias):
        return LayerNormToBf16.apply(x, weight, bias, eps)
    return F.layer_norm(x, (x.size(-1),), weight, bias, eps)


def layer_norm_to_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether x is normalised by cpu_kernels.c into bf16 (LayerNormToBf16, or AddNorm with the sum before it)."""
    return (
        cpu_bf16_autocast(x)
        and x.dtype == torch.float32
        and type(weight) is nn.Parameter  # not an FSDP shard (a DTensor)
        and weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and weight.shape == (x.size(-1),)
        and x.numel() > 0
        and not torch.compiler.is_compiling()
        and native_kernels() is not None
    )


RMS_EPS = 1e-6  # Hugging Face's NanoChat


def rms_norm(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dimension, x / sqrt(mean(x^2) + 1e-6), written in `dtype` (default x's).

    On CPUs F.rms_norm is a chain of float32 operations with as many again backward, and a bf16 x goes to float32
    and back around it; RootMeanSquare reads each row once forward and once backward with the compiled kernel
    (native.native_kernels: contiguous float32 / bf16 CPU tensors), else passes over x twice forward and three times
    backward in torch operations (docs/lab/2026-11-26-amx.md). Under torch.compile the plain expression, which inductor
    fuses itself."""
    if torch.compiler.is_compiling():
        return F.rms_norm(x, (x.size(-1),), eps=RMS_EPS).to(dtype or x.dtype)
    return RootMeanSquare.apply(x, dtype or x.dtype)


class RootMeanSquare(torch.autograd.Function):
    """rms_norm as one autograd step. The mean of squares is taken in float32 or wider (1 / rms per row, r, kept for
    backward with x) and y = x r is rounded once into the output's dtype; backward is
    dx = r g - x r^3 mean(g x) (the gradient of x r(x)), in x's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # noqa: ANN001
        size = x.size(-1)
        kernel = _rms_kernel(x, dtype)
        if kernel is not None:  # one pass over x (native.native_kernels)
            y, r = torch.empty(x.shape, dtype=dtype), torch.empty(*x.shape[:-1], 1)
            kernel(x.data_ptr(), y.data_ptr(), r.data_ptr(), 0, r.numel(), size, RMS_EPS)
            ctx.save_for_backward(x, r)
            return y
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))
        r = norm.square_().mul_(1.0 / size).add_(RMS_EPS).rsqrt_()  # (..., 1)
        ctx.save_for_backward(x, r)
        return torch.mul(x, r, out=torch.empty(x.shape, dtype=dtype, device=x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        x, r = ctx.saved_tensors
        kernel = _rms_back_kernel(grad, x)
        if kernel is not None:
            grad, dx = grad.contiguous(), torch.empty(x.shape, dtype=x.dtype)
            kernel(grad.data_ptr(), x.data_ptr(), r.data_ptr(), dx.data_ptr(), 0, r.numel(), x.size(-1))
            return dx, None
        dot = (grad * x).sum(-1, keepdim=True, dtype=r.dtype)  # (..., 1)
        coef = r.pow(3).mul_(dot).mul_(-1.0 / x.size(-1))
        if x.dtype.itemsize < 4:  # a bf16 / fp16 gradient: the rows' factors in its dtype (no float32 copies of x)
            r, coef = r.to(x.dtype), coef.to(x.dtype)
        dx = torch.mul(grad, r, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))
        return dx.addcmul_(x, coef), None


def _rms_kernel(x: torch.Tensor, dtype: torch.dtype):  # noqa: ANN202 - a ctypes function or None
    """The compiled RMSNorm forward for a contiguous CPU x of this (x, y) dtype pair, where there is one."""
    if x.device.type != "cpu" or not x.is_contiguous() or x.numel() == 0:
        return None
    native = native_kernels()
    return None if native is None else native.rms.get((x.dtype, dtype))


def _rms_back_kernel(grad: torch.Tensor, x: torch.Tensor):  # noqa: ANN202
    """The compiled RMSNorm backward for this (gradient, x) dtype pair (x contiguous: saved by the kernel's forward)."""
    if x.device.type != "cpu" or not x.is_contiguous() or x.numel() == 0 or grad.shape != x.shape:
        return None
    native = native_kernels()
    return None if native is None else native.rms_back.get((grad.dtype, x.dtype))


class LayerNormToBf16(torch.autograd.Function):
    """LayerNorm of a float32 x (..., n) written in bf16 by cpu_kernels.c in one pass over each row, the rows' mean and
    1 / std kept for backward, which reads each row of the bf16 gradient once more: x's gradient in float32, the
    weight's and the bias's summed over chunks of rows, then the chunks' sums in order (the same bits on any number
    of threads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):  # noqa: ANN001, ANN205
        forward, _ = native_kernels().layer_norm
        x = x.contiguous()
        n = x.size(-1)
        rows = x.numel() // n
        y, mean, rstd = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(rows), torch.empty(rows)
        forward(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                mean.data_ptr(), rstd.data_ptr(), rows, n, eps)  # fmt: skip
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        x, weight, mean, rstd = ctx.saved_tensors
        n = x.size(-1)
        _, backward = native_kernels().layer_norm
        grad = grad.contiguous()  # bf16: autograd gives an output's gradient in the output's dtype
        dx, dw, db = torch.empty(x.shape), torch.empty(n), torch.empty(n)
        partial = torch.empty(layer_norm_chunks(mean.numel()), 2, n)  # the kernel's scratch
        backward(grad.data_ptr(), x.data_ptr(), weight.data_ptr(), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                 dw.data_ptr(), db.data_ptr(), partial.data_ptr(), mean.numel(), n)  # fmt: skip
        return dx, dw, db if ctx.has_bias else None, None

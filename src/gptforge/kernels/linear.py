"""`linear`, F.linear whose float32 CPU products can run through oneDNN instead of torch's BLAS (MKL), and whose bf16
weight gradient on an AMX CPU can come from a transposed copy. Torch only (and cpu_kernels.c's transpose).

torch multiplies float32 matrices on a CPU with MKL, and MKL takes its AVX2 code on AMD processors even where they
have AVX-512: on a Zen 5 EPYC about half the rate of oneDNN's AVX-512 kernels, which torch ships
too and which pick their code by the CPU's features alone (docs/lab/2026-11-26-zen5.md). With `onednn` set (the
model's Linear modules carry it) and a float32 product on a CPU outside autocast and torch.compile, `linear` computes
the product and both gradients with oneDNN's matmul (`core.cpu.onednn_nt`). They are the same sums in another order:
the results agree with torch's to float32 rounding, not bit for bit. A model is built with it off (torch's
arithmetic, which Hugging Face's GPT-2 and nanoGPT compute); training turns it on where it pays (the `onednn_f32`
setting, core/device.resolve_onednn_f32).

Under bf16 CPU autocast on a CPU with AMX, a layer whose output is at most half its input (the MLP's projection
back) trains through NarrowGradLinear: the same forward, and the weight's gradient, a product that reduces over
the tokens, from a contiguous transposed copy of the output's gradient instead of oneDNN's transposed operand.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptforge.core.cpu import cpu_bf16_autocast, cpu_has_amx, onednn_nt
from gptforge.kernels.native import native_kernels

MIN_MACS = 1 << 20  # products smaller than this (a decode step's rows) keep torch's: oneDNN's call costs more
MIN_WEIGHT_GRAD = 1 << 16  # in * out below this (128 x 128, the 65-character head): MKL's weight gradient is faster
MIN_TRANSPOSED_ROWS = 4096  # NarrowGradLinear from this many tokens (measured at 6,144 and 16,384)


class OneDnnLinear(torch.autograd.Function):
    """y = x @ weight.T + bias in float32, forward and backward by oneDNN's matmul (torch's for a small weight
    gradient). x (..., in), weight (out, in)."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: ANN001, ANN205
        x2 = x.reshape(-1, x.size(-1)).contiguous()  # (a no-op for the layers' inputs; no zero strides for oneDNN)
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return onednn_nt(x2, weight, bias).view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x2, weight = ctx.saved_tensors
        out, inp = weight.shape
        g = grad.reshape(-1, out).contiguous()  # (a sum's gradient arrives expanded)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = onednn_nt(g, weight.t()).view(*grad.shape[:-1], inp)
        if ctx.needs_input_grad[1]:
            if out * inp < MIN_WEIGHT_GRAD:
                dw = g.t() @ x2
            elif out >= inp:  # oneDNN is fastest writing the wider side along its rows: (x^T g)^T
                dw = onednn_nt(x2.t(), g.t()).t().contiguous()
            else:
                dw = onednn_nt(g.t(), x2.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)
        return dx, dw, db


class NarrowGradLinear(torch.autograd.Function):
    """y = x @ weight.T + bias under bf16 CPU autocast: forward F.linear's own product on the values autocast
    rounds to bf16 (the same bits), backward x's gradient as torch's (the same product) and the weight's as
    transpose(g) @ x with the output's gradient g (tokens, out) copied transposed by cpu_kernels.c first: on an AMX
    Xeon oneDNN's product takes the transposed view g^T at about half the rate of a contiguous copy, copy included
    (docs/lab/2026-11-27-amx.md). The same sums in another order: the
    weight's gradient is torch's to bf16 rounding, not bit for bit (the bias's likewise: summed over the tokens)."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: ANN001, ANN205
        xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        ctx.save_for_backward(xb, wb)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return F.linear(xb, wb, None if bias is None else bias.to(torch.bfloat16))

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        xb, wb = ctx.saved_tensors
        out, inp = wb.shape
        g = grad.to(torch.bfloat16).reshape(-1, out).contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(g, wb).view(*grad.shape[:-1], inp).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            transposed = torch.empty(out, g.size(0), dtype=torch.bfloat16)
            native_kernels().transpose(g.data_ptr(), transposed.data_ptr(), g.size(0), out)
            dw = torch.mm(transposed, xb.reshape(-1, inp)).to(ctx.dtypes[1])
        if ctx.dtypes[2] is not None and ctx.needs_input_grad[2]:
            db = g.sum(0).to(ctx.dtypes[2])
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """F.linear(x, weight, bias). With `onednn` (training's onednn_f32), a float32 CPU product outside autocast and
    torch.compile by oneDNN (OneDnnLinear); under bf16 CPU autocast on an AMX CPU, in training, with out <= in / 2,
    the weight's gradient from a transposed copy (NarrowGradLinear)."""
    if _narrow_gradient(x, weight):
        return NarrowGradLinear.apply(x, weight, bias)
    if (
        onednn
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.numel() // max(x.size(-1), 1) * weight.numel() >= MIN_MACS
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and type(weight) is nn.Parameter  # not an FSDP shard (a DTensor)
    ):
        return OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def _narrow_gradient(x: torch.Tensor, w: torch.Tensor) -> bool:
    """NarrowGradLinear's conditions: a CPU training step under bf16 autocast, AMX (where the transposed operand was
    measured slow), cpu_kernels.c's AVX-512 transpose, a float32 weight at least twice as wide in as out and a
    multiple of 32 out, enough tokens."""
    if not (
        cpu_bf16_autocast(x)
        and torch.is_grad_enabled()
        and w.requires_grad
        and 2 * w.size(0) <= w.size(1)
        and w.size(0) % 32 == 0  # whole tiles of the transpose (not a 65-character head)
        and x.dim() >= 2
        and x.numel() // max(x.size(-1), 1) >= MIN_TRANSPOSED_ROWS
        and w.dtype == torch.float32
        and type(w) is nn.Parameter  # not an FSDP shard (a DTensor)
        and not torch.compiler.is_compiling()
        and cpu_has_amx()
    ):
        return False
    native = native_kernels()
    return native is not None and native.fast_rows

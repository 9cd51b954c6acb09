"""Linear layers whose float32 CPU products can run through oneDNN instead of torch's BLAS (MKL). Torch only.

torch multiplies float32 matrices on a CPU with MKL, and MKL takes its AVX2 code on AMD processors even where they
have AVX-512: on a Zen 5 EPYC ~215 GFLOP/s on 2 cores, against ~450 for oneDNN's AVX-512 kernels, which torch ships
too and which pick their code by the CPU's features alone (docs/PERFORMANCE.md). `Linear` is nn.Linear (the same
parameters, names, initialisation and state_dict) whose forward, when `onednn` is set on it and the product is
float32 on a CPU outside autocast and torch.compile, computes the product and both gradients with oneDNN's
matmul (`core.device.onednn_nt`). They are the same sums in another order: the results agree with
torch's to float32 rounding, not bit for bit. A model is built with it off (torch's arithmetic, which Hugging
Face's GPT-2 and nanoGPT compute); training turns it on where it pays (the `onednn_f32` setting,
core/device.resolve_onednn_f32).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptforge.core.device import onednn_nt

MIN_MACS = 1 << 20  # products smaller than this (a decode step's rows) keep torch's: oneDNN's call costs more
MIN_WEIGHT_GRAD = 1 << 16  # in * out below this (128 x 128, the 65-character head): MKL's weight gradient is faster


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


class Linear(nn.Linear):
    """nn.Linear; with `onednn` set (GPT.use_onednn_f32), its float32 CPU products by oneDNN (OneDnnLinear)."""

    onednn = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            self.onednn
            and x.dtype == torch.float32
            and w.dtype == torch.float32
            and x.device.type == "cpu"
            and x.numel() // max(x.size(-1), 1) * w.numel() >= MIN_MACS
            and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()
            and type(w) is nn.Parameter  # not an FSDP shard (a DTensor)
        ):
            return OneDnnLinear.apply(x, w, self.bias)
        return F.linear(x, w, self.bias)

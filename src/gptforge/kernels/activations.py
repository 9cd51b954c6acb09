"""The MLP's squared-ReLU activation (relu2: nanochat's and modded-nanogpt's), one autograd step whose CPU passes
are cpu_kernels.c's (kernels/native.py)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gptforge.kernels.native import cpu_kernels


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (nanochat's and modded-nanogpt's MLP activation), as one autograd step (SquaredReLU)."""
    return SquaredReLU.apply(x)


class SquaredReLU(torch.autograd.Function):
    """relu(x)^2 in x's dtype. On a CPU, for a float32 or bf16 x, cpu_kernels.c's one pass each way (x kept, relu(x)
    recomputed backward); elsewhere `r * r` with r = relu(x) kept, and `(g * r).mul_(2)` backward: not square()
    (autocast would compute pow in float32 and copy the widest activation of the block twice). The same bits both
    ways (torch's relu leaves -0 and NaN as they are; g r rounded before the doubling)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        kernels = _relu2_kernels(x)
        ctx.kernels = kernels
        if kernels is not None:  # one pass (torch's: relu, then the product)
            x = x.contiguous()
            h = torch.empty_like(x)
            kernels[0](x.data_ptr(), h.data_ptr(), x.numel())
            ctx.save_for_backward(x)
            return h
        r = F.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (saved,) = ctx.saved_tensors  # x with the kernels, relu(x) without
        if ctx.kernels is not None:
            grad, dx = grad.to(saved.dtype).contiguous(), torch.empty_like(saved)
            ctx.kernels[1](grad.data_ptr(), saved.data_ptr(), dx.data_ptr(), saved.numel())
            return dx
        return (grad * saved).mul_(2.0)


def _relu2_kernels(x: torch.Tensor):  # noqa: ANN202 - (forward, backward) or None
    """cpu_kernels.c's relu(x)^2 for a plain CPU tensor of a dtype it has (float32, bf16), outside torch.compile."""
    native = cpu_kernels(x) if x.numel() else None
    return None if native is None else native.relu2.get(x.dtype)

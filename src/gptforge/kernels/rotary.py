"""Rotary position embeddings as plain tensor functions: `rotary_angles` (cos and sin of each position's angles),
`apply_rotary` (one autograd step, or the plain expression under torch.compile) and `rotary_rms_norm` (qk-norm after
rotary: one pass each way by cpu_kernels.c on a CPU). Torch, and cpu_kernels.c where it builds."""

from __future__ import annotations

import torch

from gptforge.kernels.native import native_kernels
from gptforge.kernels.norms import RMS_EPS, rms_norm

Rope = tuple[torch.Tensor, torch.Tensor]  # rotary cos and sin (T, head_size / 2), or (B, 1, T, head_size / 2)


def rotate_and_norm(q: torch.Tensor, k: torch.Tensor, rope: Rope | None, qk_norm: bool) -> tuple[torch.Tensor, ...]:
    """q and k rotated by rope (when given) and normalised (qk-norm, when asked); rope broadcasts over them."""
    if rope is not None and qk_norm:  # one step: on a CPU one pass each way (rotary_rms_norm)
        return rotary_rms_norm(q, *rope), rotary_rms_norm(k, *rope)
    if rope is not None:
        return apply_rotary(q, *rope), apply_rotary(k, *rope)
    if qk_norm:
        return rms_norm(q), rms_norm(k)
    return q, k


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
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if torch.compiler.is_compiling():  # inductor fuses the expression itself
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos + b * sin, b * cos - a * sin), dim=-1)
    return Rotary.apply(x, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary's rotation written into one new tensor: four passes (a product, then a fused multiply-add, for
    each half) instead of eight and a concatenation."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    a, b = x.chunk(2, dim=-1)
    first, second = out.chunk(2, dim=-1)
    torch.mul(a, cos, out=first).addcmul_(b, sin)
    torch.mul(b, cos, out=second).addcmul_(a, sin, value=-1.0)
    return out


class Rotary(torch.autograd.Function):
    """apply_rotary as one autograd step: a rotation is linear, so backward needs only cos and sin (not x) and
    is the rotation by the opposite angles."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, -sin), None, None


def rotary_rms_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rms_norm(apply_rotary(x, cos, sin)): qk-norm after rotary. On a CPU with the compiled kernel (float32 or bf16
    x (B, nh, T, hs) with its last dimension contiguous, as attention's head-split views are; cos / sin (T, hs / 2))
    one pass over each row each way (RotaryNorm), where the two steps take six passes forward and six backward and
    round twice; elsewhere those two steps. A rotation keeps a row's root mean square, so the norm is x's."""
    if not torch.compiler.is_compiling() and _rope_rms_kernels(x, cos) is not None:
        return RotaryNorm.apply(x, cos, sin)
    return rms_norm(apply_rotary(x, cos, sin))


def _rope_rms_kernels(x: torch.Tensor, cos: torch.Tensor):  # noqa: ANN202 - (forward, backward) or None
    if x.device.type != "cpu" or x.dim() != 4 or x.stride(-1) != 1 or x.numel() == 0 or x.size(-1) > 1024:
        return None
    if x.size(-1) % 2 or cos.shape != (x.size(2), x.size(-1) // 2):  # one row of angles per position
        return None
    native = native_kernels()
    return None if native is None else native.rope_rms.get(x.dtype)


class RotaryNorm(torch.autograd.Function):
    """rotary_rms_norm by cpu_kernels.c: y = turn(x) r, r = 1 / sqrt(mean(x^2) + 1e-6) per row, in float32 with float32
    angles, rounded once into x's dtype; backward turns the gradient back and takes RMSNorm's gradient (x and r
    kept; the gradient is written in x's layout)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        forward, _ = _rope_rms_kernels(x, cos)
        B, H, T, hs = x.shape
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        y, r = torch.empty(B, H, T, hs, dtype=x.dtype), torch.empty(B * H * T)
        sb, sh, st, _ = x.stride()
        forward(
            x.data_ptr(), y.data_ptr(), r.data_ptr(), cos.data_ptr(), sin.data_ptr(), B, H, T, hs, sb, sh, st, RMS_EPS
        )
        ctx.save_for_backward(x, r, cos, sin)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        x, r, cos, sin = ctx.saved_tensors
        _, backward = _rope_rms_kernels(x, cos)
        B, H, T, hs = x.shape
        grad = grad.to(x.dtype).contiguous()
        dx = torch.empty(B, T, H, hs, dtype=x.dtype).transpose(1, 2)  # heads side by side, as c_attn's gradient
        backward(
            grad.data_ptr(), x.data_ptr(), r.data_ptr(), cos.data_ptr(), sin.data_ptr(), dx.data_ptr(),
            B, H, T, hs, *x.stride()[:3], *dx.stride()[:3],
        )  # fmt: skip
        return dx, None, None

"""The model's parts that are not GPT-2's blocks themselves: the KV cache, dropout with cheap masks,
parameter-free RMSNorm and rotary position embeddings; and `evaluating`, eval mode for a while. Torch only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptforge.core.cpu import cpu_bf16_autocast
from gptforge.model import masks
from gptforge.model.mask_reference import keep_threshold, layer_norm_chunks
from gptforge.model.masks import apply_mask, keep_mask
from gptforge.model.native import cpu_kernels, native_kernels


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


class Dropout(nn.Dropout):
    """nn.Dropout, or with `fast_dropout` the same rule (zeros with probability p, the rest scaled by 1 / (1 - p)) on
    keep_mask's cheaper draws, applied by MaskedScale (autograd keeps only the one-byte mask)."""

    fast_dropout = False  # GPT.use_fast_dropout sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.fast_dropout and self.training and 0.0 < self.p < 1.0):
            return super().forward(x)
        keep = keep_mask(x, self.p)
        if torch.compiler.is_compiling():  # inductor fuses the select itself
            return torch.where(keep, x, 0.0).mul_(1.0 / (1.0 - self.p))
        return MaskedScale.apply(x, keep, 1.0 / (1.0 - self.p))

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + self(y): a residual connection with dropout on its branch. With fast_dropout in training on a CPU
        (x float32, y float32 or bf16, the compiled kernel), one pass forward and one back by keep_mask.c
        (ResidualDropout): the same mask and the same bits as the sum of this module's output, in half the passes
        over memory. Without dropout (p 0 or evaluation), a float32 x and a bf16 y (autocast's branch output) on a
        CPU: their sum in one pass (ResidualAdd), its bits. Otherwise that sum."""
        if self._residual_kernel(x, y):
            return ResidualDropout.apply(x, y, self.p)
        if (not self.training or self.p == 0.0) and _add_kernel(x, y) is not None:
            return ResidualAdd.apply(x, y)  # no dropout: the sum, in one pass
        return x + self(y)

    def add_norm(self, x: torch.Tensor, y: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm(s)) with s = self.add_to(x, y): a residual connection and the norm after it. Where add_to takes
        ResidualDropout (bf16 y) and the norm is a LayerNorm into bf16 (LayerNorm.to_bf16), both in one pass
        forward and one back by keep_mask.c (AddNorm): the same bits, the sum's gradient from the next residual
        and the norm's added there instead of by autograd; otherwise the two steps."""
        if (
            self._residual_kernel(x, y)
            and y.dtype == torch.bfloat16
            and isinstance(norm, LayerNorm)
            and norm.to_bf16(x)
        ):
            return AddNorm.apply(x, y, self.p, norm.weight, norm.bias, norm.eps)
        s = self.add_to(x, y)
        return s, norm(s)

    def _residual_kernel(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """ResidualDropout's conditions: fast dropout in training, a float32 x and a float32 or bf16 y of its shape on
        a CPU, outside torch.compile, with the compiled kernels."""
        return (
            self.fast_dropout
            and self.training
            and 0.0 < self.p < 1.0
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and y.dtype in (torch.float32, torch.bfloat16)
            and x.shape == y.shape
            and not torch.compiler.is_compiling()
            and native_kernels() is not None
        )


def add_dropped(dropout: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + dropout(y): Dropout.add_to for gptforge's Dropout, the plain sum for any other module (nn.Dropout)."""
    return dropout.add_to(x, y) if isinstance(dropout, Dropout) else x + dropout(y)


def add_dropped_norm(
    dropout: nn.Module, x: torch.Tensor, y: torch.Tensor, norm: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + dropout(y), norm of it): Dropout.add_norm for gptforge's Dropout, the two steps for any other module."""
    if isinstance(dropout, Dropout):
        return dropout.add_norm(x, y, norm)
    s = x + dropout(y)
    return s, norm(s)


class ResidualDropout(torch.autograd.Function):
    """x + dropout(y) by keep_mask.c (Dropout.add_to): keep_mask's mask from a seed drawn as it draws it, y's
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
    """keep_mask.c's float32 + bf16 sum for plain CPU tensors of one shape, outside torch.compile."""
    if not (x.dtype == torch.float32 and y.dtype == torch.bfloat16 and x.shape == y.shape):
        return None
    native = cpu_kernels(x, y)
    return None if native is None else native.add_bf16


class ResidualAdd(torch.autograd.Function):
    """x + y, x float32 and y bf16, by keep_mask.c (Dropout.add_to without dropout): y's values read as they are,
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


class RMSNorm(nn.Module):
    """rms_norm before a linear layer: under autocast written straight in autocast's dtype, which the layer would
    convert it to anyway (one pass fewer each way); otherwise in x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        return rms_norm(x, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (the same parameters, names and state_dict), before a linear layer: on a CPU under bf16
    autocast, with the compiled kernel, written straight in bf16 by keep_mask.c (LayerNormToBf16), where torch
    computes it in float32 and the layer then rounds it to bf16 (two passes and a conversion each way); otherwise
    torch's. The values are torch's to one bf16 rounding (the mean and variance summed in another order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.to_bf16(x):
            return LayerNormToBf16.apply(x, self.weight, self.bias, self.eps)
        return super().forward(x)

    def to_bf16(self, x: torch.Tensor) -> bool:
        """Whether x is normalised by keep_mask.c into bf16 (LayerNormToBf16, or AddNorm with the sum before it)."""
        return (
            cpu_bf16_autocast(x)
            and x.dtype == torch.float32
            and type(self.weight) is nn.Parameter  # not an FSDP shard (a DTensor)
            and self.weight.dtype == torch.float32
            and (self.bias is None or self.bias.dtype == torch.float32)
            and self.normalized_shape == (x.size(-1),)
            and x.numel() > 0
            and not torch.compiler.is_compiling()
            and native_kernels() is not None
        )


class LayerNormToBf16(torch.autograd.Function):
    """LayerNorm of a float32 x (..., n) written in bf16 by keep_mask.c in one pass over each row, the rows' mean and
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


class AddNorm(torch.autograd.Function):
    """s = x + dropout(y) and h = LayerNorm(s) in bf16 by keep_mask.c in one pass over the rows (Dropout.add_norm):
    ResidualDropout's mask and bits, then LayerNormToBf16's. Backward: s's whole gradient (its own, from the next
    residual, plus the norm's: the sum autograd would take) is x's, and masked y's; the norm's weight and bias
    gradients as LayerNormToBf16's. Keeps s, the mask and the rows' statistics."""

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
    """rotary_rms_norm by keep_mask.c: y = turn(x) r, r = 1 / sqrt(mean(x^2) + 1e-6) per row, in float32 with float32
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

"""The checks native.py runs on cpu_kernels.c's compiled kernels before any is used: each against the references in
kernels/reference.py (the masks and their application bit for bit; the residual dropout, the float32 + bf16 sum and
relu(x)^2 against torch's bits; RMSNorm alone and after rotary, the causal softmax and LayerNorm against float64; the
residual with its LayerNorm against those two kernels; the transpose against torch's copy). `failed_check` says which
one fails, or ""; `native` is a native.Native."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from gptforge.kernels.reference import (
    SPECIAL,
    causal_softmax_reference,
    keep_threshold,
    layer_norm_chunks,
    layer_norm_reference,
    reference_keep,
    rope_rms_reference,
    same_bits,
    torch_masked,
)


def failed_check(native: Any) -> str:
    """What the first failing check found, or "" when the kernels agree with every reference."""
    if not (masks_agree(native) and residual_agrees(native) and relu2_agrees(native) and add_agrees(native)):
        return "does not reproduce reference_keep and torch's masked products"
    if not (rms_agrees(native) and rope_rms_agrees(native)):
        return "its RMSNorm does not agree with float64's"
    if not softmax_agrees(native):
        return "its causal softmax does not agree with float64's and keep_mask's"
    if not layer_norm_agrees(native):
        return "its LayerNorm does not agree with float64's"
    if not add_norm_agrees(native):
        return "its residual and LayerNorm in one differ from the two kernels'"
    if not transpose_agrees(native):
        return "its transpose does not give torch's transposed copy"
    return ""


def _with_special(n: int, generator: torch.Generator) -> torch.Tensor:
    """n float32 values: SPECIAL twice (zeros, extremes, a subnormal, infinities, NaN), then normal draws."""
    return torch.cat([torch.tensor(SPECIAL * 2), torch.randn(n - 2 * len(SPECIAL), generator=generator)])


def masks_agree(native: Any) -> bool:
    """The compiled kernel gives reference_keep's mask (a few words and a ragged tail, two seeds, two thresholds),
    and apply_mask's torch products bit for bit (special values kept and dropped; three scales)."""
    for seed, threshold, n in ((0, -32768 + 13107, 4099), (2**63 - 25, 3, 1031), (7, 0, 200_003)):  # 1, 1, 2+ parts
        ours, theirs = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.bool)
        native.keep(ours.data_ptr(), n, seed, threshold)
        reference_keep(theirs, seed, threshold)
        if not torch.equal(ours, theirs):
            return False
    values = _with_special(1041, torch.Generator().manual_seed(3))
    keep = torch.arange(values.numel()) % 3 != 1  # each special value both kept and dropped
    for dtype, function in native.masked.items():
        x = values.to(dtype)
        for scale in (1.0, 1.0 / 0.8, 1.0 / 0.95):
            ours = torch.empty_like(x)
            function(x.data_ptr(), keep.data_ptr(), ours.data_ptr(), x.numel(), scale)
            if not same_bits(ours, torch_masked(x, keep, scale)):
                return False
    return True


def residual_agrees(native: Any) -> bool:
    """x + dropout(y) and its gradient for y give torch's bits: x + apply_mask(y, mask), and apply_mask of the float32
    gradient rounded to y's dtype, with reference_keep's mask (special values in y and in the gradient)."""
    n, seed, threshold, scale = 1041, 12345, keep_threshold(0.2), 1.0 / 0.8
    values = _with_special(n, torch.Generator().manual_seed(9))
    x = torch.randn(n, generator=torch.Generator().manual_seed(10))
    kept = torch.empty(n, dtype=torch.bool)
    reference_keep(kept, seed, threshold)
    for dtype, (forward, backward) in native.residual.items():
        y, keep, out = values.to(dtype), torch.empty(n, dtype=torch.bool), torch.empty(n)
        forward(x.data_ptr(), y.data_ptr(), keep.data_ptr(), out.data_ptr(), n, seed, threshold, scale)
        if not (torch.equal(keep, kept) and same_bits(out, x + torch_masked(y, kept, scale))):
            return False
        dy = torch.empty(n, dtype=dtype)
        backward(values.data_ptr(), kept.data_ptr(), dy.data_ptr(), n, scale)
        if not same_bits(dy, torch_masked(values.to(dtype), kept, scale)):
            return False
    return True


def add_agrees(native: Any) -> bool:
    """A float32 x plus a bf16 y gives torch's sum's bits (special values in both, a tail past the threads' parts)."""
    n = 70001
    gen = torch.Generator().manual_seed(14)
    x, y = _with_special(n, gen), _with_special(n, gen)
    y = y.flip(0).to(torch.bfloat16)
    out = torch.empty(n)
    native.add_bf16(x.data_ptr(), y.data_ptr(), out.data_ptr(), n)
    return same_bits(out, x + y)


def relu2_agrees(native: Any) -> bool:
    """relu(x)^2 and its gradient give torch's bits (`r * r`, `(g * r).mul_(2)`, r = relu(x)), special values in x and
    in the gradient, over a length split across threads with a tail."""
    n = 70001
    gen = torch.Generator().manual_seed(13)
    x, g = _with_special(n, gen), _with_special(n, gen)
    for dtype, (forward, backward) in native.relu2.items():
        xd, gd = x.to(dtype), g.flip(0).to(dtype)
        h, dx = torch.empty_like(xd), torch.empty_like(xd)
        forward(xd.data_ptr(), h.data_ptr(), n)
        backward(gd.data_ptr(), xd.data_ptr(), dx.data_ptr(), n)
        r = torch.relu(xd)
        if not (same_bits(h, r * r) and same_bits(dx, (gd * r).mul_(2.0))):
            return False
    return True


def rms_agrees(native: Any) -> bool:
    """RMSNorm's compiled forward (y and the rows' r) and backward agree with the same formulas in float64, for
    every dtype pair, on rows of 64 and 383 (whole and partial lanes): within float32 rounding where the output is
    float32, within one bf16 rounding where it is bf16."""
    gen, eps = torch.Generator().manual_seed(4), 1e-6
    for n in (64, 383):
        x64 = torch.randn(5, n, dtype=torch.float64, generator=gen) * 3
        g64 = torch.randn(5, n, dtype=torch.float64, generator=gen)
        for (x_type, y_type), forward in native.rms.items():
            x = x64.to(x_type)
            y, r = torch.empty(x.shape, dtype=y_type), torch.empty(5, 1)
            forward(x.data_ptr(), y.data_ptr(), r.data_ptr(), 0, 5, n, eps)
            want_r = (x.double().pow(2).mean(-1, keepdim=True) + eps).rsqrt()
            if not torch.allclose(r.double(), want_r, rtol=1e-5, atol=0):
                return False
            if not torch.allclose(y.double(), x.double() * want_r, rtol=_RMS_RTOL[y_type], atol=_RMS_RTOL[y_type]):
                return False
        for (g_type, x_type), backward in native.rms_back.items():
            x, g = x64.to(x_type), g64.to(g_type)
            r = (x.double().pow(2).mean(-1, keepdim=True) + eps).rsqrt().float()
            dx = torch.empty(x.shape, dtype=x_type)
            backward(g.data_ptr(), x.data_ptr(), r.data_ptr(), dx.data_ptr(), 0, 5, n)
            rd, xd, gd = r.double(), x.double(), g.double()
            want = gd * rd - xd * rd.pow(3) * (gd * xd).mean(-1, keepdim=True)
            if not torch.allclose(dx.double(), want, rtol=_RMS_RTOL[x_type], atol=_RMS_RTOL[x_type]):
                return False
    return True


_RMS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def rope_rms_agrees(native: Any) -> bool:
    """The compiled rotary + RMSNorm, forward and backward, on a strided x (a head-split view, as attention passes
    it), within float32 rounding (float32) or one bf16 rounding (bf16) of float64's value and gradient."""
    gen = torch.Generator().manual_seed(5)
    B, H, T, hs = 2, 3, 5, 32
    base = torch.randn(B, T, 3 * H * hs, dtype=torch.float64, generator=gen) * 2
    angles = torch.randn(T, hs // 2, dtype=torch.float64, generator=gen)
    cos, sin = angles.cos().float(), angles.sin().float()
    g64 = torch.randn(B, H, T, hs, dtype=torch.float64, generator=gen)
    for dtype, (forward, backward) in native.rope_rms.items():
        x = base.to(dtype)[..., : H * hs].view(B, T, H, hs).transpose(1, 2)  # strides of q in attention
        x64, gd = x.double(), g64.to(dtype).double()
        want = rope_rms_reference(x64, cos, sin)
        # the gradient by its formula (this may run where autograd does not: inside a Function, inference mode)
        p, q = gd.chunk(2, dim=-1)
        c64, s64 = cos.double(), sin.double()
        u = torch.cat((p * c64 - q * s64, q * c64 + p * s64), dim=-1)  # g turned back
        r64 = (x64.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
        want_dx = u * r64 - x64 * r64.pow(3) * (u * x64).mean(-1, keepdim=True)
        y, r = torch.empty(B, H, T, hs, dtype=dtype), torch.empty(B * H * T)
        sb, sh, st, _ = x.stride()
        forward(x.data_ptr(), y.data_ptr(), r.data_ptr(), cos.data_ptr(), sin.data_ptr(), B, H, T, hs, sb, sh, st, 1e-6)
        dx = torch.empty(B, T, H, hs, dtype=dtype).transpose(1, 2)
        g = g64.to(dtype)
        backward(
            g.data_ptr(), x.data_ptr(), r.data_ptr(), cos.data_ptr(), sin.data_ptr(), dx.data_ptr(),
            B, H, T, hs, sb, sh, st, *dx.stride()[:3],
        )  # fmt: skip
        tol = _RMS_RTOL[dtype]
        if not torch.allclose(y.double(), want, rtol=tol, atol=tol):
            return False
        if not torch.allclose(dx.double(), want_dx, rtol=tol, atol=tol * want_dx.abs().max().item()):
            return False
    return True


def softmax_agrees(native: Any) -> bool:
    """The compiled causal softmax with dropout, forward and backward, on two blocks of 3 queries over 8, 7 and 64
    keys (a mask's words whole, split across rows, and the width of the AVX-512 rows): the probabilities and the
    gradient within float32 rounding (float32) or one bf16 rounding (bf16) of float64's, the mask reference_keep's
    bit for bit, att the kept probabilities exactly."""
    gen, rows, n, seed, threshold = torch.Generator().manual_seed(6), 3, 6, 2**63 - 99, 13107 - 32768
    for cols in (8, 7, 64):
        s64 = torch.randn(n, cols, dtype=torch.float64, generator=gen) * 4
        d64 = torch.randn(n, cols, dtype=torch.float64, generator=gen)
        for dtype, (forward, backward) in native.softmax.items():
            s, d, tol = s64.to(dtype), d64.to(dtype), _RMS_RTOL[dtype]
            probs, att, keep = torch.empty_like(s), torch.empty_like(s), torch.empty(n, cols, dtype=torch.bool)
            failed = ctypes.c_int32(0)
            forward(s.data_ptr(), probs.data_ptr(), att.data_ptr(), keep.data_ptr(), 0, n, rows, cols, seed, threshold,
                    ctypes.byref(failed))  # fmt: skip
            kept = torch.empty(n, cols, dtype=torch.bool)
            reference_keep(kept.view(-1), seed, threshold)
            if failed.value or not (torch.equal(keep, kept) and torch.equal(att, probs * keep)):
                return False
            if not torch.allclose(probs.double(), causal_softmax_reference(s, rows), rtol=tol, atol=tol):
                return False
            ds = torch.empty_like(s)
            backward(d.data_ptr(), keep.data_ptr(), probs.data_ptr(), ds.data_ptr(), 0, n, rows, cols)
            p, dd = probs.double(), d.double() * kept
            if not torch.allclose(ds.double(), p * (dd - (p * dd).sum(-1, keepdim=True)), rtol=tol, atol=tol):
                return False
    return True


def layer_norm_agrees(native: Any) -> bool:
    """The compiled LayerNorm (float32 in, bf16 out) and its backward (a bf16 gradient) on rows of 64 and 383 (whole
    and partial lanes), with and without a bias: y within one bf16 rounding of float64's, x's, the weight's and the
    bias's gradients within float32 rounding of float64's from the same bf16 gradient."""
    gen, eps = torch.Generator().manual_seed(8), 1e-5
    forward, backward = native.layer_norm
    for n, bias in ((64, True), (383, False)):
        x = (torch.randn(5, n, dtype=torch.float64, generator=gen) * 3 + 1).float()
        w = torch.randn(n, dtype=torch.float64, generator=gen).float()
        b = torch.randn(n, dtype=torch.float64, generator=gen).float() if bias else None
        g = torch.randn(5, n, dtype=torch.float64, generator=gen).to(torch.bfloat16)
        y, mean, rstd = torch.empty(5, n, dtype=torch.bfloat16), torch.empty(5), torch.empty(5)
        forward(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), mean.data_ptr(),
                rstd.data_ptr(), 5, n, eps)  # fmt: skip
        want = layer_norm_reference(x, w, b, eps)
        if not torch.allclose(y.double(), want, rtol=2**-7, atol=2**-7):
            return False
        dx, dw, db, partial = torch.empty(5, n), torch.empty(n), torch.empty(n), torch.empty(layer_norm_chunks(5), 2, n)
        backward(g.data_ptr(), x.data_ptr(), w.data_ptr(), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                 dw.data_ptr(), db.data_ptr(), partial.data_ptr(), 5, n)  # fmt: skip
        # the gradients by their formulas (this may run where autograd does not: no_grad, inference mode)
        x64, g64 = x.double(), g.double()
        rstd64 = (x64.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
        xhat, gw = (x64 - x64.mean(-1, keepdim=True)) * rstd64, g64 * w.double()
        want_dx = rstd64 * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
        got = (dx, dw, db) if b is not None else (dx, dw)
        for mine, theirs in zip(got, (want_dx, (g64 * xhat).sum(0), g64.sum(0)), strict=False):
            if not torch.allclose(mine.double(), theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item()):
                return False
    return True


def add_norm_agrees(native: Any) -> bool:
    """The residual dropout and LayerNorm in one pass give the bits of the residual kernel then the LayerNorm
    kernel (both checked above), forward and backward (with and without the sum's own gradient, with and without a
    bias), on rows split across threads, some starting inside a mask word (70 wide)."""
    gen = torch.Generator().manual_seed(15)
    seed, threshold, scale, eps = 4321, keep_threshold(0.2), 1.0 / 0.8, 1e-5
    forward, backward = native.add_norm
    residual, residual_back = native.residual[torch.bfloat16]
    norm, norm_back = native.layer_norm
    for (rows, n), bias in zip(((640, 64), (513, 70)), (True, False), strict=True):  # both on 2 threads
        x, gs, w = (
            torch.randn(rows, n, generator=gen),
            torch.randn(rows, n, generator=gen),
            torch.randn(n, generator=gen),
        )
        b = torch.randn(n, generator=gen) if bias else None
        y, gh = (torch.randn(rows, n, generator=gen).to(torch.bfloat16) for _ in range(2))
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        masks = [torch.empty(rows, n, dtype=torch.bool) for _ in range(2)]
        outs = [[torch.empty(rows, n), torch.empty(rows, n, dtype=torch.bfloat16), torch.empty(rows), torch.empty(rows)]
                for _ in range(2)]  # fmt: skip
        (keep, keep2), (s, h, mean, rstd) = masks, outs[0]
        forward(ptr(x), ptr(y), ptr(keep), ptr(s), ptr(w), ptr(b), ptr(h), ptr(mean), ptr(rstd), rows, n, seed,
                threshold, scale, eps)  # fmt: skip
        s2, h2, mean2, rstd2 = outs[1]
        residual(ptr(x), ptr(y), ptr(keep2), ptr(s2), x.numel(), seed, threshold, scale)
        norm(ptr(s2), ptr(w), ptr(b), ptr(h2), ptr(mean2), ptr(rstd2), rows, n, eps)
        if not (torch.equal(keep, keep2) and all(same_bits(a, c) for a, c in zip(*outs, strict=True))):
            return False
        partial = torch.empty(layer_norm_chunks(rows), 2, n)
        for own in (gs, None):
            grads = [[torch.empty(rows, n), torch.empty(rows, n, dtype=torch.bfloat16), torch.empty(n), torch.empty(n)]
                     for _ in range(2)]  # fmt: skip
            dx, dy, dw, db = grads[0]
            backward(ptr(gh), ptr(own), ptr(s), ptr(w), ptr(mean), ptr(rstd), ptr(keep), ptr(dx), ptr(dy), ptr(dw),
                     ptr(db), ptr(partial), rows, n, scale)  # fmt: skip
            dx2, dy2, dw2, db2 = grads[1]
            norm_back(
                ptr(gh), ptr(s), ptr(w), ptr(mean), ptr(rstd), ptr(dx2), ptr(dw2), ptr(db2), ptr(partial), rows, n
            )
            if own is not None:
                dx2 += own
            residual_back(ptr(dx2), ptr(keep), ptr(dy2), dx2.numel(), scale)
            if not all(same_bits(a, c) for a, c in zip(grads[0], grads[1], strict=True)):
                return False
    return True


def transpose_agrees(native: Any) -> bool:
    """The compiled transpose gives torch's transposed copy, on whole 32 x 32 tiles, partial ones and a part's last
    rows (split across threads)."""
    gen = torch.Generator().manual_seed(11)
    for rows, cols in ((64, 96), (33, 64), (100, 45), (1030, 70)):
        x = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
        out = torch.empty(cols, rows, dtype=torch.bfloat16)
        native.transpose(x.data_ptr(), out.data_ptr(), rows, cols)
        if not torch.equal(out, x.t().contiguous()):
            return False
    return True

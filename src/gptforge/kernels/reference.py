"""The dropout masks' arithmetic and the compiled kernels' references, in torch operations only: a mask's threshold
and its SplitMix64 words (`reference_keep`: cpu_kernels.c's masks, which draws them where nothing is compiled), a
mask as 1.0 / 0.0 (`as_ones`) and its application by torch's products (`torch_masked`), the bit comparison that
tells torch's NaNs apart (`same_bits`), and float64 references of the compiled RMSNorm after rotary, causal softmax
and LayerNorm, with the LayerNorm backward's chunks of rows (`layer_norm_chunks`). kernels/checks.py checks the
compiled kernels against them at load; tests use them too."""

from __future__ import annotations

import torch

GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's constants
REFERENCE_WORDS = 1 << 20  # the torch reference works through this many words at a time (8 MiB per temporary)


def keep_threshold(p: float) -> int:
    """An element is kept when its signed 16-bit value is >= this: False with probability p (to 1/65536)."""
    return round(p * 65536) - 32768


def splitmix_words(seed: int, first: int, count: int) -> torch.Tensor:
    """Words first .. first + count - 1 of a mask's stream, as int64 (two's complement of the unsigned words):
    SplitMix64(seed + (j + 1) * golden), in torch's wrapping 64-bit arithmetic."""
    z = torch.arange(first + 1, first + count + 1, dtype=torch.int64).mul_(_signed(GOLDEN)).add_(_signed(seed))
    z.bitwise_xor_(_shift_right(z, 30)).mul_(_signed(MIX1))
    z.bitwise_xor_(_shift_right(z, 27)).mul_(_signed(MIX2))
    return z.bitwise_xor_(_shift_right(z, 31))


def reference_keep(keep: torch.Tensor, seed: int, threshold: int) -> None:
    """cpu_kernels.c's mask in torch operations, REFERENCE_WORDS words at a time: element i is kept when lane i % 4
    of word i / 4 (16 bits, little-endian, signed) is >= threshold."""
    n = keep.numel()
    for first in range(0, (n + 3) // 4, REFERENCE_WORDS):
        start, end = 4 * first, min(n, 4 * (first + REFERENCE_WORDS))
        lanes = splitmix_words(seed, first, (end - start + 3) // 4).view(torch.int16)
        torch.ge(lanes[: end - start], threshold, out=keep[start:end])


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical (unsigned) shift of int64 words: torch's >> copies the sign bit in."""
    return (z >> bits).bitwise_and_((1 << (64 - bits)) - 1)


# values a mask's application must round as torch does, each kept and dropped (_agrees, tests/test_fast_dropout.py)
SPECIAL = [0.0, -0.0, 1.0, -2.5, 3.0e38, -3.0e38, 1e-40, float("inf"), float("-inf"), float("nan")]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits wherever a is a number (signed zeros told apart), and NaN at the same places: torch's own
    NaNs differ in their bits between its vectorised and scalar bf16 conversions (0xFFFF, 0x7FC0)."""
    nan = a.isnan()
    ints = ONE_BITS[a.dtype][0]
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(ints)[~nan], b.view(ints)[~nan])


# each floating dtype's signed integer of the same size, and the bits of 1.0 as that integer (for as_ones)
ONE_BITS = {
    dtype: (ints, torch.ones((), dtype=dtype).view(ints).item())
    for dtype, ints in (
        (torch.float16, torch.int16),
        (torch.bfloat16, torch.int16),
        (torch.float32, torch.int32),
        (torch.float64, torch.int64),
    )
}


def as_ones(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bool mask as 1.0 / 0.0 of `dtype`, made with integer arithmetic (each byte times the bits of 1.0).
    On CPUs torch.where(keep, x, 0), masked_fill and a bool's conversion to a float type are single-pass kernels
    several times slower than this and one multiplication (docs/lab/2026-11-25-epyc-bf16.md)."""
    ints, one = ONE_BITS[dtype]
    return keep.view(torch.uint8).to(ints).mul_(one).view(dtype)


def torch_masked(x: torch.Tensor, keep: torch.Tensor, scale: float, out: torch.Tensor | None = None):
    """(x * as_ones(keep)) * scale by torch's products (the scale's skipped at 1.0): what the compiled mask
    application is checked against, and what runs where it cannot."""
    masked = torch.mul(x, as_ones(keep, x.dtype), out=out)
    return masked.mul_(scale) if scale != 1.0 else masked


def rope_rms_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """cpu_kernels.c's rotary-then-RMSNorm in float64: x (B, H, T, hs) turned pairwise by (T, hs/2) angles
    (layers.rotate's rule), over the root mean square of x."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    a, b = x.chunk(2, dim=-1)
    turned = torch.cat((a * cos + b * sin, b * cos - a * sin), dim=-1)
    return turned * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


def causal_softmax_reference(s: torch.Tensor, rows: int) -> torch.Tensor:
    """cpu_kernels.c's causal softmax in float64: s (..., cols) in blocks of `rows` queries along its second-to-last
    dimension, each the last `rows` of `cols` positions (row i of a block sees keys 0 .. cols - rows + i)."""
    n, cols = s.size(-2), s.size(-1)
    seen = torch.arange(cols) <= (torch.arange(n) % rows + cols - rows)[:, None]
    return torch.softmax(s.double().masked_fill(~seen, float("-inf")), dim=-1)


def layer_norm_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension in float64 (biased variance, as torch's)."""
    x = x.double()
    y = (x - x.mean(-1, keepdim=True)) * (x.var(-1, unbiased=False, keepdim=True) + eps).rsqrt() * w.double()
    return y if b is None else y + b.double()


LN_CHUNK = 128  # cpu_kernels.c's LayerNorm backward sums the weight's gradient over chunks of this many rows


def layer_norm_chunks(rows: int) -> int:
    """The chunks of rows cpu_kernels.c's LayerNorm backward needs scratch for (2 x n floats each)."""
    return (rows + LN_CHUNK - 1) // LN_CHUNK

"""Dropout masks: keep_mask (False with probability p, from torch's generator's state only) and apply_mask (x times a
mask, then a scale: dropout and its gradient). Torch and the standard library only.

On a CPU a mask comes from a counter-based generator: one seed drawn from torch's generator, then SplitMix64 of
seed + (j + 1) * golden gives 64-bit word j, four 16-bit values a word, one an element. cpu_kernels.c computes it
(kernels/native.py builds, loads and checks it against `reference_keep`, the same arithmetic in torch operations in
kernels/reference.py, which draws the masks where no compiler is found: slower, the same masks). torch's own
bernoulli and random_ draw one number at a time on one core, a large share of a CPU step with dropout; the kernel
draws on every core, many times faster (docs/lab/2026-11-25-zen5.md). On other devices the 16-bit values come from
the device's own generator. The same file applies a mask to bf16 and float32 tensors in one pass, bit for
bit as torch's products.
"""

from __future__ import annotations

import torch

from gptforge.kernels.native import native_kernel, native_kernels
from gptforge.kernels.reference import keep_threshold, reference_keep, torch_masked


def keep_mask(like: torch.Tensor, p: float) -> torch.Tensor:
    """A bool mask shaped like `like` (its values are not read), False with probability p (to 1/65536). Under
    torch.compile it is one opaque operation of the graph (`gptforge::keep_mask`): inductor's own CPU draws (one
    scalar random number per element, fused into its kernels) cost more than the rest of the step's elementwise
    work together (docs/PERFORMANCE.md). It takes the tensor, not its shape, so that no two masks are the same call
    to the compiler (which merges identical calls of an operation it thinks pure). Eager code calls the function
    itself: the operation's wrapper imports torch._dynamo on first use (~0.75 s; model/eager_optim.py)."""
    if torch.compiler.is_compiling():
        return _keep_mask(like, p)
    return draw_keep(like, p)


def draw_keep(like: torch.Tensor, p: float) -> torch.Tensor:
    """keep_mask's draw (the body of the `gptforge::keep_mask` operation)."""
    threshold = keep_threshold(p)
    if like.device.type != "cpu":
        words = torch.empty((like.numel() + 3) // 4, dtype=torch.int64, device=like.device)
        words.random_(-(2**63), 2**63 - 1)
        return words.view(torch.int16)[: like.numel()].view(like.shape) >= threshold
    keep = torch.empty(like.shape, dtype=torch.bool)
    fill_keep(keep.view(-1), mask_seed(), threshold)
    return keep


_keep_mask = torch.library.custom_op(
    "gptforge::keep_mask", draw_keep, mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)


@_keep_mask.register_fake
def _(like: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty(like.shape, dtype=torch.bool, device=like.device)


def mask_seed() -> int:
    """One mask's seed, from torch's CPU generator (seeded and checkpointed like the rest of its state)."""
    return int(torch.empty((), dtype=torch.int64).random_(0, 2**63 - 1))


def fill_keep(keep: torch.Tensor, seed: int, threshold: int) -> None:
    """Write the mask of `seed` into keep (a contiguous bool CPU tensor of n elements): by the compiled kernel, or
    by reference_keep where there is none."""
    kernel = native_kernel()
    if kernel is None:
        reference_keep(keep, seed, threshold)
    else:
        kernel(keep.data_ptr(), keep.numel(), seed, threshold)  # ctypes lets go of Python's lock meanwhile


def apply_mask(x: torch.Tensor, keep: torch.Tensor, scale: float = 1.0, out: torch.Tensor | None = None):
    """(x * as_ones(keep)) * scale, the product by the scale skipped at 1.0 (dropout on a drawn mask, and its
    gradient): the same bits from cpu_kernels.c's one pass on contiguous bf16 / float32 CPU tensors (faster than
    torch's conversions and products: docs/lab/2026-11-26-zen5.md), from torch operations otherwise. `out` may be
    x. Under torch.compile torch's products, which the compiler fuses itself."""
    native = native_kernels() if x.device.type == "cpu" and not torch.compiler.is_compiling() else None
    function = native.masked.get(x.dtype) if native is not None else None
    if function is not None and keep.shape == x.shape and x.is_contiguous() and keep.is_contiguous():
        out = torch.empty_like(x) if out is None else out
        if out.is_contiguous() and out.shape == x.shape and out.dtype == x.dtype:
            function(x.data_ptr(), keep.data_ptr(), out.data_ptr(), x.numel(), scale)
            return out
    return torch_masked(x, keep, scale, out)

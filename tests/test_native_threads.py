"""cpu_kernels.c's kernels split their rows or elements across the threads of torch's own OpenMP runtime: one pool
of threads in the process (the library binds to the libgomp torch loaded), as many as torch.set_num_threads
says, and the same bits on one thread as on three (each part computes what one thread computes for its rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gptforge.kernels import attention as attn
from gptforge.kernels import masks, native, norms, rotary
from gptforge.kernels import reference as mask_reference
from gptforge.model import modules


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def libgomps() -> set[str]:
    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}


def every_kernel(seed: int) -> list[torch.Tensor]:
    """Each compiled kernel once, forward and backward, on inputs large enough to be split: their outputs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    torch.manual_seed(seed)
    keep = masks.keep_mask(torch.empty(3, 300_001), 0.2)  # the draw
    out.append(keep)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 300_001, generator=gen).to(dtype)
        out.append(masks.apply_mask(x, keep, 1.25))  # a mask's application
        rows = torch.randn(4096, 384, generator=gen).to(dtype).requires_grad_()
        y = norms.rms_norm(rows, torch.bfloat16)  # RMSNorm, float32 or bf16 in, bf16 out
        y.backward(torch.randn(y.shape, generator=gen).to(y.dtype))
        out += [y, rows.grad]
        qkv = torch.randn(4, 256, 3, 6, 64, generator=gen).to(dtype)
        q = qkv[:, :, 0].transpose(1, 2).requires_grad_()  # a head-split view, as attention passes it
        angles = torch.randn(256, 32, generator=gen)
        turned = rotary.rotary_rms_norm(q, angles.cos(), angles.sin())  # rotary + RMSNorm
        turned.backward(torch.randn(turned.shape, generator=gen).to(dtype))
        out += [turned, q.grad]
        if dtype == torch.float32:  # LayerNorm, float32 in, bf16 out, under autocast
            norm = modules.LayerNorm(384)
            with torch.no_grad():
                norm.weight.copy_(torch.randn(384, generator=gen))
                norm.bias.copy_(torch.randn(384, generator=gen))
            x = torch.randn(4099, 384, generator=gen).requires_grad_()  # whole chunks of rows and a partial one
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = norm(x)
            y.backward(torch.randn(y.shape, generator=gen).to(y.dtype))
            out += [y, x.grad, norm.weight.grad, norm.bias.grad]
        forward, backward = native.native_kernels().softmax[dtype]  # attention's causal softmax with dropout:
        scores = torch.randn(4, 6, 128, 256, generator=gen).to(dtype)  # a second query block's scores
        probs, att, kept = attn._causal_softmax(forward, scores, 128, 0.1)
        d = torch.randn(scores.shape, generator=gen).to(dtype)
        backward(d.data_ptr(), kept.data_ptr(), probs.data_ptr(), d.data_ptr(), 0, 4 * 6 * 128, 128, 256)
        out += [probs, att, kept, d]
    rows = torch.randn(4099, 384, generator=gen).to(torch.bfloat16)  # the transpose: whole tiles and a ragged end
    transposed = torch.empty(384, 4099, dtype=torch.bfloat16)
    native.native_kernels().transpose(rows.data_ptr(), transposed.data_ptr(), 4099, 384)
    out.append(transposed)
    return out


def test_the_kernels_split_across_torchs_threads_with_the_same_bits(threads):
    kernels = native.native_kernels()
    assert kernels is not None  # CI has a C compiler
    assert native.openmp_flags() == ("-fopenmp",)  # torch's CPU wheels run on libgomp
    assert len(libgomps()) == 1  # torch's: the kernels' library brought no second runtime
    threads(1)
    assert kernels.threads() == 1
    one = every_kernel(seed=3)
    threads(3)
    assert kernels.threads() == 3  # built with OpenMP: a large kernel runs on torch's three threads
    three = every_kernel(seed=3)
    assert len(libgomps()) == 1
    for a, b in zip(one, three, strict=True):
        assert mask_reference.same_bits(a, b) if a.is_floating_point() else torch.equal(a, b)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_kernels_load_and_pass_their_checks_without_autograd(mode):
    """The first use may come inside an evaluation (no_grad) or generation (inference_mode): the load-time checks
    compute their float64 gradients by formula, so the kernels load there too."""
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        kernels, why = native._load()
    assert kernels is not None and why == ""

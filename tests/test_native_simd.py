"""cpu_kernels.c's AVX-512 paths (attention's bf16 causal softmax with dropout, forward and backward; the bf16
residual dropout; the transpose's tiles) give the bits of its portable loops: the library built with -march=native
and with -march=native -mno-avx512f, the same inputs, the same outputs bit for bit, NaN, infinities, fully dropped
and fully kept rows included."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import cpu_flags
from gptforge.kernels import native
from gptforge.kernels import reference as mask_reference

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


pytestmark = pytest.mark.skipif(
    not AVX512 <= cpu_flags() or native.c_compiler() is None,
    reason="no AVX-512 (F, BW, VL, DQ) or no C compiler here: the portable loops are the only ones built",
)


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    native.native_kernels()  # torch's OpenMP runtime is loaded: the libraries bind to it, as gptforge's own does
    folder = tmp_path_factory.mktemp("builds")
    libraries = {}
    for name, extra in (("avx512", ()), ("portable", ("-mno-avx512f",))):
        path = folder / f"{name}.so"
        done = native.build(native.c_compiler(), path, ("-march=native", *extra, *native.openmp_flags()))
        assert done.returncode == 0, done.stderr
        libraries[name] = ctypes.CDLL(str(path))
    return libraries


def test_the_fast_rows_are_built_with_avx512_only(builds: dict[str, ctypes.CDLL]) -> None:
    assert builds["avx512"].gptforge_fast_rows() == 1
    assert builds["portable"].gptforge_fast_rows() == 0


def softmax_both_ways(library: ctypes.CDLL, s: torch.Tensor, d: torch.Tensor, rows: int, p: float) -> list:
    forward, backward = library.gptforge_causal_softmax_bf16, library.gptforge_causal_softmax_back_bf16
    v, i64 = ctypes.c_void_p, ctypes.c_int64
    forward.argtypes = [v] * 4 + [i64] * 4 + [ctypes.c_uint64, ctypes.c_int32, v]
    backward.argtypes = [v] * 4 + [i64] * 4
    n, cols = s.numel() // s.size(-1), s.size(-1)
    probs, att, ds = torch.empty_like(s), torch.empty_like(s), torch.empty_like(s)
    keep, failed = torch.empty(s.shape, dtype=torch.bool), ctypes.c_int32(0)
    forward(s.data_ptr(), probs.data_ptr(), att.data_ptr(), keep.data_ptr(), 0, n, rows, cols, 2**63 - 99,
            mask_reference.keep_threshold(p), ctypes.byref(failed))  # fmt: skip
    backward(d.data_ptr(), keep.data_ptr(), probs.data_ptr(), ds.data_ptr(), 0, n, rows, cols)
    assert failed.value == 0
    return [probs.view(torch.int16), att.view(torch.int16), keep, ds.view(torch.int16)]


@pytest.mark.parametrize(("rows", "cols"), [(128, 256), (128, 128), (3, 64), (5, 32), (40, 96), (3, 8), (4, 40)])
@pytest.mark.parametrize("p", [0.0, 0.2, 1.0])
def test_causal_softmax_rows_give_the_portable_bits(builds: dict[str, ctypes.CDLL], rows: int, cols: int, p: float):
    gen = torch.Generator().manual_seed(rows * cols)
    s = (torch.randn(7, rows, cols, generator=gen) * 3).bfloat16()
    d = torch.randn(7, rows, cols, generator=gen).bfloat16()
    s[0, 0, 0], s[2, -1, 1] = float("nan"), float("inf")  # a NaN row, an infinite score
    s[1, -1, :] = float("-inf")  # a row of -inf scores: NaN probabilities, as torch's softmax gives
    d[3, -1, :3], d[4] = float("nan"), -d[4].abs()  # NaN gradients; negative ones (signed zeros where dropped)
    s[5, -1, :] = torch.linspace(-95.0, 0.0, cols)  # scores at e^x's edge (x < -87 gives 0)
    fast, portable = (softmax_both_ways(builds[name], s, d, rows, p) for name in ("avx512", "portable"))
    for name, a, b in zip(("probs", "att", "keep", "ds"), fast, portable, strict=True):
        assert torch.equal(a, b), f"{name} differs at rows={rows} cols={cols} p={p}"
    if p == 0.2 and cols % 32 == 0:  # the rows took the AVX-512 path and drew a real mask
        assert 0.7 < fast[2].float().mean() < 0.9


@pytest.mark.parametrize("n", [16384 * 384, 1000, 97])  # parts of whole 32-element chunks, and tails
@pytest.mark.parametrize("p", [0.0, 0.2, 1.0])
def test_residual_dropout_gives_the_portable_bits(builds: dict[str, ctypes.CDLL], n: int, p: float):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    y = (torch.randn(n, generator=gen) * 3).bfloat16()
    x[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    y[5:10] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 3.3895e38]).bfloat16()  # rounds up
    outputs = []
    for name in ("avx512", "portable"):
        forward = builds[name].gptforge_residual_dropout_bf16
        forward.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_float]
        keep, out = torch.empty(n, dtype=torch.bool), torch.empty(n)
        threshold, scale = mask_reference.keep_threshold(p), 1.0 / (1.0 - p) if p < 1.0 else 0.0
        forward(x.data_ptr(), y.data_ptr(), keep.data_ptr(), out.data_ptr(), n, 2**63 - 7, threshold, scale)
        outputs.append((keep, out.view(torch.int32)))
    (keep, out), (portable_keep, portable_out) = outputs
    assert torch.equal(keep, portable_keep) and torch.equal(out, portable_out)
    if p == 0.2 and n > 1000:
        assert 0.79 < keep.float().mean() < 0.81


@pytest.mark.parametrize(("rows", "cols"), [(16384, 384), (1030, 70), (33, 64), (31, 31)])
def test_transpose_gives_torchs_copy(builds: dict[str, ctypes.CDLL], rows: int, cols: int):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    for name in ("avx512", "portable"):
        transpose = builds[name].gptforge_transpose16
        transpose.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        out = torch.empty(cols, rows, dtype=torch.bfloat16)
        transpose(x.data_ptr(), out.data_ptr(), rows, cols)
        assert torch.equal(out, x.t().contiguous()), name

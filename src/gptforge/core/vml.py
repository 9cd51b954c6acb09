"""oneMKL's vector math functions (VML), each called once on one thread before any parallel use.

torch's x86 builds hand contiguous float32 and float64 unary ops (sqrt, exp, log, tanh, erf, ...: VML_OPS) to
oneMKL's VML, every intra-op thread on its own chunk. oneMKL 2024.2 (the one in torch 2.13's wheels) picks a
function's kernel on its first call; when that first call runs on two threads at once, one of them can run a
low-accuracy kernel over its whole chunk (pytorch/pytorch#188792, open). Measured on an AMX Xeon (2 cores, two busy
processes beside it): a fresh process's first parallel `sqrt` of 2M float32 values differed from its second in one
thread's half in 8 of 50 processes (5 of 30 again: that half off by a median 1,075 ulp, at most 4,094); only the
first VML function a process called showed it here. A training step met it in AdamW's first `sqrt`: half of the
embedding's values took updates ~1e-4 off (relative) instead of ~1e-6, and a run no longer equalled the same run in
another process (tests/test_sft.py's resume test failed about one time in four under load; OMP_NUM_THREADS=1 never).

`warm_vml` calls each of them once, on one value of each dtype, on the calling thread (a few milliseconds); the
kernels are picked then, and every thread gets the accurate one afterwards (tests/test_vml.py counts forked
processes with and without it; docs/lab/2026-11-27-amx.md). The `gptforge.model` and `gptforge.kernels` packages
call it on import, before anything can reach a parallel op.
Harmless where torch has no MKL: the same ops on one value."""

from __future__ import annotations

import torch

# the torch ops that reach VML (vms* / vmd* in libtorch_cpu): acos ... trunc; log is VML's Ln
VML_OPS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)


def warm_vml() -> None:
    """Call every VML_OPS op once on one float32 and one float64 value (0.5: inside every domain)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype, device="cpu")  # even under a default device
        for name in VML_OPS:
            getattr(torch, name)(x)

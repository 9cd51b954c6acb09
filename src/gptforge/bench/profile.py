"""`gptforge bench --profile`: one more training step under torch.profiler, its time summed by kind.

On a GPU the kernels' own device time (matrix products, attention, inductor's fused kernels, the loss's softmax,
the optimizer...); on a CPU each operator's self time, where torch's profiler is only reliable for the products
(docs/PERFORMANCE.md: it misreports elementwise operations on these CPUs). Found the rotary angles computed inside
every compiled q / k kernel of GPT-2 124M on an H200 (docs/lab/2026-11-26-h200.md, "On a GPU: one NVIDIA H200").
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import torch

# (kind, pattern) in order: a name goes to the first kind whose pattern it matches
GPU_KINDS = [
    ("attention", r"flash|fmha|sdpa|attention|_attn|cudnn"),  # a GPT's only cuDNN kernels are its attention's
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|splitK|wgmma"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("loss (softmax)", r"softmax|nll|cross_entropy"),
    ("fused (inductor)", r"triton"),
    ("embedding / indexing", r"embedding|index|scatter|gather"),
    ("copy / fill", r"copy|fill|memcpy|memset|cat"),
]
CPU_KINDS = [
    ("matmul", r"(aten|mkldnn)::(mm|addmm_?|bmm|baddbmm_?|matmul|linear|_linear_pointwise)$"),  # _: in place
    # a CPU training step's only plain softmax is the attention's (the loss takes log_softmax or HeadLoss)
    ("attention", r"scaled_dot_product|flash_attention|CausalBlocks|SoftmaxDropout|aten::_softmax(_backward_data)?$"),
    ("optimizer", r"Optimizer\.|adam|_foreach"),
    ("loss (softmax)", r"log_softmax|nll|cross_entropy|HeadLoss"),
    ("copy / cast", r"aten::(copy_|to|_to_copy|clone|contiguous|cat)$"),
]
TOP = 15


def profile_step(step: Callable[[], float], device: str) -> dict[str, Any]:
    """Run `step` once under torch.profiler; {'device', 'wall_ms', 'total_ms', 'kinds': {kind: ms}, 'top': [[name,
    ms, calls], ...]} with total_ms the device's kernel time on a GPU, the operators' self time on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    per: dict[str, list[float]] = {}
    if cuda:
        from torch.autograd import DeviceType

        for event in prof.events():
            # kernels only: a record_function range (Optimizer.step#...) also gets a GPU-side span over its kernels
            if event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
                entry = per.setdefault(event.name, [0.0, 0])
                ms = getattr(event, "device_time_total", None)  # cuda_time_total before torch 2.4's rename
                entry[0] += (event.cuda_time_total if ms is None else ms) / 1e3
                entry[1] += 1
    else:
        for row in prof.key_averages():
            if row.self_cpu_time_total > 0:
                per[row.key] = [row.self_cpu_time_total / 1e3, row.count]
    return summarize(per, GPU_KINDS if cuda else CPU_KINDS, wall * 1e3, device)


def summarize(per: dict[str, list[float]], kinds: list[tuple[str, str]], wall_ms: float, device: str) -> dict[str, Any]:
    """profile_step's result from {name: [ms, calls]}: every name counted once, in the first kind it matches."""
    sums: dict[str, float] = {}
    for name, (ms, _) in per.items():
        kind = next((k for k, pattern in kinds if re.search(pattern, name, re.IGNORECASE)), "other")
        sums[kind] = sums.get(kind, 0.0) + ms
    top = sorted(per.items(), key=lambda item: -item[1][0])[:TOP]
    return {
        "device": device,
        "wall_ms": wall_ms,
        "total_ms": sum(ms for ms, _ in per.values()),
        "kinds": dict(sorted(sums.items(), key=lambda item: -item[1])),
        "top": [[name, ms, int(calls)] for name, (ms, calls) in top],
    }


def print_profile(p: dict[str, Any]) -> None:
    """The profile as a table on stdout."""
    what = "kernel time on the GPU" if p["device"].startswith("cuda") else "operators' self time (CPU)"
    print(f"profile of one more step: {p['wall_ms']:,.1f} ms wall, {p['total_ms']:,.1f} ms {what}")
    total = max(p["total_ms"], 1e-9)
    for kind, ms in p["kinds"].items():
        print(f"  {kind:22s} {ms:10,.1f} ms {100 * ms / total:6.1f}%")
    print("  largest:")
    for name, ms, calls in p["top"]:
        print(f"  {ms:10,.1f} ms  x{calls:<5d} {name[:100]}")

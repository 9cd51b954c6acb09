"""Where and in what precision the model runs: device, dtype and compile resolution ('auto'; on a CPU the number
format by what core/cpu.py measures), autocast, backend switches, and the peak FLOP/s that MFU is measured against:
the fastest product the machine has. Measured figures: docs/PERFORMANCE.md."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from gptforge.core.config import DTYPE_CHOICES
from gptforge.core.console import log
from gptforge.core.cpu import (
    DTYPES,
    cpu_kind,
    emulated_half_products,
    half_pays,
    measure_matmul_flops,
    onednn_f32_available,
    rates_said,
)
from gptforge.core.errors import UserError

# Dense (no sparsity) tensor-core peaks in FLOP/s from the vendors' data sheets, by device-name fragment.
# float32 is the TF32 tensor-core figure on Ampere and later, since configure_backends turns TF32 on.
GPU_PEAK_FLOPS = {
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},  # the H100's tensor cores, more memory
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "A10G": {"bfloat16": 70e12, "float16": 70e12, "float32": 35e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12},
    "4090": {"bfloat16": 165e12, "float16": 165e12, "float32": 83e12},
    "3090": {"bfloat16": 71e12, "float16": 71e12, "float32": 36e12},
    "V100": {"float16": 125e12, "float32": 15.7e12},
    "T4": {"float16": 65e12, "float32": 8.1e12},
}

# dtype='auto' on a CPU whose bf16 products measure faster (cpu.half_pays): bfloat16 from this width up (train's
# cpu_bf16_min_width). Below it bf16 did not pay while attention went through SDPA's bf16 backward; with gptforge's
# own attention in training it does at 128 wide too (docs/PERFORMANCE.md), but 256 keeps nanoGPT's README-size
# command in float32, nanoGPT's own arithmetic on a CPU, so that it prints nanoGPT's losses.
CPU_BF16_MIN_WIDTH = 256


def device_type(device: str) -> str:
    """'cuda:1' -> 'cuda': what autocast, GradScaler and the backends are keyed by."""
    return device.split(":")[0]


def resolve_device(name: str) -> str:
    """'auto' -> cuda > mps > cpu; an unavailable device is a user error naming --device."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    kind = device_type(name)
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device={name}: no CUDA device is available here; use --device=cpu or --device=auto")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device={name}: MPS is not available here; use --device=cpu or --device=auto")
    if kind not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device must be 'cpu', 'cuda', 'cuda:N', 'mps' or 'auto'; got {name!r}")
    return name


def onednn_f32_pays(kind: dict[str, str | int | bool] | None = None) -> bool:
    """Where oneDNN's float32 matmul measured faster than torch's (MKL's): AMD processors of family 26 (Zen 5) and
    later with AVX-512, where MKL runs its AVX2 code on full-width 512-bit units (about twice MKL's rate there:
    docs/lab/2026-11-26-zen5.md). Zen 4 (family 25) splits each 512-bit operation in two, so AVX-512 has no more
    float32 throughput there than MKL's AVX2 code: not measured, it keeps torch's. So do Intel's, where MKL has
    AVX-512 code, and AVX2-only processors (oneDNN's AVX2 kernels about level with MKL's: not worth leaving torch's
    arithmetic for; slower on a real Zen 1 EPYC: docs/lab/2026-11-28-epyc-zen1.md). kind: cpu_kind()'s facts, this
    machine's by default."""
    kind = kind if kind is not None else cpu_kind()
    family = str(kind["family"])
    full_width = family.isdigit() and int(family) >= 26
    return kind["vendor"] == "AuthenticAMD" and kind["capability"] == "AVX512" and full_width


def resolve_dtype(name: str, device_type: str, n_embd: int, min_width: int = CPU_BF16_MIN_WIDTH) -> str:
    """'auto' -> bfloat16 on CUDA when supported, else float16 (with a GradScaler); on CPU bfloat16 when its products
    measure faster than float32's here (cpu.half_pays: measured, not read from the CPU's flags) and the model is at
    least min_width wide (train's cpu_bf16_min_width), else float32; float32 on MPS."""
    if name == "auto":
        if device_type == "cuda":
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        wide = n_embd >= min_width
        if device_type == "cpu" and wide and half_pays("bfloat16"):
            return "bfloat16"
        return "float32"
    if name not in DTYPE_CHOICES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}; got {name!r}")
    if name == "bfloat16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("--dtype=bfloat16: this GPU does not support bfloat16; use --dtype=float16")
    return name


def dtype_reason(name: str, dtype: str, device_type: str, n_embd: int, min_width: int = CPU_BF16_MIN_WIDTH) -> str:
    """Why dtype='auto' (`name`) became `dtype` on a CPU, for the line that names it: the probe's two rates where
    they decided, the width where it did; '' for a dtype given, or off the CPU."""
    if name != "auto" or device_type != "cpu":
        return ""
    if n_embd < min_width:
        return f"auto: float32 below cpu_bf16_min_width={min_width} wide"
    return f"auto: {rates_said('bfloat16')}"


def inference_dtype(name: str, device_type: str, n_embd: int) -> str:
    """resolve_dtype for sample, chat, serve and eval (train's rule at its default width), and on a CPU, once a
    process and dtype on stderr, the rates an automatic choice was made by, or emulated_half_products' warning."""
    dtype = resolve_dtype(name, device_type, n_embd)
    if device_type == "cpu":
        _say_dtype(name, dtype, n_embd >= CPU_BF16_MIN_WIDTH)
    return dtype


@functools.cache
def _say_dtype(name: str, dtype: str, wide: bool) -> None:
    warning = emulated_half_products(dtype, "runs")
    if warning:
        log(warning)
    elif name == "auto" and wide:
        log(f"dtype {dtype} ({dtype_reason(name, dtype, 'cpu', CPU_BF16_MIN_WIDTH)})")


def resolve_compile(value: bool | str, device_type: str) -> bool:
    """'auto' -> compile on CUDA, where it pays back its compile time; not on CPU/MPS, where it measured no faster."""
    return device_type == "cuda" if value == "auto" else bool(value)


def resolve_fast_dropout(value: bool | str, device_type: str) -> bool:
    """'auto' -> on for CPU, where torch's bernoulli masks cost a large share of a step with dropout
    (docs/PERFORMANCE.md); off on GPUs, whose fused attention kernels draw their own masks."""
    return device_type == "cpu" if value == "auto" else bool(value)


def resolve_onednn_f32(value: bool | str, device_type: str) -> bool:
    """'auto' -> on for a CPU where oneDNN's float32 products pay (onednn_f32_pays) and can run; True -> on where they
    can run; never off the CPU, where torch's own kernels are the fast ones. True where they cannot run (a torch
    without oneDNN, an ARM CPU; or a run resumed there from a machine that had them) says so and keeps torch's."""
    if device_type != "cpu":
        return False
    if value == "auto":
        return onednn_f32_pays() and onednn_f32_available()
    if value and not onednn_f32_available():
        log(
            "onednn_f32=True: this torch or this CPU has no working oneDNN float32 matmul (an x86-64 build of torch "
            "with oneDNN has one); the float32 products are torch's"
        )
        return False
    return bool(value)


def autocast_context(device_type: str, dtype: str) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass; float32 runs without autocast at all."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[dtype])


def configure_backends(device_type: str) -> None:
    """TF32 tensor cores for float32 matmuls on Ampere+ GPUs: several times the throughput at ~1e-3 precision.
    On a CPU, one thread per physical core this process may use (a second hyperthread on a core only slows
    the matmuls), unless OMP_NUM_THREADS says otherwise (torchrun sets it to 1 for several processes)."""
    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(int(cpu_kind()["physical_cores"]))
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def peak_flops(device: str, configured: float = 0.0, measured: dict[str, float] | None = None) -> float:
    """The peak MFU is measured against, whatever format the run multiplies in: the machine's fastest product, so
    that MFU says how far a run is from what the machine can do (a float32 run where bf16 is faster reads low).
    configured, else the GPU data sheet's fastest figure, else the best of the measured ceilings (`measured`, by
    dtype, when the caller has measured them already; else float32's and, on a CPU whose probe does not find
    bfloat16 emulated or slow, bfloat16's)."""
    if configured > 0:
        return configured
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name:
                return max(table.values())
    if measured:
        return max(measured.values())
    return max(measure_matmul_flops(device, dtype) for dtype in ceiling_dtypes(device_type(device)))


def ceiling_dtypes(device_type: str) -> tuple[str, ...]:
    """The formats whose ceilings can be the machine's fastest: on a CPU, bfloat16 too unless the probe finds it
    emulated or slow (then its 2048-wide product only costs time); on CUDA float32 and bfloat16 (or float16)."""
    if device_type == "cuda":
        return ("float32", "bfloat16" if torch.cuda.is_bf16_supported() else "float16")
    if device_type == "cpu" and not emulated_half_products("bfloat16"):
        return ("float32", "bfloat16")
    return ("float32",)


def available_memory(device: str, processes: int = 1) -> tuple[float | None, str]:
    """(bytes one process may use on `device`, how to name it): a GPU's free memory, or the machine's available
    RAM shared by the `processes` on it; None where it cannot be told (MPS)."""
    kind = device_type(device)
    if kind == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return float(free), f"{device} ({torch.cuda.get_device_name(device)})"
    if kind != "cpu":
        return None, device
    try:
        with open("/proc/meminfo") as fh:
            available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None, "this machine"
    shared = f", shared by {processes} processes" if processes > 1 else ""
    return available / processes, f"this machine (RAM{shared})"

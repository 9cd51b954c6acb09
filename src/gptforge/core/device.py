"""Where and in what precision the model runs: device, dtype and compile resolution ('auto'), autocast, backend
switches, and the peak FLOP/s that MFU is measured against. Measured figures: docs/PERFORMANCE.md."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import time

import torch

from gptforge.core.config import CHOICES
from gptforge.core.console import log
from gptforge.core.errors import UserError

DTYPES = {name: getattr(torch, name) for name in CHOICES["dtype"] if name != "auto"}

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

# dtype='auto' on a CPU with bf16 hardware: bfloat16 from this width up (train's cpu_bf16_min_width). Below it
# bf16 did not pay while attention went through SDPA's bf16 backward; with gptforge's own attention in training
# it does at 128 wide too (docs/PERFORMANCE.md), but 256 keeps nanoGPT's README-size command in float32, nanoGPT's
# own arithmetic on a CPU, so that it prints nanoGPT's losses.
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


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bfloat16 matrices in hardware (AMX tiles or AVX512-BF16); without them
    oneDNN emulates bfloat16, several times slower than float32."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


@functools.cache
def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles (Intel Xeon from Sapphire Rapids on), whose bf16 products SDPA's fused CPU
    kernel uses: there it is the faster attention in a forward without gradients (model/attention.py)."""
    return bool(torch.cpu._is_amx_tile_supported())


def cpu_bf16_autocast(x: torch.Tensor) -> bool:
    """x is on the CPU and CPU autocast is on in bf16: where keep_mask.c's bf16 layers (LayerNormToBf16,
    NarrowGradLinear) take over from torch's float32 operation and autocast's conversion."""
    on = x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
    return on and torch.get_autocast_dtype("cpu") == torch.bfloat16


def onednn_nt(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b.T (+ bias) by oneDNN's matmul, whatever torch's BLAS is: a (M, K), b (N, K), either may be a transposed
    view. float32 on an x86-64 CPU where onednn_f32_available()."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


@functools.cache
def onednn_f32_available() -> bool:
    """oneDNN's float32 matmul can be called (an x86-64 torch built with it) and agrees with a float64 product."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(67, 129, generator=gen), torch.randn(33, 129, generator=gen)
        got = onednn_nt(a, b)
    except (RuntimeError, AttributeError):
        return False
    want = (a.double() @ b.double().t()).float()
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-4))


def onednn_f32_pays(kind: dict[str, str | int | bool] | None = None) -> bool:
    """Where oneDNN's float32 matmul measured faster than torch's (MKL's): AMD processors of family 26 (Zen 5) and
    later with AVX-512, where MKL runs its AVX2 code on full-width 512-bit units (Zen 5: ~450 against ~215 GFLOP/s
    on 2 cores, a float32 training step 0.65-0.78x the time). Zen 4 (family 25) splits each 512-bit operation in two,
    so AVX-512 has no more float32 throughput there than MKL's AVX2 code: not measured, it keeps torch's. So do
    Intel's, where MKL has AVX-512 code, and AVX2-only processors (oneDNN's AVX2 kernels 0.9-1.2x MKL's on a Zen 5
    with AVX-512 turned off; whole training steps there 0.97x the time for the baby speedrun, level for nanoGPT's
    baby recipe: not worth leaving torch's arithmetic for; on a real Zen 1 EPYC the baby speedrun's step took 1.19-1.32x
    as long with oneDNN). kind: cpu_kind()'s facts, this machine's by default."""
    kind = kind if kind is not None else cpu_kind()
    family = str(kind["family"])
    full_width = family.isdigit() and int(family) >= 26
    return kind["vendor"] == "AuthenticAMD" and kind["capability"] == "AVX512" and full_width


def cpu_kind() -> dict[str, str | int | bool]:
    """The facts that decide CPU speed: model name, vendor family / model, torch's vector level (AVX2, AVX512...),
    the bf16 hardware flags, and the physical cores this process may run on."""
    info: dict[str, str] = {}
    cores: set[tuple[str, str]] = set()
    allowed = {str(c) for c in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else None
    try:
        with open("/proc/cpuinfo") as fh:
            for block in fh.read().split("\n\n"):
                fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
                fields = {k.strip(): v.strip() for k, v in fields.items()}
                if not fields.get("processor") or (allowed is not None and fields["processor"] not in allowed):
                    continue
                info = info or fields
                cores.add((fields.get("physical id", "0"), fields.get("core id", fields["processor"])))
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    return {
        "vendor": info.get("vendor_id", ""),
        "model": info.get("model name", ""),
        "family": info.get("cpu family", ""),
        "model_number": info.get("model", ""),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "amx_bf16": "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "physical_cores": len(cores) or (os.cpu_count() or 1),
    }


def describe_cpu(kind: dict[str, str | int | bool]) -> str:
    """One line: 'AMD EPYC (family 25 model 17), 2 cores, AVX2, bf16 hardware: none'."""
    bf16 = [name for name in ("amx_bf16", "avx512_bf16") if kind[name]]
    return (
        f"{kind['model'] or 'unknown CPU'} (family {kind['family']} model {kind['model_number']}), "
        f"{kind['physical_cores']} cores, {kind['capability']}, bf16 hardware: {', '.join(bf16) or 'none'}"
    )


def resolve_dtype(name: str, device_type: str, n_embd: int, min_width: int = CPU_BF16_MIN_WIDTH) -> str:
    """'auto' -> bfloat16 on CUDA when supported, else float16 (with a GradScaler); on CPU bfloat16 when the
    hardware has it (AMX / AVX512-BF16) and the model is at least min_width wide (train's cpu_bf16_min_width),
    else float32; float32 on MPS."""
    if name == "auto":
        if device_type == "cuda":
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        wide = n_embd >= min_width
        if device_type == "cpu" and wide and cpu_has_fast_bf16():
            return "bfloat16"
        return "float32"
    if name not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(CHOICES['dtype'])}; got {name!r}")
    if name == "bfloat16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("--dtype=bfloat16: this GPU does not support bfloat16; use --dtype=float16")
    return name


def inference_dtype(name: str, device_type: str, n_embd: int) -> str:
    """resolve_dtype for sample, chat, serve and eval (train's rule at its default width), and on a CPU
    emulated_half_products' warning on stderr, once a process and dtype."""
    dtype = resolve_dtype(name, device_type, n_embd)
    if device_type == "cpu":
        _say_emulated(dtype)
    return dtype


@functools.cache
def _say_emulated(dtype: str) -> None:
    warning = emulated_half_products(dtype, "runs")
    if warning:
        log(warning)


def resolve_compile(value: bool | str, device_type: str) -> bool:
    """'auto' -> compile on CUDA, where it pays back its compile time; not on CPU/MPS, where it measured no faster."""
    return device_type == "cuda" if value == "auto" else bool(value)


def resolve_fast_dropout(value: bool | str, device_type: str) -> bool:
    """'auto' -> on for CPU, where torch's bernoulli masks cost 17-25% of a step with dropout 0.2; off on GPUs,
    whose fused attention kernels draw their own masks."""
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


PROBE_N = 256  # a CPU's first product, this wide, says how wide the measured one can be
MEASURE_SECONDS = 0.5  # a CPU's measured product is made narrower until one is expected to take at most this


def measure_matmul_flops(device: str, dtype: str, n: int | None = None, reps: int = 3) -> float:
    """Best FLOP/s of an n x n matrix product on this device and dtype: the machine's practical ceiling.

    On a CPU in float32 the faster of torch's product and oneDNN's (`onednn_f32`; 2.1x torch's on a Zen 5 EPYC).
    n defaults to 2048, and to 8192 on CUDA: a 2048-wide product is too small to fill a large GPU (it read 277-401
    TFLOP/s of bf16 on an H200 and an H100, against their 989 of the data sheet). On a CPU a PROBE_N-wide product
    comes first, and the default n is halved while the probe's rate says one product would take longer than
    MEASURE_SECONDS: where bf16 is emulated (no bf16 hardware, or oneDNN held to AVX2 by ONEDNN_MAX_CPU_ISA) one
    2048-wide bf16 product takes from seconds to a minute. The operands come from a private generator: measuring
    must not shift the training run's random stream.
    """
    if n is None:
        n = 8192 if device_type(device) == "cuda" else 2048
        if device_type(device) == "cpu":
            n = affordable_width(n, PROBE_N, _product_seconds(device, dtype, PROBE_N, reps=1))
    return 2 * n**3 / _product_seconds(device, dtype, n, reps)


def affordable_width(n: int, probe_n: int, probe_seconds: float, budget: float = MEASURE_SECONDS) -> int:
    """n, halved while it is wider than probe_n and a product of that width, at the probe's rate (time growing as
    width^3), would take longer than `budget` seconds."""
    while n > probe_n and probe_seconds * (n / probe_n) ** 3 > budget:
        n //= 2
    return n


def emulated_half_products(dtype: str, work: str = "trains") -> str:
    """'' unless `dtype` (bfloat16 / float16) multiplies matrices on this CPU at under half float32's rate, as where
    it is emulated: no bf16 hardware, oneDNN held below it (ONEDNN_MAX_CPU_ISA), or a torch built without its
    kernels (4-80x slower than float32 on the CPUs measured). Then a warning naming both rates and --dtype=float32,
    which `work`s ('trains', 'runs') faster. PROBE_N-wide products of each, in turn, three rounds, the best rate
    of each (a process's first products are slow, and a busy machine slows some: neither makes one dtype look slow
    against the other); ~9 ms in a fresh process where the hardware has it (a Zen 5)."""
    if dtype == "float32":
        return ""
    rates = dict.fromkeys((dtype, "float32"), 0.0)
    for _ in range(3):
        for name in rates:
            rates[name] = max(rates[name], 2 * PROBE_N**3 / _product_seconds("cpu", name, PROBE_N, reps=1))
    half, single = rates[dtype], rates["float32"]
    if half >= 0.5 * single:
        return ""
    return (
        f"warning: {dtype} matrix products run at {half / 1e9:,.1f} GFLOP/s on this CPU against float32's "
        f"{single / 1e9:,.1f}: emulated here (no {dtype} hardware, or ONEDNN_MAX_CPU_ISA holds oneDNN below it); "
        f"--dtype=float32 {work} faster"
    )


def _product_seconds(device: str, dtype: str, n: int, reps: int) -> float:
    """The fastest of `reps` n x n products (after one that warms kernels and caches up); on a CPU in float32 over
    torch's product and oneDNN's both."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(DTYPES[dtype])
    b = torch.randn(n, n, device=device, generator=gen).to(DTYPES[dtype])
    cuda = device.startswith("cuda")
    products = [torch.matmul]
    if device_type(device) == "cpu" and dtype == "float32" and onednn_f32_available():
        products.append(onednn_nt)  # what onednn_f32 trains with
    best = float("inf")
    for product in products:  # a CPU's float32: the faster of torch's BLAS and oneDNN, which training may use
        for _ in range(reps + 1):  # the first product warms up kernels and caches
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            product(a, b)
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    return best


def peak_flops(device: str, dtype: str, configured: float = 0.0, measured: dict[str, float] | None = None) -> float:
    """The peak MFU is measured against: configured, else a GPU data-sheet figure, else a measured matmul ceiling
    (taken from `measured`, by dtype, when the caller has measured it already)."""
    if configured > 0:
        return configured
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name and dtype in table:
                return table[dtype]
    if measured and dtype in measured:
        return measured[dtype]
    return measure_matmul_flops(device, dtype)


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

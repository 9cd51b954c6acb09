"""What this CPU is and how fast it multiplies matrices: its kind (cpu_kind, describe_cpu), its matrix-product rate in
each number format (measure_matmul_flops: the ceilings MFU is measured against), and the short probe that every
dtype='auto' on a CPU decides by (half_pays: bfloat16 where its products measure faster than float32's, whatever the
CPU's flags say; some CPUs list avx512_bf16 and multiply bf16 at half float32's rate). The probe's rates (one core's)
are kept per machine, torch version and ONEDNN_MAX_CPU_ISA in $GPTFORGE_CACHE_DIR/product_rates.json, so a command
pays for it once. docs/PERFORMANCE.md, "Choosing the number format", says how to read them."""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import platform
import time

import torch

from gptforge.core.files import atomic_write, cache_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROBE_N = 256  # the probe's width: a few milliseconds where the hardware has the format
MEASURE_SECONDS = 0.5  # a CPU's measured ceiling is made narrower until one product is expected to take at most this
# bfloat16 is chosen where its products run at least this much faster than float32's: below it, the conversions
# autocast adds around each product eat the gain
HALF_PAYS = 1.25
RATES_FILE = "product_rates.json"
PROBE_ROUNDS, PROBE_MAX_ROUNDS = 3, 12


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
        "flags_digest": hashlib.sha1(" ".join(sorted(flags)).encode()).hexdigest()[:12],
    }


def describe_cpu(kind: dict[str, str | int | bool]) -> str:
    """One line: 'AMD EPYC (family 25 model 17), 2 cores, AVX2, bf16 flags: none'."""
    bf16 = [name for name in ("amx_bf16", "avx512_bf16") if kind[name]]
    return (
        f"{kind['model'] or 'unknown CPU'} (family {kind['family']} model {kind['model_number']}), "
        f"{kind['physical_cores']} cores, {kind['capability']}, bf16 flags: {', '.join(bf16) or 'none'}"
    )


@functools.cache
def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles (Intel Xeon from Sapphire Rapids on), whose bf16 products SDPA's fused CPU
    kernel uses: there it is the faster attention in a forward without gradients (kernels/attention.py)."""
    return bool(torch.cpu._is_amx_tile_supported())


def cpu_bf16_autocast(x: torch.Tensor) -> bool:
    """x is on the CPU and CPU autocast is on in bf16: where cpu_kernels.c's bf16 layers (LayerNormToBf16,
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


def measure_matmul_flops(device: str, dtype: str, n: int | None = None, reps: int = 3) -> float:
    """Best FLOP/s of an n x n matrix product on this device and dtype: the machine's practical ceiling.

    On a CPU in float32 the faster of torch's product and oneDNN's (`onednn_f32`). n defaults to 2048, and to 8192 on
    CUDA: a 2048-wide product is too small to fill a large GPU. On a CPU a PROBE_N-wide product comes first, and the
    default n is halved while the probe's rate says one product would take longer than MEASURE_SECONDS: where bf16
    is emulated one 2048-wide bf16 product takes from seconds to a minute. The operands come from a private
    generator: measuring must not shift the training run's random stream.
    """
    cuda = device.startswith("cuda")
    if n is None:
        n = 8192 if cuda else 2048
        if device.split(":")[0] == "cpu":
            n = affordable_width(n, PROBE_N, product_seconds(device, dtype, PROBE_N, reps=1))
    return 2 * n**3 / product_seconds(device, dtype, n, reps)


def affordable_width(n: int, probe_n: int, probe_seconds: float, budget: float = MEASURE_SECONDS) -> int:
    """n, halved while it is wider than probe_n and a product of that width, at the probe's rate (time growing as
    width^3), would take longer than `budget` seconds."""
    while n > probe_n and probe_seconds * (n / probe_n) ** 3 > budget:
        n //= 2
    return n


def product_seconds(device: str, dtype: str, n: int, reps: int) -> float:
    """The fastest of `reps` n x n products (after one that warms kernels and caches up); on a CPU in float32 over
    torch's product and oneDNN's both."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(DTYPES[dtype])
    b = torch.randn(n, n, device=device, generator=gen).to(DTYPES[dtype])
    cuda = device.startswith("cuda")
    products = [torch.matmul]
    if device.split(":")[0] == "cpu" and dtype == "float32" and onednn_f32_available():
        products.append(onednn_nt)  # what onednn_f32 trains with
    best = float("inf")
    for product in products:
        for _ in range(reps + 1):  # the first product warms up kernels and caches
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            product(a, b)
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    return best


def machine_key() -> str:
    """What a probe's rates hold for: this CPU (model and flags), torch's version and ONEDNN_MAX_CPU_ISA (which can
    hold oneDNN below the CPU's bf16 kernels)."""
    kind = cpu_kind()
    return (
        f"{kind['model']} (family {kind['family']} model {kind['model_number']}, flags {kind['flags_digest']}) | "
        f"torch {torch.__version__} | "
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')}"
    )


def rates_file() -> str:
    return os.path.join(cache_dir(), RATES_FILE)


@functools.cache
def _known(path: str, key: str) -> dict[str, float]:
    """The rates kept in file `path` for `key` (this process adds to the dict it returns)."""
    try:
        with open(path, encoding="utf-8") as fh:
            entry = json.load(fh)["machines"][key]
        return {name: float(entry[name]) for name in DTYPES if isinstance(entry.get(name), (int, float))}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def cpu_product_rates(*dtypes: str) -> dict[str, float]:
    """This CPU's PROBE_N-wide matrix-product rate (FLOP/s) in float32 and each of `dtypes`: read from rates_file(),
    else measured (_probe: products of each format in turn, the best rate of each, so that neither a process's slow
    first products nor a busy machine makes one format look slow against another) and kept there."""
    known = _known(rates_file(), machine_key())
    wanted = ("float32", *dtypes)
    if any(name not in known for name in wanted):
        known.update(_probe(wanted))
        _keep(rates_file(), machine_key(), known)
    return {name: known[name] for name in wanted}


def _probe(dtypes: tuple[str, ...]) -> dict[str, float]:
    """The best rate of each format on one core over rounds of one PROBE_N-wide product each, in turn: at least
    PROBE_ROUNDS,
    and more (up to PROBE_MAX_ROUNDS) while a round still raises a best by over 5%. A machine busy with other
    processes slows products by bursts; the best of enough rounds is the machine's own rate, and what is kept for
    every later process should not be a busy minute's."""
    best, threads = dict.fromkeys(dtypes, 0.0), torch.get_num_threads()
    torch.set_num_threads(1)  # one core: a product split over threads waits for the slowest of them on a busy machine
    try:
        for done in range(PROBE_MAX_ROUNDS):
            rates = {name: 2 * PROBE_N**3 / product_seconds("cpu", name, PROBE_N, reps=1) for name in best}
            raised = any(rates[name] > 1.05 * best[name] for name in best)
            best = {name: max(best[name], rates[name]) for name in best}
            if done + 1 >= PROBE_ROUNDS and not raised:
                break
    finally:
        torch.set_num_threads(threads)
    return best


def adopt_rates(rates: dict[str, float]) -> None:
    """Decide by `rates` from here on in this process: torchrun's ranks take rank 0's, so that every 'auto' comes out
    the same on all of them (each rank's own probe could fall either side of HALF_PAYS on a borderline CPU)."""
    _known(rates_file(), machine_key()).update(rates)


def _keep(path: str, key: str, rates: dict[str, float]) -> None:
    """Write `rates` under `key` into the file `path`, keeping the other machines' entries; a cache that cannot be
    written only costs the next process its probe."""
    try:
        with open(path, encoding="utf-8") as fh:
            machines = json.load(fh).get("machines", {})
    except (OSError, ValueError, AttributeError):
        machines = {}
    measured = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machines[key] = {**rates, "measured": measured}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_write(path, "w", encoding="utf-8") as fh:
            json.dump({"format": 1, "machines": machines}, fh, indent=1)
    except OSError:
        pass


def half_pays(dtype: str = "bfloat16") -> bool:
    """Whether `dtype`'s products on this CPU run at least HALF_PAYS times float32's (the probe's rates)."""
    rates = cpu_product_rates(dtype)
    return rates[dtype] >= HALF_PAYS * rates["float32"]


def rates_said(dtype: str = "bfloat16") -> str:
    """'bfloat16 products B GFLOP/s a core against float32's F': the probe's two rates, as the lines that name an
    automatic choice say them."""
    rates = cpu_product_rates(dtype)
    return f"{dtype} products {rates[dtype] / 1e9:,.1f} GFLOP/s a core against float32's {rates['float32'] / 1e9:,.1f}"


def emulated_half_products(dtype: str, work: str = "trains") -> str:
    """'' unless `dtype` (bfloat16 / float16) multiplies matrices on this CPU at under half float32's rate, as where
    it is emulated (no bf16 hardware, oneDNN held below it by ONEDNN_MAX_CPU_ISA, a torch built without its kernels)
    or where the hardware's bf16 is slow: then a warning naming both rates and --dtype=float32, which `work`s
    ('trains', 'runs') faster."""
    if dtype == "float32":
        return ""
    rates = cpu_product_rates(dtype)
    half, single = rates[dtype], rates["float32"]
    if half >= 0.5 * single:
        return ""
    return (
        f"warning: {dtype} matrix products run at {half / 1e9:,.1f} GFLOP/s a core on this CPU against float32's "
        f"{single / 1e9:,.1f}: emulated or slow here (no fast {dtype} hardware, or ONEDNN_MAX_CPU_ISA holds oneDNN "
        f"below it); --dtype=float32 {work} faster"
    )

"""Dropout masks: keep_mask (False with probability p, from torch's generator's state only), apply_mask (x times a
mask, then a scale: dropout and its gradient) and as_ones (a mask as 1.0 / 0.0 of a float type). Torch and the
standard library only.

On a CPU a mask comes from a counter-based generator: one seed drawn from torch's generator, then SplitMix64 of
seed + (j + 1) * golden gives 64-bit word j, four 16-bit values a word, one an element. keep_mask.c computes it,
compiled on first use with the machine's C compiler (cached in ~/.cache/gptforge, one file per source, compiler and
CPU) and checked against `reference_keep`, the same arithmetic in torch operations, which draws the masks where no
compiler is found (slower; the same masks). torch's own bernoulli and random_ draw one number at a time on one core
(17-25% of a CPU step with dropout 0.2); the kernel is ~20x faster than the 8 parallel torch streams it replaced
(docs/PERFORMANCE.md). On other devices the 16-bit values come from the device's own generator. The same file
applies a mask to bf16 and float32 tensors in one pass, checked bit for bit against torch's products.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from gptforge.core.allocator import switched_off
from gptforge.core.console import log

SOURCE = Path(__file__).with_name("keep_mask.c")
SWITCH = "GPTFORGE_NATIVE"  # 0 / off / false: no compiled kernel, masks by torch operations (the same masks)
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99")
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's constants
REFERENCE_WORDS = 1 << 20  # the torch reference works through this many words at a time (8 MiB per temporary)


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
    threshold = round(p * 65536) - 32768  # an element is kept when its signed 16-bit value is >= this
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


def splitmix_words(seed: int, first: int, count: int) -> torch.Tensor:
    """Words first .. first + count - 1 of a mask's stream, as int64 (two's complement of the unsigned words):
    SplitMix64(seed + (j + 1) * golden), in torch's wrapping 64-bit arithmetic."""
    z = torch.arange(first + 1, first + count + 1, dtype=torch.int64).mul_(_signed(GOLDEN)).add_(_signed(seed))
    z.bitwise_xor_(_shift_right(z, 30)).mul_(_signed(MIX1))
    z.bitwise_xor_(_shift_right(z, 27)).mul_(_signed(MIX2))
    return z.bitwise_xor_(_shift_right(z, 31))


def reference_keep(keep: torch.Tensor, seed: int, threshold: int) -> None:
    """keep_mask.c's mask in torch operations, REFERENCE_WORDS words at a time: element i is kept when lane i % 4
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


# the compiled kernels: looked for once per process ([Native] or [None])
_kernel: list = []


class Native(NamedTuple):
    """keep_mask.c's functions: the mask's draw, and a mask's application for each dtype it has one for."""

    keep: Callable[..., None]
    masked: dict[torch.dtype, Callable[..., None]]


def native_kernel():  # noqa: ANN201 - a ctypes function or None
    """keep_mask.c's mask function, compiled on first use; None (said once) with GPTFORGE_NATIVE=0, without a C
    compiler, or when the compiled kernel does not reproduce reference_keep (and torch's masked products)."""
    native = _native()
    return None if native is None else native.keep


def _native() -> Native | None:
    if not _kernel:
        native, why = _load()
        if native is None and why:
            log(f"dropout masks: {why}; drawn by torch operations instead (the same masks, slower)")
        _kernel.append(native)
    return _kernel[0]


def _load() -> tuple[Native | None, str]:
    if switched_off(SWITCH):
        return None, ""
    compiler = c_compiler()
    if not compiler:
        return None, "no C compiler found (install gcc, or set CC) for the compiled kernel"
    try:
        path = _compiled(compiler)
        library = ctypes.CDLL(str(path))
        keep, bf16, f32 = library.gptforge_keep_mask, library.gptforge_masked_bf16, library.gptforge_masked_f32
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        return None, f"the compiled kernel could not be built or loaded ({e})"
    keep.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int32]
    for function in (keep, bf16, f32):
        function.restype = None
    for function in (bf16, f32):
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]
    native = Native(keep, {torch.bfloat16: bf16, torch.float32: f32})
    if not _agrees(native):
        return None, f"the compiled kernel ({path}) does not reproduce reference_keep and torch's masked products"
    return native, ""


def c_compiler() -> str | None:
    """The C compiler the kernel is built with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compiled(compiler: str) -> Path:
    """The kernel's shared library for this source, compiler and CPU (-march=native), built when missing: into a
    temporary file, then renamed (ranks of one run may build it at once)."""
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join(x.encode() for x in (compiler, version, " ".join(FLAGS), _cpu_flags())))
    key.update(source)
    folder = _cache_folder()
    target = folder / f"keep_mask-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        for extra in (("-march=native",), ()):  # a compiler without -march=native builds the portable form
            done = subprocess.run(
                [compiler, *FLAGS, *extra, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300
            )
            if done.returncode == 0:
                os.replace(tmp, target)
                return target
        said = done.stderr.strip().splitlines()
        raise subprocess.SubprocessError(f"{compiler} {SOURCE.name}: {said[-1] if said else f'exit {done.returncode}'}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cache_folder() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptforge" / "native"
    user = os.getuid() if hasattr(os, "getuid") else 0
    for folder in (base, Path(tempfile.gettempdir()) / f"gptforge-native-{user}"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    raise OSError("no writable cache folder for the compiled kernel (~/.cache or the temporary folder)")


def _cpu_flags() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags.strip()}"


# values a mask's application must round as torch does, each kept and dropped (_agrees, tests/test_fast_dropout.py)
SPECIAL = [0.0, -0.0, 1.0, -2.5, 3.0e38, -3.0e38, 1e-40, float("inf"), float("-inf"), float("nan")]


def _agrees(native: Native) -> bool:
    """The compiled kernel gives reference_keep's mask (a few words and a ragged tail, two seeds, two thresholds),
    and apply_mask's torch products bit for bit (special values kept and dropped; three scales)."""
    for seed, threshold, n in ((0, -32768 + 13107, 4099), (2**63 - 25, 3, 1031)):
        ours, theirs = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.bool)
        native.keep(ours.data_ptr(), n, seed, threshold)
        reference_keep(theirs, seed, threshold)
        if not torch.equal(ours, theirs):
            return False
    values = torch.cat([torch.tensor(SPECIAL * 2), torch.randn(1021, generator=torch.Generator().manual_seed(3))])
    keep = torch.arange(values.numel()) % 3 != 1  # each special value both kept and dropped
    for dtype, function in native.masked.items():
        x = values.to(dtype)
        for scale in (1.0, 1.0 / 0.8, 1.0 / 0.95):
            ours = torch.empty_like(x)
            function(x.data_ptr(), keep.data_ptr(), ours.data_ptr(), x.numel(), scale)
            if not same_bits(ours, _torch_masked(x, keep, scale)):
                return False
    return True


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
    On CPUs torch.where(keep, x, 0), masked_fill and a bool's conversion to a float type are single-pass
    kernels 3-7x the time of this and one multiplication (docs/PERFORMANCE.md)."""
    ints, one = ONE_BITS[dtype]
    return keep.view(torch.uint8).to(ints).mul_(one).view(dtype)


def apply_mask(x: torch.Tensor, keep: torch.Tensor, scale: float = 1.0, out: torch.Tensor | None = None):
    """(x * as_ones(keep)) * scale, the product by the scale skipped at 1.0 (dropout on a drawn mask, and its
    gradient): the same bits from keep_mask.c's one pass on contiguous bf16 / float32 CPU tensors (1.4-2.7x faster
    than torch's conversions and products here, docs/PERFORMANCE.md), from torch operations otherwise. `out` may
    be x. Under torch.compile torch's products, which the compiler fuses itself."""
    native = _native() if x.device.type == "cpu" and not torch.compiler.is_compiling() else None
    function = native.masked.get(x.dtype) if native is not None else None
    if function is not None and keep.shape == x.shape and x.is_contiguous() and keep.is_contiguous():
        out = torch.empty_like(x) if out is None else out
        if out.is_contiguous() and out.shape == x.shape and out.dtype == x.dtype:
            function(x.data_ptr(), keep.data_ptr(), out.data_ptr(), x.numel(), scale)
            return out
    return _torch_masked(x, keep, scale, out)


def _torch_masked(x: torch.Tensor, keep: torch.Tensor, scale: float, out: torch.Tensor | None = None):
    masked = torch.mul(x, as_ones(keep, x.dtype), out=out)
    return masked.mul_(scale) if scale != 1.0 else masked

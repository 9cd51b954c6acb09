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
applies a mask to bf16 and float32 tensors in one pass, checked bit for bit against torch's products, and holds
a residual connection with dropout (x + dropout(y), the same bits), RMSNorm's forward and backward, alone and
after rotary, and LayerNorm into bf16 for layers.py, and the causal softmax with dropout of attention's query
blocks for attention.py (`native_kernels`; checked against float64, torch's bits and reference_keep at load). Where
torch runs on GNU OpenMP the file is built with -fopenmp (`openmp_flags`) and its kernels split their work across
torch's own threads.
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
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-fno-math-errno")  # sqrtf as one instruction, no libm
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


def keep_threshold(p: float) -> int:
    """An element is kept when its signed 16-bit value is >= this: False with probability p (to 1/65536)."""
    return round(p * 65536) - 32768


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
    """keep_mask.c's functions: the mask's draw, a mask's application for each dtype it has one for, and RMSNorm's
    forward (by (x's, y's) dtype) and backward (by (the gradient's, x's) dtype)."""

    keep: Callable[..., None]
    masked: dict[torch.dtype, Callable[..., None]]
    rms: dict[tuple[torch.dtype, torch.dtype], Callable[..., None]]
    rms_back: dict[tuple[torch.dtype, torch.dtype], Callable[..., None]]
    rope_rms: dict[torch.dtype, tuple[Callable[..., None], Callable[..., None]]]  # forward, backward by dtype
    softmax: dict[torch.dtype, tuple[Callable[..., None], Callable[..., None]]]  # causal softmax + dropout, likewise
    threads: Callable[[], int]  # the threads a large kernel runs on in the calling thread (1 without OpenMP)
    layer_norm: tuple[Callable[..., None], Callable[..., None]]  # float32 -> bf16 LayerNorm, its backward
    residual: dict[torch.dtype, tuple[Callable[..., None], Callable[..., None]]]  # x + dropout(y) by y's dtype


# RMSNorm's compiled (input, output) dtype pairs: float32 in and out, bf16 written from float32 (a block's norm
# under autocast) or from bf16 (qk-norm); the backward's (gradient, x) pairs are the same three
RMS_PAIRS = ((torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16))
RMS_BACK_PAIRS = ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16))
_C_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def native_kernel():  # noqa: ANN201 - a ctypes function or None
    """keep_mask.c's mask function, compiled on first use; None (said once) with GPTFORGE_NATIVE=0, without a C
    compiler, or when the compiled kernel does not reproduce reference_keep (and torch's masked products)."""
    native = _native()
    return None if native is None else native.keep


def native_kernels() -> Native | None:
    """The compiled kernels for RMSNorm (Native.rms, .rms_back, .rope_rms) and attention's causal softmax
    (Native.softmax), or None where there are none (layers.py and attention.py then use torch operations)."""
    return _native()


def _native() -> Native | None:
    if not _kernel:
        native, why = _load()
        if native is None and why:
            log(
                f"compiled CPU kernels: {why}; dropout masks drawn and RMSNorm computed by torch operations instead "
                "(the same masks, slower)"
            )
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
    rms, rms_back = {}, {}
    try:
        for pair in RMS_PAIRS:
            rms[pair] = getattr(library, "gptforge_rms_{}_{}".format(*(_C_NAMES[d] for d in pair)))
            rms[pair].argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_float]
        for pair in RMS_BACK_PAIRS:
            rms_back[pair] = getattr(library, "gptforge_rms_back_{}_{}".format(*(_C_NAMES[d] for d in pair)))
            rms_back[pair].argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        rope_rms = {}
        for dtype, name in _C_NAMES.items():
            forward, backward = (
                getattr(library, f"gptforge_rope_rms_{name}"),
                getattr(library, f"gptforge_rope_rms_back_{name}"),
            )
            forward.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float]
            backward.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 10
            rope_rms[dtype] = (forward, backward)
        softmax = {}
        for dtype, name in _C_NAMES.items():
            forward, backward = (
                getattr(library, f"gptforge_causal_softmax_{name}"),
                getattr(library, f"gptforge_causal_softmax_back_{name}"),
            )
            forward.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_uint64, ctypes.c_int32]
            forward.argtypes += [ctypes.c_void_p]  # set to 1 where a thread's row buffer could not be allocated
            backward.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
            softmax[dtype] = (forward, backward)
        threads = library.gptforge_threads
        threads.argtypes, threads.restype = [], ctypes.c_int
        layer_norm = (library.gptforge_layer_norm_f32_bf16, library.gptforge_layer_norm_back_bf16_f32)
        layer_norm[0].argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        layer_norm[1].argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 2
        residual = {}
        for dtype, name in _C_NAMES.items():
            forward, backward = (
                getattr(library, f"gptforge_residual_dropout_{name}"),
                getattr(library, f"gptforge_residual_dropout_back_{name}"),
            )
            forward.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_float]
            backward.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_float]
            residual[dtype] = (forward, backward)
    except AttributeError as e:
        return None, f"the compiled kernel could not be built or loaded ({e})"
    pairs = (*rope_rms.values(), *softmax.values(), layer_norm, *residual.values())
    for function in (*rms.values(), *rms_back.values(), *(f for pair in pairs for f in pair)):
        function.restype = None
    native = Native(
        keep,
        {torch.bfloat16: bf16, torch.float32: f32},
        rms,
        rms_back,
        rope_rms,
        softmax,
        threads,
        layer_norm,
        residual,
    )
    if not (_agrees(native) and _residual_agrees(native)):
        return None, f"the compiled kernel ({path}) does not reproduce reference_keep and torch's masked products"
    if not (_rms_agrees(native) and _rope_rms_agrees(native)):
        return None, f"the compiled kernel's RMSNorm ({path}) does not agree with float64's"
    if not _softmax_agrees(native):
        return None, f"the compiled kernel's causal softmax ({path}) does not agree with float64's and keep_mask's"
    if not _layer_norm_agrees(native):
        return None, f"the compiled kernel's LayerNorm ({path}) does not agree with float64's"
    return native, ""


def c_compiler() -> str | None:
    """The C compiler the kernel is built with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def openmp_flags() -> tuple[str, ...]:
    """("-fopenmp",) where this process runs torch on GNU OpenMP (libgomp is loaded): the kernels' library then
    binds to that same runtime (the name libgomp.so.1 is taken by the library already loaded) and splits its work
    across torch's own threads. () elsewhere: another OpenMP runtime (Intel's, LLVM's) would bring a second pool of
    threads competing with torch's for the same cores."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    return ("-fopenmp",) if "libgomp" in maps else ()


def _compiled(compiler: str) -> Path:
    """The kernel's shared library for this source, compiler and CPU (-march=native) and threads (openmp_flags),
    built when missing: into a temporary file, then renamed (ranks of one run may build it at once). A compiler
    without -march=native or OpenMP builds the form without them."""
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    openmp = openmp_flags()
    key = hashlib.sha256(b"\0".join(x.encode() for x in (compiler, version, " ".join(FLAGS + openmp), _cpu_flags())))
    key.update(source)
    folder = _cache_folder()
    target = folder / f"keep_mask-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        for extra in dict.fromkeys((("-march=native", *openmp), ("-march=native",), openmp, ())):
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
    for seed, threshold, n in ((0, -32768 + 13107, 4099), (2**63 - 25, 3, 1031), (7, 0, 200_003)):  # 1, 1, 2+ parts
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


def _residual_agrees(native: Native) -> bool:
    """x + dropout(y) and its gradient for y give torch's bits: x + apply_mask(y, mask), and apply_mask of the float32
    gradient rounded to y's dtype, with reference_keep's mask (special values in y and in the gradient)."""
    n, seed, threshold, scale = 1041, 12345, keep_threshold(0.2), 1.0 / 0.8
    values = torch.cat(
        [torch.tensor(SPECIAL * 2), torch.randn(n - 2 * len(SPECIAL), generator=torch.Generator().manual_seed(9))]
    )
    x = torch.randn(n, generator=torch.Generator().manual_seed(10))
    kept = torch.empty(n, dtype=torch.bool)
    reference_keep(kept, seed, threshold)
    for dtype, (forward, backward) in native.residual.items():
        y, keep, out = values.to(dtype), torch.empty(n, dtype=torch.bool), torch.empty(n)
        forward(x.data_ptr(), y.data_ptr(), keep.data_ptr(), out.data_ptr(), n, seed, threshold, scale)
        if not (torch.equal(keep, kept) and same_bits(out, x + _torch_masked(y, kept, scale))):
            return False
        dy = torch.empty(n, dtype=dtype)
        backward(values.data_ptr(), kept.data_ptr(), dy.data_ptr(), n, scale)
        if not same_bits(dy, _torch_masked(values.to(dtype), kept, scale)):
            return False
    return True


def _rms_agrees(native: Native) -> bool:
    """RMSNorm's compiled forward (y and the rows' r) and backward agree with the same formulas in float64, for
    every dtype pair, on rows of 64 and 383 (whole and partial lanes): within float32 rounding where the output is
    float32, within one bf16 rounding where it is bf16."""
    gen, eps = torch.Generator().manual_seed(4), 1e-6
    for n in (64, 383):
        x64 = torch.randn(5, n, dtype=torch.float64, generator=gen) * 3
        g64 = torch.randn(5, n, dtype=torch.float64, generator=gen)
        for x_type, y_type in RMS_PAIRS:
            x = x64.to(x_type)
            y, r = torch.empty(x.shape, dtype=y_type), torch.empty(5, 1)
            native.rms[(x_type, y_type)](x.data_ptr(), y.data_ptr(), r.data_ptr(), 0, 5, n, eps)
            want_r = (x.double().pow(2).mean(-1, keepdim=True) + eps).rsqrt()
            if not torch.allclose(r.double(), want_r, rtol=1e-5, atol=0):
                return False
            if not torch.allclose(y.double(), x.double() * want_r, rtol=_RMS_RTOL[y_type], atol=_RMS_RTOL[y_type]):
                return False
        for g_type, x_type in RMS_BACK_PAIRS:
            x, g = x64.to(x_type), g64.to(g_type)
            r = (x.double().pow(2).mean(-1, keepdim=True) + eps).rsqrt().float()
            dx = torch.empty(x.shape, dtype=x_type)
            native.rms_back[(g_type, x_type)](g.data_ptr(), x.data_ptr(), r.data_ptr(), dx.data_ptr(), 0, 5, n)
            rd, xd, gd = r.double(), x.double(), g.double()
            want = gd * rd - xd * rd.pow(3) * (gd * xd).mean(-1, keepdim=True)
            if not torch.allclose(dx.double(), want, rtol=_RMS_RTOL[x_type], atol=_RMS_RTOL[x_type]):
                return False
    return True


_RMS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def rope_rms_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """keep_mask.c's rotary-then-RMSNorm in float64: x (B, H, T, hs) turned pairwise by (T, hs/2) angles
    (layers.rotate's rule), over the root mean square of x."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    a, b = x.chunk(2, dim=-1)
    turned = torch.cat((a * cos + b * sin, b * cos - a * sin), dim=-1)
    return turned * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


def _rope_rms_agrees(native: Native) -> bool:
    """The compiled rotary + RMSNorm, forward and backward, on a strided x (a head-split view, as attention passes
    it), within float32 rounding (float32) or one bf16 rounding (bf16) of float64's value and gradient."""
    gen = torch.Generator().manual_seed(5)
    B, H, T, hs = 2, 3, 5, 32
    base = torch.randn(B, T, 3 * H * hs, dtype=torch.float64, generator=gen) * 2
    angles = torch.randn(T, hs // 2, dtype=torch.float64, generator=gen)
    cos, sin = angles.cos().float(), angles.sin().float()
    g64 = torch.randn(B, H, T, hs, dtype=torch.float64, generator=gen)
    for dtype, (forward, backward) in native.rope_rms.items():
        x = base.to(dtype)[..., : H * hs].view(B, T, H, hs).transpose(1, 2)  # strides of q in attention
        x64, gd = x.double(), g64.to(dtype).double()
        want = rope_rms_reference(x64, cos, sin)
        # the gradient by its formula (this may run where autograd does not: inside a Function, inference mode)
        p, q = gd.chunk(2, dim=-1)
        c64, s64 = cos.double(), sin.double()
        u = torch.cat((p * c64 - q * s64, q * c64 + p * s64), dim=-1)  # g turned back
        r64 = (x64.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
        want_dx = u * r64 - x64 * r64.pow(3) * (u * x64).mean(-1, keepdim=True)
        y, r = torch.empty(B, H, T, hs, dtype=dtype), torch.empty(B * H * T)
        sb, sh, st, _ = x.stride()
        forward(x.data_ptr(), y.data_ptr(), r.data_ptr(), cos.data_ptr(), sin.data_ptr(), B, H, T, hs, sb, sh, st, 1e-6)
        dx = torch.empty(B, T, H, hs, dtype=dtype).transpose(1, 2)
        g = g64.to(dtype)
        backward(
            g.data_ptr(), x.data_ptr(), r.data_ptr(), cos.data_ptr(), sin.data_ptr(), dx.data_ptr(),
            B, H, T, hs, sb, sh, st, *dx.stride()[:3],
        )  # fmt: skip
        tol = _RMS_RTOL[dtype]
        if not torch.allclose(y.double(), want, rtol=tol, atol=tol):
            return False
        if not torch.allclose(dx.double(), want_dx, rtol=tol, atol=tol * want_dx.abs().max().item()):
            return False
    return True


def causal_softmax_reference(s: torch.Tensor, rows: int) -> torch.Tensor:
    """keep_mask.c's causal softmax in float64: s (..., cols) in blocks of `rows` queries along its second-to-last
    dimension, each the last `rows` of `cols` positions (row i of a block sees keys 0 .. cols - rows + i)."""
    n, cols = s.size(-2), s.size(-1)
    seen = torch.arange(cols) <= (torch.arange(n) % rows + cols - rows)[:, None]
    return torch.softmax(s.double().masked_fill(~seen, float("-inf")), dim=-1)


def _softmax_agrees(native: Native) -> bool:
    """The compiled causal softmax with dropout, forward and backward, on two blocks of 3 queries over 8, 7 and 64
    keys (a mask's words whole, split across rows, and the width of the AVX-512 rows): the probabilities and the
    gradient within float32 rounding (float32) or one bf16 rounding (bf16) of float64's, the mask reference_keep's
    bit for bit, att the kept probabilities exactly."""
    gen, rows, n, seed, threshold = torch.Generator().manual_seed(6), 3, 6, 2**63 - 99, 13107 - 32768
    for cols in (8, 7, 64):
        s64 = torch.randn(n, cols, dtype=torch.float64, generator=gen) * 4
        d64 = torch.randn(n, cols, dtype=torch.float64, generator=gen)
        for dtype, (forward, backward) in native.softmax.items():
            s, d, tol = s64.to(dtype), d64.to(dtype), _RMS_RTOL[dtype]
            probs, att, keep = torch.empty_like(s), torch.empty_like(s), torch.empty(n, cols, dtype=torch.bool)
            failed = ctypes.c_int32(0)
            forward(s.data_ptr(), probs.data_ptr(), att.data_ptr(), keep.data_ptr(), 0, n, rows, cols, seed, threshold,
                    ctypes.byref(failed))  # fmt: skip
            kept = torch.empty(n, cols, dtype=torch.bool)
            reference_keep(kept.view(-1), seed, threshold)
            if failed.value or not (torch.equal(keep, kept) and torch.equal(att, probs * keep)):
                return False
            if not torch.allclose(probs.double(), causal_softmax_reference(s, rows), rtol=tol, atol=tol):
                return False
            ds = torch.empty_like(s)
            backward(d.data_ptr(), keep.data_ptr(), probs.data_ptr(), ds.data_ptr(), 0, n, rows, cols)
            p, dd = probs.double(), d.double() * kept
            if not torch.allclose(ds.double(), p * (dd - (p * dd).sum(-1, keepdim=True)), rtol=tol, atol=tol):
                return False
    return True


LN_CHUNK = 128  # keep_mask.c's LayerNorm backward sums the weight's gradient over chunks of this many rows


def layer_norm_chunks(rows: int) -> int:
    """The chunks of rows keep_mask.c's LayerNorm backward needs scratch for (2 x n floats each)."""
    return (rows + LN_CHUNK - 1) // LN_CHUNK


def layer_norm_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension in float64 (biased variance, as torch's)."""
    x = x.double()
    y = (x - x.mean(-1, keepdim=True)) * (x.var(-1, unbiased=False, keepdim=True) + eps).rsqrt() * w.double()
    return y if b is None else y + b.double()


def _layer_norm_agrees(native: Native) -> bool:
    """The compiled LayerNorm (float32 in, bf16 out) and its backward (a bf16 gradient) on rows of 64 and 383 (whole
    and partial lanes), with and without a bias: y within one bf16 rounding of float64's, x's, the weight's and the
    bias's gradients within float32 rounding of float64's from the same bf16 gradient."""
    gen, eps = torch.Generator().manual_seed(8), 1e-5
    forward, backward = native.layer_norm
    for n, bias in ((64, True), (383, False)):
        x = (torch.randn(5, n, dtype=torch.float64, generator=gen) * 3 + 1).float()
        w = torch.randn(n, dtype=torch.float64, generator=gen).float()
        b = torch.randn(n, dtype=torch.float64, generator=gen).float() if bias else None
        g = torch.randn(5, n, dtype=torch.float64, generator=gen).to(torch.bfloat16)
        y, mean, rstd = torch.empty(5, n, dtype=torch.bfloat16), torch.empty(5), torch.empty(5)
        forward(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), mean.data_ptr(),
                rstd.data_ptr(), 5, n, eps)  # fmt: skip
        want = layer_norm_reference(x, w, b, eps)
        if not torch.allclose(y.double(), want, rtol=2**-7, atol=2**-7):
            return False
        dx, dw, db, partial = torch.empty(5, n), torch.empty(n), torch.empty(n), torch.empty(layer_norm_chunks(5), 2, n)
        backward(g.data_ptr(), x.data_ptr(), w.data_ptr(), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                 dw.data_ptr(), db.data_ptr(), partial.data_ptr(), 5, n)  # fmt: skip
        # the gradients by their formulas (this may run where autograd does not: no_grad, inference mode)
        x64, g64 = x.double(), g.double()
        rstd64 = (x64.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
        xhat, gw = (x64 - x64.mean(-1, keepdim=True)) * rstd64, g64 * w.double()
        want_dx = rstd64 * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
        got = (dx, dw, db) if b is not None else (dx, dw)
        for mine, theirs in zip(got, (want_dx, (g64 * xhat).sum(0), g64.sum(0)), strict=False):
            if not torch.allclose(mine.double(), theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item()):
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

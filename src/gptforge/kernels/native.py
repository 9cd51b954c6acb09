"""cpu_kernels.c, gptforge's compiled CPU kernels: built on first use with the machine's C compiler (cached in
~/.cache/gptforge/native, one file per source, compiler, CPU and threading: -march=native, and -fopenmp where torch
runs on GNU OpenMP, `openmp_flags`, so that the kernels split their work across torch's own threads), loaded with
ctypes, and checked before use against torch's bits or float64 (kernels/checks.py). `native_kernels()` gives them
(Native), or None (said once) with GPTFORGE_NATIVE=0, without a compiler or when a check fails: the other kernels
modules then use torch operations."""

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
from typing import Any, NamedTuple

import torch

from gptforge.core.allocator import switched_off
from gptforge.core.console import log
from gptforge.kernels.checks import failed_check

SOURCE = Path(__file__).with_name("cpu_kernels.c")
SWITCH = "GPTFORGE_NATIVE"  # 0 / off / false: no compiled kernel, masks by torch operations (the same masks)
# -fno-math-errno: sqrtf as one instruction, no libm. -fno-trapping-math: branches such as relu's `v < 0 ? 0 : v`
# become vector selects without AVX-512's masked stores (an AVX2-only CPU's build kept relu(x)^2 a scalar loop with a
# branch: docs/lab/2026-11-27-amx.md); the values are IEEE's either way, only floating-point exception flags
# are not kept
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-fno-math-errno", "-fno-trapping-math")

# the compiled kernels: looked for once per process ([Native] or [None])
_kernel: list = []


class Native(NamedTuple):
    """cpu_kernels.c's functions: the mask's draw, a mask's application for each dtype it has one for, RMSNorm's
    forward (by (x's, y's) dtype) and backward (by (the gradient's, x's) dtype), and the rest as their fields say."""

    keep: Callable[..., None]
    masked: dict[torch.dtype, Callable[..., None]]
    rms: dict[tuple[torch.dtype, torch.dtype], Callable[..., None]]
    rms_back: dict[tuple[torch.dtype, torch.dtype], Callable[..., None]]
    rope_rms: dict[torch.dtype, tuple[Callable[..., None], Callable[..., None]]]  # forward, backward by dtype
    softmax: dict[torch.dtype, tuple[Callable[..., None], Callable[..., None]]]  # causal softmax + dropout, likewise
    threads: Callable[[], int]  # the threads a large kernel runs on in the calling thread (1 without OpenMP)
    layer_norm: tuple[Callable[..., None], Callable[..., None]]  # float32 -> bf16 LayerNorm, its backward
    residual: dict[torch.dtype, tuple[Callable[..., None], Callable[..., None]]]  # x + dropout(y) by y's dtype
    relu2: dict[torch.dtype, tuple[Callable[..., None], Callable[..., None]]]  # relu(x)^2, its gradient, by dtype
    add_bf16: Callable[..., None]  # a float32 x plus a bf16 y into float32
    add_norm: tuple[Callable[..., None], Callable[..., None]]  # x + dropout(y) then LayerNorm into bf16, its backward
    transpose: Callable[..., None]  # a 16-bit matrix transposed into another
    fast_rows: bool  # built with its AVX-512 paths (the softmax's and residual's rows, the transpose's tiles)


# RMSNorm's compiled (input, output) dtype pairs: float32 in and out, bf16 written from float32 (a block's norm
# under autocast) or from bf16 (qk-norm); the backward's (gradient, x) pairs are the same three
RMS_PAIRS = ((torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16))
RMS_BACK_PAIRS = ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16))
_C_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def native_kernel():  # noqa: ANN201 - a ctypes function or None
    """cpu_kernels.c's mask function, compiled on first use; None (said once) with GPTFORGE_NATIVE=0, without a C
    compiler, or when the compiled kernel does not reproduce reference_keep (and torch's masked products)."""
    native = _native()
    return None if native is None else native.keep


def native_kernels() -> Native | None:
    """The compiled kernels for RMSNorm (Native.rms, .rms_back, .rope_rms) and attention's causal softmax
    (Native.softmax), or None where there are none (layers.py and attention.py then use torch operations)."""
    return _native()


def cpu_kernels(*tensors: torch.Tensor) -> Native | None:
    """native_kernels() for plain (not DTensor) CPU tensors outside torch.compile, else None."""
    if torch.compiler.is_compiling() or any(type(t) is not torch.Tensor or t.device.type != "cpu" for t in tensors):
        return None
    return native_kernels()


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
        native = bind(ctypes.CDLL(str(path)))
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        return None, f"the compiled kernel could not be built or loaded ({e})"
    failed = failed_check(native)
    if failed:
        return None, f"the compiled kernel ({path}): {failed}"
    return native, ""


_P, _I, _U, _S, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_float


def _typed(library: ctypes.CDLL, name: str, argtypes: list, restype: Any = None) -> Callable[..., Any]:
    """library's function `name` with its argument and result types set."""
    function = getattr(library, name)
    function.argtypes, function.restype = argtypes, restype
    return function


def _each_dtype(library: ctypes.CDLL, name: str, forward: list, backward: list) -> dict[torch.dtype, tuple]:
    """The forward and backward functions gptforge_{name}_{dtype} and gptforge_{name}_back_{dtype}, by dtype."""
    return {
        dtype: (
            _typed(library, f"gptforge_{name}_{c}", forward),
            _typed(library, f"gptforge_{name}_back_{c}", backward),
        )
        for dtype, c in _C_NAMES.items()
    }


def bind(library: ctypes.CDLL) -> Native:
    """A loaded build of cpu_kernels.c's functions with their argument types, as Native (not yet checked: the
    caller runs failed_check). AttributeError where the library lacks one."""
    masked = [_P, _P, _P, _I, _F]
    rms = {
        pair: _typed(library, "gptforge_rms_{}_{}".format(*(_C_NAMES[d] for d in pair)), [_P] * 3 + [_I] * 3 + [_F])
        for pair in RMS_PAIRS
    }
    rms_back = {
        pair: _typed(library, "gptforge_rms_back_{}_{}".format(*(_C_NAMES[d] for d in pair)), [_P] * 4 + [_I] * 3)
        for pair in RMS_BACK_PAIRS
    }
    # the softmax's last pointer is set to 1 where a thread's row buffer could not be allocated
    softmax = _each_dtype(library, "causal_softmax", [_P] * 4 + [_I] * 4 + [_U, _S, _P], [_P] * 4 + [_I] * 4)
    return Native(
        keep=_typed(library, "gptforge_keep_mask", [_P, _I, _U, _S]),
        masked={
            torch.bfloat16: _typed(library, "gptforge_masked_bf16", masked),
            torch.float32: _typed(library, "gptforge_masked_f32", masked),
        },
        rms=rms,
        rms_back=rms_back,
        rope_rms=_each_dtype(library, "rope_rms", [_P] * 5 + [_I] * 7 + [_F], [_P] * 6 + [_I] * 10),
        softmax=softmax,
        threads=_typed(library, "gptforge_threads", [], ctypes.c_int),
        layer_norm=(
            _typed(library, "gptforge_layer_norm_f32_bf16", [_P] * 6 + [_I] * 2 + [_F]),
            _typed(library, "gptforge_layer_norm_back_bf16_f32", [_P] * 9 + [_I] * 2),
        ),
        residual=_each_dtype(library, "residual_dropout", [_P] * 4 + [_I, _U, _S, _F], [_P] * 3 + [_I, _F]),
        relu2=_each_dtype(library, "relu2", [_P] * 2 + [_I], [_P] * 3 + [_I]),
        add_bf16=_typed(library, "gptforge_add_bf16", [_P] * 3 + [_I]),
        add_norm=(
            _typed(library, "gptforge_add_norm_bf16", [_P] * 9 + [_I] * 2 + [_U, _S] + [_F] * 2),
            _typed(library, "gptforge_add_norm_back_bf16", [_P] * 12 + [_I] * 2 + [_F]),
        ),
        transpose=_typed(library, "gptforge_transpose16", [_P] * 2 + [_I] * 2),
        fast_rows=bool(_typed(library, "gptforge_fast_rows", [], ctypes.c_int)()),
    )


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
            done = build(compiler, tmp, extra)
            if done.returncode == 0:
                os.replace(tmp, target)
                return target
        said = done.stderr.strip().splitlines()
        raise subprocess.SubprocessError(f"{compiler} {SOURCE.name}: {said[-1] if said else f'exit {done.returncode}'}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(compiler: str, target: str | Path, extra: tuple[str, ...]) -> subprocess.CompletedProcess:
    """cpu_kernels.c compiled into the library `target` with FLAGS and `extra` (-march=..., openmp_flags()); the
    compiler's output captured, its status returned, not raised."""
    return subprocess.run(
        [compiler, *FLAGS, *extra, "-o", str(target), str(SOURCE)], capture_output=True, text=True, timeout=300
    )


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

"""cpu_kernels.c as a CPU with AVX2 but no AVX-512 builds it (the AVX2-only EPYC of docs/PERFORMANCE.md: no bf16
hardware, the float32 recipes): built here for x86-64-v3 (AVX2, FMA), it passes every load-time check that
gptforge's own build passes, and its elementwise loops are vector code. Without -fno-trapping-math the compiler kept
relu(x)^2's forward a scalar loop with a branch there (`v < 0 ? 0 : v` then a product it may not compute for the
lanes it does not store): 14x slower than the vector loop, ~100 ms of the float32 baby speedrun's step."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import cpu_flags
from gptforge.kernels import native
from gptforge.kernels.checks import failed_check

pytestmark = pytest.mark.skipif(
    not {"avx2", "fma"} <= cpu_flags() or native.c_compiler() is None,
    reason="not an x86 CPU with AVX2 and FMA, or no C compiler: an x86-64-v3 build cannot run here",
)

# the elementwise kernels: each one loop over n values, which the compiler vectorises on AVX2
ELEMENTWISE = [
    "gptforge_keep_mask",
    "gptforge_masked_f32",
    "gptforge_masked_bf16",
    "gptforge_residual_dropout_f32",
    "gptforge_residual_dropout_back_f32",
    "gptforge_add_bf16",
    "gptforge_relu2_f32",
    "gptforge_relu2_back_f32",
    "gptforge_relu2_bf16",
    "gptforge_relu2_back_bf16",
]


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    native.native_kernels()  # torch's OpenMP runtime is loaded: the library binds to it, as gptforge's own does
    path = tmp_path_factory.mktemp("avx2") / "keep_mask_v3.so"
    done = native.build(native.c_compiler(), path, ("-march=x86-64-v3", *native.openmp_flags()))
    if done.returncode != 0 and "x86-64-v3" in done.stderr:
        pytest.skip(f"this compiler has no -march=x86-64-v3: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    return path


def test_the_avx2_build_passes_every_load_check(avx2_build: Path) -> None:
    kernels = native.bind(ctypes.CDLL(str(avx2_build)))
    assert not kernels.fast_rows  # the portable loops, not the AVX-512 rows
    assert failed_check(kernels) == ""


def vector_instructions(library: Path) -> dict[str, int]:
    """For each function of the library (its OpenMP bodies counted with it): how many instructions name a 256-bit
    register."""
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    counts: dict[str, int] = {}
    function = ""
    for line in listing.splitlines():
        head = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if head:
            function = head.group(1).split("._omp_fn")[0]
        elif "%ymm" in line:
            counts[function] = counts.get(function, 0) + 1
    return counts


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils) to read the build's code")
def test_the_avx2_builds_elementwise_loops_are_vector_code(avx2_build: Path) -> None:
    counts = vector_instructions(avx2_build)
    scalar = [name for name in ELEMENTWISE if counts.get(name, 0) == 0]
    assert not scalar, f"scalar loops in the x86-64-v3 build (no 256-bit instruction): {scalar}"

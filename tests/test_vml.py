"""core/vml.py: oneMKL's vector math functions are called once on one thread when gptforge.model is imported, so
a process's first parallel sqrt / exp / ... is the accurate kernel on every thread (pytorch/pytorch#188792)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptforge.core.vml import VML_OPS

# VML's name for a torch op where they differ
VML_NAME = {"log": "Ln", "erfinv": "ErfInv"}

# A fresh interpreter imports torch and gptforge.model, then forks CHILDREN processes one after the other: each
# runs every VML op twice on 262,144 values with two threads and exits 1 where the first call (the one that picks
# the kernels, racing on two threads) differs from the second. Forked children start with VML's kernels picked
# only because the parent picked them; no parallel region runs in the parent, so forking is safe.
STORM = r"""
import os, sys
import torch
import gptforge.model
ops, children = sys.argv[1].split(","), int(sys.argv[2])

def child():
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    (torch.randn(256, 32, generator=g) @ torch.randn(32, 50304, generator=g)).sum()  # MKL itself started
    x = torch.rand(1 << 18, generator=g) * 0.9 + 0.05  # inside every op's domain
    wrong = [op for op in ops if not torch.equal(getattr(torch, op)(x), getattr(torch, op)(x))]
    print(" ".join(wrong), flush=True)
    os._exit(1 if wrong else 0)

bad = 0
for _ in range(children):
    pid = os.fork()
    if pid == 0:
        child()
    bad += os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0
print(f"{bad} of {children}")
"""


def exported_vml_functions() -> set[str]:
    """The single-precision VML functions libtorch_cpu exports (vmsSqrt -> 'Sqrt'): the ones ATen calls."""
    nm = shutil.which("nm")
    assert nm, "nm (binutils) is needed to read libtorch_cpu's symbols: apt-get install binutils"
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.split()[-2:-1] == ["T"]}
    return {n[3:] for n in names if n.startswith("vms") and n[3:4].isupper() and not n.endswith("_64")}


def test_the_warm_up_calls_every_vml_function_torch_uses():
    if not torch.backends.mkl.is_available():
        pytest.fail("this torch has no MKL: the warm-up has nothing to warm; the test expects torch's x86 wheel")
    wanted = {VML_NAME.get(op, op.capitalize()) for op in VML_OPS}
    assert wanted == exported_vml_functions()


def test_a_fresh_process_first_parallel_vml_calls_are_accurate_after_the_import():
    """100 forked processes, two busy processes beside them (the race needs a thread to lose its core midway):
    none may see a first call differ from the second. Without the import this machine (AMX Xeon, torch 2.13,
    oneMKL 2024.2) showed 10 of 150 for sqrt alone."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        r = subprocess.run(
            [sys.executable, "-c", STORM, ",".join(VML_OPS), "100"],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert r.returncode == 0, r.stderr
    wrong = [line for line in r.stdout.splitlines()[:-1] if line.strip()]
    assert r.stdout.splitlines()[-1] == "0 of 100", f"first calls that differed from the second: {wrong}"

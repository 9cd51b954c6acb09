"""The malloc setting: freed memory stays in the process, in gptforge itself and in every process it starts;
GPTFORGE_MALLOC=0 and the user's own settings leave glibc as it is. Measured with glibc's own accounting
(mallinfo2: the bytes held in blocks of their own mapping) against the same program with the setting off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import run_cli, tiny_train_args
from gptforge.core.allocator import SWITCH, USER_VARIABLES, _apply, _libc

pytestmark = pytest.mark.skipif(_libc() is None, reason="not glibc: the setting is not applied on this C library")

# Holds a 64 MiB tensor and reports how many bytes glibc has in mmapped blocks meanwhile; as "parent" it first
# applies gptforge's setting and then runs itself as "child", a plain Python process started from there.
PROBE = r"""
import ctypes, json, subprocess, sys
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def mapped_while_holding():
    t = torch.ones(16 * 2**20)  # 64 MiB
    held = libc.mallinfo2().hblkhd
    del t
    return held

out = {}
if sys.argv[1] == "parent":
    from gptforge.core.allocator import keep_freed_memory
    out["line"] = keep_freed_memory()
    child = subprocess.run([sys.executable, "-c", sys.argv[2], "child"], capture_output=True, text=True, check=True)
    out["child"] = json.loads(child.stdout)["self"]
out["self"] = mapped_while_holding()
print(json.dumps(out))
"""
HELD = 64 * 2**20


def probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in (SWITCH, "GLIBC_TUNABLES", *USER_VARIABLES)}
    argv = [sys.executable, "-c", PROBE, "parent", PROBE]
    done = subprocess.run(argv, env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_freed_memory_is_kept_in_gptforge_and_in_the_processes_it_starts():
    on = probe()
    assert on["line"].startswith("malloc: freed memory kept in the process")
    assert on["self"] < HELD and on["child"] < HELD, on  # the 64 MiB came from the heap, not a mapping of its own
    off = probe(**{SWITCH: "0"})  # the reference: glibc's defaults map such a block and unmap it when freed
    assert off["line"] == f"malloc: glibc's defaults ({SWITCH}=0)"
    assert off["self"] >= HELD and off["child"] >= HELD, off


def test_the_users_own_malloc_settings_are_left_alone():
    for env in ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, {"MALLOC_TOP_PAD_": "0"}):
        before = dict(env)
        assert _apply(env) == "malloc: your own settings (GLIBC_TUNABLES / MALLOC_*_) are kept"
        assert env == before
    other = {"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=2048"}  # not malloc's: ours are added after it
    assert _apply(other).startswith("malloc: freed memory kept")
    assert other["GLIBC_TUNABLES"].startswith("glibc.rtld.optional_static_tls=2048:glibc.malloc.mmap_max=0:")


def test_train_says_which_malloc_it_runs_with(char_data, tmp_path):
    args = tiny_train_args(char_data, tmp_path / "on", max_iters=2, eval_interval=2)
    done = run_cli("train", *args)
    assert done.returncode == 0, done.stderr
    assert "malloc: freed memory kept in the process (GPTFORGE_MALLOC=0 to turn off)" in done.stdout
    done = run_cli("train", *tiny_train_args(char_data, tmp_path / "off", max_iters=2), env={SWITCH: "off"})
    assert done.returncode == 0, done.stderr
    assert "malloc: glibc's defaults (GPTFORGE_MALLOC=0)" in done.stdout

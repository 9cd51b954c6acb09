"""glibc malloc settings for training: keep freed memory in the process instead of handing it back to the kernel.

With glibc's defaults every block above the (dynamic) mmap threshold is a fresh mapping and every large free
unmaps it; a CPU training step frees and re-allocates its large activations, so each step page-faults them
in again. On the 2-core EPYC machines that was a large share of a baby-GPT step's wall time
(docs/lab/2026-11-22-epyc-avx2.md).
`keep_freed_memory` turns that off for this process (mallopt) and for every process it starts (the same
settings as GLIBC_TUNABLES in the environment: torchrun's ranks, data workers, subprocesses). The cost: the
process keeps its high-water mark of memory until it exits.

Off with GPTFORGE_MALLOC=0 (glibc's defaults); left alone when the user has set any malloc tunable or
MALLOC_*_ variable of their own, or on a C library without mallopt (macOS, musl). Standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import MutableMapping

SWITCH = "GPTFORGE_MALLOC"  # 0 / off / false: leave malloc as glibc configures it
# glibc tunable name -> (mallopt parameter number from malloc.h, value)
SETTINGS = {
    "glibc.malloc.mmap_max": (-4, 0),  # M_MMAP_MAX: no block gets a mapping of its own; all come from the heap
    "glibc.malloc.trim_threshold": (-1, 2**34),  # M_TRIM_THRESHOLD: never give the heap's top back (16 GiB)
    "glibc.malloc.top_pad": (-2, 2**30),  # M_TOP_PAD: grow the heap 1 GiB at a time
}
USER_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_status: list[str] = []  # what keep_freed_memory decided in this process, once


def switched_off(name: str, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether the environment switch `name` says off: 0, off, false or no (any case, spaces around ignored); this
    module's GPTFORGE_MALLOC and kernels/native.py's GPTFORGE_NATIVE."""
    return environ.get(name, "").strip().lower() in ("0", "off", "false", "no")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        glibc = hasattr(libc, "gnu_get_libc_version")  # musl has mallopt but not these semantics
        return libc if glibc and hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def keep_freed_memory(environ: MutableMapping[str, str] = os.environ) -> str:
    """Apply SETTINGS to this process and to the environment its children inherit; return one line that says
    what was done (train and bench print it). Called again, it only repeats that line."""
    if not _status:
        _status.append(_apply(environ))
    return _status[0]


def _apply(environ: MutableMapping[str, str]) -> str:
    if switched_off(SWITCH, environ):
        return f"malloc: glibc's defaults ({SWITCH}=0)"
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables or any(v in environ for v in USER_VARIABLES):
        return "malloc: your own settings (GLIBC_TUNABLES / MALLOC_*_) are kept"
    libc = _libc()
    if libc is None:
        return "malloc: not glibc; left as it is"
    for param, value in SETTINGS.values():
        libc.mallopt(param, value)
    ours = ":".join(f"{name}={value}" for name, (_, value) in SETTINGS.items())
    environ["GLIBC_TUNABLES"] = f"{tunables}:{ours}" if tunables else ours
    return f"malloc: freed memory kept in the process ({SWITCH}=0 to turn off)"

"""Messages for people, on stderr so that stdout stays the command's result: `log` lines and `progress` bars."""

from __future__ import annotations

import math
import sys
from typing import Any


def duration(seconds: float) -> str:
    """1h05m, 4m07s: a time left or taken."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def progress(total: int | None, desc: str, unit: str, enabled: bool = True, **options: Any) -> Any:
    """A tqdm bar on stderr (None when not `enabled`, e.g. on ranks other than 0); close it when done."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, **options)

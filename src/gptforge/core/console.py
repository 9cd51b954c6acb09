"""Messages for people, on stderr so that stdout stays the command's result: `log` lines and `progress` bars."""

from __future__ import annotations

import sys
from typing import Any


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def progress(total: int | None, desc: str, unit: str, enabled: bool = True, **options: Any) -> Any:
    """A tqdm bar on stderr (None when not `enabled`, e.g. on ranks other than 0); close it when done."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, **options)

"""Files on disk: the names in a run folder, writes that never leave a torn file, downloads that never leave a
partial one. Standard library only, so the dashboard may import it (docs/ARCHITECTURE.md, "Files")."""

from __future__ import annotations

import contextlib
import os
import re
import urllib.request
from collections.abc import Iterator
from typing import IO, Any

from gptforge.core.console import log
from gptforge.core.errors import UserError

# A run folder (<out_dir>/), as train writes it and sample, eval and the dashboard read it.
CKPT = "ckpt.pt"  # the latest checkpoint: what --init_from=resume continues
BEST_CKPT = "ckpt_best.pt"  # the lowest val loss so far
CONFIG = "config.json"  # the resolved TrainConfig
METRICS = "metrics.jsonl"
LOG = "log.txt"  # build-nanogpt's format
SAMPLES = "samples.jsonl"
TENSORBOARD = "tensorboard"  # a folder of event files
STEP_FILE = re.compile(r"model_(\d{5,})\.pt")  # step_checkpoint_name's files; the group is the step


def cache_dir() -> str:
    """Where gptforge keeps what it downloads or measures once: $GPTFORGE_CACHE_DIR, else ~/.cache/gptforge."""
    return os.environ.get("GPTFORGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gptforge")


def step_checkpoint_name(step: int) -> str:
    """build-nanogpt's name for the checkpoint after `step` steps: model_05000.pt."""
    return f"model_{step:05d}.pt"


def temp_path(path: str) -> str:
    """Where `path` is written before it takes its name: `.<name>.<pid>.tmp` in the same folder, so a rename
    replaces it in one step and a later start can tell whose writer left it (remove_stale_temporaries, below)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}.tmp")


def fsync_path(path: str) -> None:
    """Flush a file or a folder (its renames) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb", encoding: str | None = None) -> Iterator[IO[Any]]:
    """Write `path` all at once or not at all: yields a temporary file beside it; when the block ends normally the
    file is flushed, fsynced and renamed over `path`, and the folder fsynced. On any exception (a full disk, a
    second Ctrl-C) the temporary file is removed and `path` keeps its old content.

    Nested blocks for several files rename in the reverse order of opening: open the file that must change
    last (a dataset's meta.json, a run's ckpt.pt) first.
    """
    tmp = temp_path(path)
    try:
        with open(tmp, mode, encoding=encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        interrupt = e.__context__
        while interrupt is not None and not isinstance(interrupt, KeyboardInterrupt):
            interrupt = interrupt.__context__
        if interrupt is not None and not isinstance(e, KeyboardInterrupt):
            # a Ctrl-C / SIGTERM inside the writer, whose own clean-up then failed (torch.save's zip writer:
            # "unexpected pos"): the interrupt is what happened, and the command exits as interrupted
            raise interrupt from None
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_bytes(path: str, data: bytes, what: str = "the folder") -> None:
    """atomic_write of bytes; a failed write is a UserError naming the file (`what`: where to free space)."""
    try:
        with atomic_write(path) as fh:
            fh.write(data)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}; check {what} and its free space") from None


DOWNLOAD_TIMEOUT_S = 60


def download(url: str, dest: str, offline_hint: str) -> None:
    """Fetch `url` into `dest` through atomic_write: an interrupted download never takes `dest`'s name.
    Failures are a UserError that ends with `offline_hint` (the option that takes a local copy instead)."""
    folder = os.path.dirname(os.path.abspath(dest))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the folder {folder} ({e.strerror}); {offline_hint}") from None
    log(f"downloading {url} to {dest}")
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response, atomic_write(dest) as fh:
            while chunk := response.read(1 << 20):
                fh.write(chunk)
    except (OSError, ValueError) as e:  # URLError, HTTPError, timeouts and disk errors are all OSErrors
        reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or e
        raise UserError(f"could not download {url} ({reason}). Offline? {offline_hint}") from None


_TMP = re.compile(r"\..+\.(\d+)\.tmp")  # files.atomic_write's temporary files: .<name>.<pid>.tmp


def remove_stale_temporaries(folder: str) -> list[str]:
    """Delete the temporary files (checkpoints, config.json, metrics) of writers killed mid-write: their process
    is gone."""
    removed = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = _TMP.fullmatch(name)
        if not match or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, name))
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def has_checkpoint(out_dir: str) -> bool:
    """Whether out_dir holds a checkpoint file (ckpt.pt, ckpt_best.pt or a step checkpoint), readable or not: with
    --resume=auto such a folder is continued, never started over."""
    if not os.path.isdir(out_dir):
        return False
    return any(name in (CKPT, BEST_CKPT) or STEP_FILE.fullmatch(name) for name in os.listdir(out_dir))

"""Checkpoint files: atomic writes, safe reads (weights_only), rotation of step checkpoints, stale temporaries, and
the fallback a resume takes past a damaged file. What goes into a checkpoint besides the weights is
train/runstate.py's; the model a command loads, weights/load.py's. The keys: docs/ARCHITECTURE.md "Files"."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Sequence
from typing import Any

import torch

from gptforge.core.errors import UserError
from gptforge.core.files import BEST_CKPT, CKPT, STEP_FILE, atomic_write, step_checkpoint_name  # noqa: F401  (re-exported)
from gptforge.core.shape import saved_model_args

FORMAT_VERSION = 1
_PREFIXES = ("_orig_mod.", "module.")  # added by torch.compile and by DDP wrappers


def save_checkpoint(path: str, state: dict[str, Any], copies: Sequence[str] = ()) -> None:
    """Write `state` to `path` atomically (files.atomic_write). `copies` (the best or a step checkpoint, in the
    same folder) get the same bytes, each written the same way and renamed before `path` itself is replaced,
    so a crash at any moment leaves every name either old or new. One serialization for all of them."""
    try:
        with atomic_write(path) as fh:
            torch.save(state, fh)
            fh.flush()
            for copy in copies:
                with open(fh.name, "rb") as src, atomic_write(copy) as out:
                    shutil.copyfileobj(src, out)
    except BaseException as e:  # atomic_write removed every temporary file; say what went wrong
        cause = e  # torch.save reports a failed write as a RuntimeError raised from the OSError
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise  # not the disk's fault: a bug (or a second Ctrl-C) to see in full
        raise UserError(
            f"cannot write checkpoint {path}: {cause.strerror}; the previous checkpoint is intact. Free "
            "disk space (or choose another --out_dir) and continue with --init_from=resume"
        ) from None


def step_checkpoints(folder: str) -> list[tuple[int, str]]:
    """(step, path) of the step checkpoints model_NNNNN.pt in `folder`, oldest first."""
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = STEP_FILE.fullmatch(name)
        if match:
            found.append((int(match.group(1)), os.path.join(folder, name)))
    return sorted(found)


def rotate_step_checkpoints(folder: str, keep_last: int) -> list[str]:
    """Keep the newest `keep_last` step checkpoints (0 = all); returns the paths deleted."""
    found = step_checkpoints(folder)
    old = [path for _, path in found[:-keep_last]] if keep_last > 0 else []
    for path in old:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return old


def load_resumable(
    out_dir: str, map_location: str | torch.device = "cpu", newest: bool = False
) -> tuple[dict[str, Any], str, list[str]]:
    """The checkpoint to resume from: ckpt.pt, or when it is missing or unreadable the newest readable of the
    step checkpoints and ckpt_best.pt (by the step stored in them). With `newest` (--resume=auto) a step
    checkpoint newer than a readable ckpt.pt wins over it. Returns (checkpoint, path, problems), where problems
    describe the files passed over; a clear error when none can be read."""
    main = os.path.join(out_dir, CKPT)
    problems: list[str] = []
    readable = []
    if not (newest and not os.path.isfile(main)):  # --resume=auto does not call a missing ckpt.pt a problem
        try:
            ckpt = load_checkpoint(main, map_location)
            if not newest:
                return ckpt, main, problems
            readable.append((int(ckpt.get("iter_num", 0)), main, ckpt))
        except UserError as e:
            problems.append(str(e))
    # model_N.pt holds iteration N; one written before gptforge named the last by the step taken holds N + 1
    after = readable[0][0] if readable else -1
    groups = [[path for step, path in reversed(step_checkpoints(out_dir)) if step + 1 > after]]
    groups += [[os.path.join(out_dir, BEST_CKPT)]] if not readable else []  # the best is never newer than ckpt.pt
    for group in groups:
        for path in filter(os.path.isfile, group):  # newest first: the first readable one of a group wins
            try:
                ckpt = load_checkpoint(path, map_location)
            except UserError as e:
                problems.append(str(e))
                continue
            readable.append((int(ckpt.get("iter_num", 0)), path, ckpt))
            break
    if not readable:
        advice = (
            "move these files away (or choose another --out_dir) to start a new run"
            if newest  # --resume=auto would find them again
            else "start again with --init_from=scratch"
        )
        found = " / ".join(problems) + "; no other readable checkpoint" if problems else "no checkpoint"
        raise UserError(f"{found} in {out_dir}: {advice}")
    _, path, ckpt = max(readable, key=lambda r: r[0])  # ckpt.pt, first, wins a tie
    return ckpt, path, problems


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with weights_only=True; every failure is a clear error naming the file."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} not found; train first, or point --out_dir at a run folder")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, KeyError... for unreadable files
        text = str(e)
        if "Unsupported global" in text or "GLOBAL " in text:  # the pickle names a class or function to call
            raise UserError(
                f"cannot read checkpoint {path}: it holds pickled objects other than tensors and plain "
                "data, and such files can run code; it was not loaded"
            ) from None
        # torch's own advice (load with weights_only=False) is exactly what must not be done with a stranger's file
        lines = [x.strip() for x in text.splitlines() if x.strip() and not re.search("eights.only", x)]
        detail = f"{type(e).__name__}: {lines[0].split('. ')[0][:160]}" if lines else type(e).__name__
        raise UserError(
            f"cannot read checkpoint {path}: the file is truncated, damaged or not a checkpoint "
            f"({detail}); point --out_dir or --ckpt at an intact one, or train again"
        ) from None
    if not isinstance(ckpt, dict) or not {"model", "model_args"} <= set(ckpt):
        raise UserError(f"{path} is not a gptforge or nanoGPT checkpoint (no 'model' and 'model_args' keys)")
    ckpt["model"] = clean_state_dict(ckpt["model"])
    return ckpt


def checkpoint_model_args(ckpt: dict[str, Any], path: str) -> dict[str, Any]:
    """A checkpoint's model_args completed (shape.saved_model_args): a nanoGPT checkpoint (no format_version) as
    nanoGPT's model computes (exact GELU), an older gptforge one as gptforge's did then (tanh GELU)."""
    try:
        return saved_model_args(ckpt["model_args"], nanogpt="format_version" not in ckpt)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip torch.compile / DDP prefixes and drop the causal-mask buffers older nanoGPT versions saved."""
    out = {}
    for key, value in state.items():
        while key.startswith(_PREFIXES):  # in any order and nesting: DDP(compile(model)) gives both
            key = key.split(".", 1)[1]
        if key.endswith((".attn.bias", ".attn.masked_bias")) and value.dim() == 4:
            continue  # a (1, 1, T, T) mask buffer, not a parameter
        out[key] = value
    return out


def checkpoint_path(out_dir: str, ckpt: str | None = None) -> str:
    """The checkpoint file to read: `ckpt` (--ckpt, e.g. out/model_05000.pt) when given, else <out_dir>/ckpt.pt."""
    if not ckpt:
        return os.path.join(out_dir, CKPT)
    if os.path.isdir(ckpt):
        raise UserError(
            f"--ckpt={ckpt} is a folder: --ckpt names a checkpoint file (such as "
            f"{os.path.join(ckpt, CKPT)}); a run folder goes to --out_dir"
        )
    if not os.path.isfile(ckpt):
        raise UserError(f"--ckpt={ckpt}: no such checkpoint file (a run's {CKPT}, or a step checkpoint model_NNNNN.pt)")
    return ckpt

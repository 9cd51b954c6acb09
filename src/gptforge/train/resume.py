"""Resuming a run with its own settings: the run's saved config.json is the base, the options given again on the
command line change it where that makes sense (never the model's shape), and each change is named. README
"Interruptions, crashes and bad steps" has the rules."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Sequence
from typing import Any

from gptforge.core.config import FIELDS, MODEL_SWITCHES, TrainConfig, coerce, load_config
from gptforge.core.errors import UserError
from gptforge.core.files import BEST_CKPT, CKPT, CONFIG, STEP_FILE

SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", *MODEL_SWITCHES)  # a checkpoint's weights fix these
NOT_CHANGES = ("init_from", "resume")  # a resumed run's init_from is 'resume', whatever started it


def load_run_config(args: Sequence[str]) -> TrainConfig:
    """load_config, except that when the run continues (--init_from=resume, or --resume=auto with a checkpoint in
    out_dir) the run's saved settings stand in for the defaults: a bare `--out_dir=X --init_from=resume` continues
    the run as it was started, and nanoGPT's habit (the same full command again) changes nothing. A run folder
    without config.json (nanoGPT's) takes the command line alone. --resume=auto with no checkpoint gives a new run
    as init_from says."""
    cfg = load_config(args)
    if cfg.init_from != "resume" and not (cfg.resume == "auto" and has_checkpoint(cfg.out_dir)):
        return cfg
    saved = saved_config(cfg.out_dir)
    if saved is None:
        return dataclasses.replace(cfg, init_from="resume")
    resumed = load_config(args, base=saved)
    for key in SHAPE_KEYS:
        if getattr(resumed, key) != getattr(saved, key):
            raise UserError(
                f"--{key}={getattr(resumed, key)}: the run in {cfg.out_dir} has {key}={getattr(saved, key)!r}, and a "
                f"resumed model keeps its shape. Leave --{key} out to continue it, or start a new run in another "
                "--out_dir (or fine-tune from its checkpoint there)"
            )
    return dataclasses.replace(resumed, init_from="resume")


def has_checkpoint(out_dir: str) -> bool:
    """Whether out_dir holds a checkpoint file (ckpt.pt, ckpt_best.pt or a step checkpoint), readable or not: with
    --resume=auto such a folder is continued, never started over."""
    if not os.path.isdir(out_dir):
        return False
    return any(name in (CKPT, BEST_CKPT) or STEP_FILE.fullmatch(name) for name in os.listdir(out_dir))


def saved_config(out_dir: str) -> TrainConfig | None:
    """The settings <out_dir>/config.json records (as train resolved them), or None when there is none."""
    path = os.path.join(out_dir, CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{path}: not readable JSON ({e}); restore it, or give the run's settings on the command "
            "line after moving it away"
        ) from None
    if not isinstance(saved, dict):
        raise UserError(f"{path}: not a run's config.json (a JSON object of settings)")
    values = {k: coerce(k, v, path, from_text=False) for k, v in saved.items() if k in FIELDS}
    return dataclasses.replace(TrainConfig(), **values)


def resume_changes(cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """{key: (the run's value, this start's value)} for every setting a resume changes."""
    saved = saved_config(cfg.out_dir)
    if saved is None:
        return {}
    return {
        k: (getattr(saved, k), getattr(cfg, k))
        for k in FIELDS
        if k not in NOT_CHANGES and getattr(saved, k) != getattr(cfg, k)
    }


def continue_command(out_dir: str, world_size: int) -> str:
    """The command that continues a stopped run (its settings come from its config.json)."""
    args = f"train --out_dir={shlex.quote(out_dir)} --init_from=resume"
    if world_size == 1:
        return f"gptforge {args}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # torchrun's processes on this node
    launcher = "--standalone" if local == world_size else "<the same --nnodes and rendezvous options>"
    return f"torchrun {launcher} --nproc_per_node={local} -m gptforge {args}"

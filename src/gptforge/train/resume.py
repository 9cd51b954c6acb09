"""A resumed run's settings: when the run continues (--init_from=resume, or --resume=auto with a checkpoint in
out_dir) its saved config.json is the base, the options given again change it where that makes sense (never the
model's shape), and each change is named when it resumes (train/start.py). Also the command that continues a
stopped run. README "Interruptions, crashes and bad steps" has the rules."""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Sequence

from gptforge.core.config import TrainConfig, load_config, saved_config
from gptforge.core.errors import UserError
from gptforge.core.files import has_checkpoint
from gptforge.core.shape import SHAPE_KEYS  # a checkpoint's weights fix these


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


def continue_command(out_dir: str, world_size: int) -> str:
    """The command that continues a stopped run (its settings come from its config.json)."""
    args = f"train --out_dir={shlex.quote(out_dir)} --init_from=resume"
    if world_size == 1:
        return f"gptforge {args}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # torchrun's processes on this node
    launcher = "--standalone" if local == world_size else "<the same --nnodes and rendezvous options>"
    return f"torchrun {launcher} --nproc_per_node={local} -m gptforge {args}"

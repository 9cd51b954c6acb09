"""A training run's checkpoints: which files to write at a step (`saves_at`, a pure function) and writing them
(`Checkpointer`: every rank's state gathered, rank 0 writes). Files and keys: docs/ARCHITECTURE.md "Files"."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gptforge.core.config import TrainConfig
from gptforge.core.distributed import DistEnv
from gptforge.core.files import BEST_CKPT, CKPT, step_checkpoint_name
from gptforge.train.runstate import capture
from gptforge.weights.checkpoint import FORMAT_VERSION, rotate_step_checkpoints, save_checkpoint


@dataclass(frozen=True)
class Save:
    """The files one checkpoint goes to: ckpt.pt (`latest`), ckpt_best.pt (`best`), model_{step_file:05d}.pt."""

    latest: bool
    best: bool
    step_file: int | None
    reason: str  # for the log line


def saves_at(
    step: int,
    *,
    start_step: int,
    max_iters: int,
    eval_only: bool,
    always_save: bool,
    ckpt_interval: int,
    evaluated: bool,
    improved: bool,
    stop: bool,
) -> Save | None:
    """What to write at the head of step `step` (the state after `step` updates, evaluated or not), or nothing.

    - eval_only runs write nothing.
    - A stop request (SIGINT / SIGTERM) writes ckpt.pt, last step included: the run ends here.
    - The state a run resumed from (start_step) is on disk already: not written again.
    - ckpt.pt after an evaluation that improved val loss, or after every one with always_save; ckpt_best.pt
      when it improved.
    - model_{step:05d}.pt every ckpt_interval steps and at the last step; the number is always the iteration
      the checkpoint holds and resumes from (a 19,073-step run ends with
      model_19073.pt; build-nanogpt, and gptforge before, named that one model_19072.pt, and such files are still
      read: load_resumable goes by the iteration stored inside).
    """
    last = step >= max_iters
    if eval_only:
        return None
    if stop:
        return Save(latest=True, best=False, step_file=None, reason="stop requested")
    if step <= start_step:
        return None
    latest = evaluated and (improved or always_save)
    step_file = step if ckpt_interval > 0 and (step % ckpt_interval == 0 or last) else None
    if not latest and step_file is None:
        return None
    reason = "val loss improved" if improved else "always_save_checkpoint" if latest else "ckpt_interval"
    return Save(latest=latest, best=improved, step_file=step_file, reason=reason)


class Checkpointer:
    """A run's checkpoints: at each step it asks saves_at what to write and writes it, one serialization copied to
    each file. It holds the parts of the run that never change; the counters come with each call."""

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        start_step: int,
        fixed: dict[str, Any],
        log: Callable[[str], None],
    ):
        """model: the GPT itself (sharded under FSDP), never a compile or DDP wrapper. start_step: where this
        process began (a resume's state is on disk already). fixed: what every checkpoint of the run holds alike:
        model_args, tokenizer, wandb_run_id."""
        self.cfg, self.env, self.fsdp, self.log = cfg, env, env.fsdp(cfg.parallel), log
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.start_step = start_step
        self.fixed = {**fixed, "config": dataclasses.asdict(cfg)}

    def at_step(
        self, step: int, evaluated: bool, improved: bool, stop: bool, best_val_loss: float, data_state: dict[str, Any]
    ) -> Save | None:
        """Write what this step needs, if anything (every rank calls: the states are gathered; rank 0 writes)."""
        cfg = self.cfg
        save = saves_at(
            step,
            start_step=self.start_step,
            max_iters=cfg.max_iters,
            eval_only=cfg.eval_only,
            always_save=cfg.always_save_checkpoint,
            ckpt_interval=cfg.ckpt_interval,
            evaluated=evaluated,
            improved=improved,
            stop=stop,
        )
        if save is not None:
            self.write(save, step, best_val_loss, data_state)
        return save

    def write(self, save: Save, iter_num: int, best_val_loss: float, data_state: dict[str, Any]) -> None:
        state = capture(self.model, self.optimizer, self.scaler, self.fsdp, self.env, data_state)
        if not self.env.is_main:
            return
        names = [CKPT] if save.latest else []
        names += [BEST_CKPT] if save.best else []
        names += [step_checkpoint_name(save.step_file)] if save.step_file is not None else []
        paths = [os.path.join(self.cfg.out_dir, name) for name in names]
        state = {  # docs/ARCHITECTURE.md "Files": nanoGPT's keys (model, optimizer, model_args, iter_num,
            **state,  # best_val_loss, config) and ours
            **self.fixed,
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
            "format_version": FORMAT_VERSION,
        }
        save_checkpoint(paths[0], state, copies=paths[1:])
        if save.step_file is not None:
            rotate_step_checkpoints(self.cfg.out_dir, self.cfg.keep_last)
        self.log(f"saved checkpoint {', '.join(names)} in {self.cfg.out_dir} at iter {iter_num} ({save.reason})")

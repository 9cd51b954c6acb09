"""`gptforge train`: nanoGPT's train.py as a function of a TrainConfig, set up once (`setup`), then one loop
(`train_loop`) with its learning-rate schedule (`get_lr`). On the README CPU recipe expect val loss ~1.88 after
2000 steps. docs/ARCHITECTURE.md has the loop's outline; SIGINT / SIGTERM finish the current step, write a
checkpoint and return."""

from __future__ import annotations

import functools
import math
import time
import traceback
from typing import Any

import torch

from gptforge.core.config import LR_SCHEDULES, TrainConfig
from gptforge.core.distributed import (
    DistEnv,
    StopFlag,
    all_reduce_mean,
    setup_distributed,
    step_is_finite,
    teardown,
)
from gptforge.core.errors import UserError
from gptforge.evaluate.loss import estimate_chat_loss, estimate_loss
from gptforge.model.optim import accumulate_gradients
from gptforge.train.metrics import StepTimer
from gptforge.train.resume import continue_command
from gptforge.train.setup import Run, setup


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as configured; returns {'iter_num', 'best_val_loss', 'losses'} (the last evaluation)."""
    env = setup_distributed(cfg.device, cfg.backend)
    try:
        return _train(cfg, env)  # the run (its DDP wrapper) is gone when this returns, before the group is
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # and when it raises: its frames would keep it (core/distributed.py)
        raise
    finally:
        teardown(env)


def _train(cfg: TrainConfig, env: DistEnv) -> dict[str, Any]:
    run = setup(cfg, env)
    if run is None:  # it resumes a finished run (a requeued job): nothing to train, nothing written
        return {"iter_num": cfg.max_iters, "best_val_loss": math.nan, "losses": {}}
    with StopFlag(env) as stop, run.cleanup:
        result = train_loop(run, stop)
    if env.ddp:  # leave together: no rank tears its process group down while rank 0 still writes files
        torch.distributed.barrier()
    return result


def train_loop(run: Run, stop: StopFlag) -> dict[str, Any]:
    """At the head of each step the once-in-a-while work (evaluate, save, HellaSwag, samples, stop), then one
    training step and its log line. Step N's head sees the state after N updates."""
    cfg, metrics = run.cfg, run.metrics
    losses: dict[str, float] = {}
    mfu = functools.partial(run.raw_model.estimate_mfu, cfg.batch_size * run.accum, peak_flops=run.peak_flops)
    timer = StepTimer(cfg.max_iters, run.tokens_per_iter, mfu)
    while True:
        step, last = run.iter_num, run.iter_num >= cfg.max_iters
        lr = apply_lr(run, step)
        # --- once in a while -----------------------------------------------------------------------------------
        evaluated = improved = False
        if not stop.requested and (due(step, cfg.eval_interval, last) or cfg.eval_only):
            losses = evaluate(run)
            bpb = {k: v for k, v in losses.items() if k.endswith("_bpb")}  # train_bpb, val_bpb
            metrics.log(step, "eval", train_loss=losses["train"], val_loss=losses["val"], **bpb, lr=lr)
            evaluated, improved = True, losses["val"] < run.best_val_loss
            run.best_val_loss = min(run.best_val_loss, losses["val"])
        run.checkpointer.at_step(step, evaluated, improved, stop.requested, run.best_val_loss, run.data_state)
        if not stop.requested and run.hellaswag is not None and due(step, cfg.hellaswag_interval, last):
            hs = run.hellaswag(run.raw_model, ctx=run.ctx)  # uncompiled: every batch has another shape
            metrics.log(step, "hellaswag", acc=hs["acc"], acc_norm=hs["acc_norm"], n=hs["n"])
        if evaluated and run.chat_tasks is not None:
            metrics.log(step, "chat", **run.chat_tasks(run.raw_model, ctx=run.ctx))
        if not stop.requested and run.sampler and due(step, cfg.sample_interval, last) and (step > 0 or last):
            metrics.log_samples(step, run.sampler.text, run.sampler.sample(run.raw_model, run.ctx))
        if last or cfg.eval_only:
            if last and not cfg.eval_only:
                metrics.log(step, "end", reason="max_iters reached")  # the dashboard reads: finished
            break
        if stop.requested:
            metrics.info(f"stopped at iter {step}; continue with: {continue_command(cfg.out_dir, run.env.world_size)}")
            break
        # --- one training step ---------------------------------------------------------------------------------
        t0 = time.perf_counter()
        loss, grad_norm, finite = train_step(run)
        share = (run.rows(step) or cfg.batch_size) / cfg.batch_size  # of the tokens and FLOPs of a whole step
        if finite and step % cfg.log_interval == 0:
            lossf, normf = torch.stack([all_reduce_mean(loss, run.env), grad_norm.float()]).tolist()  # host sync
            timer.add(time.perf_counter() - t0, share)
            metrics.log(step, "train", loss=lossf, lr=lr, grad_norm=normf, **timer.report(step))
        else:
            timer.add(time.perf_counter() - t0, share)
        run.iter_num += 1
        stop.sync()
    return {"iter_num": run.iter_num, "best_val_loss": run.best_val_loss, "losses": losses}


def train_step(run: Run) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One optimizer step: gradients summed over the micro-batches, unscaled, clipped, and applied only when the
    loss and the gradient norm are finite on every rank. Returns (mean loss, gradient norm, applied). A step not
    applied is recorded ("skip": weights and optimizer state untouched); max_bad_steps of them in a row stop the run.

    Host syncs: one every step (the finiteness check); a logged step reads the loss and norm in one more; under
    DDP the stop flag's all-reduce is another.
    """
    loss, run.batch, run.data_state = accumulate_gradients(
        run.model, run.batch, run.batches, run.accum, run.ctx, run.scaler, run.sync, run.rows(run.iter_num)
    )
    run.scaler.unscale_(run.optimizer)  # clip and check the true gradients, not the loss-scaled ones
    # measured even without clipping (an infinite max_norm scales by exactly 1): the NaN guard reads it
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.cfg.grad_clip or math.inf)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: a DTensor
    finite = step_is_finite(loss, grad_norm, run.scaler.is_enabled(), run.env)
    if finite:
        run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.bad_steps = 0 if finite else run.bad_steps + 1
    if finite:
        return loss, grad_norm, finite
    cfg, step = run.cfg, run.iter_num
    loss_value = all_reduce_mean(loss, run.env).item()
    run.metrics.log(
        step,
        "skip",
        loss=loss_value,
        grad_norm=float(grad_norm),
        in_a_row=run.bad_steps,
        max_bad_steps=cfg.max_bad_steps,
    )
    if run.bad_steps >= cfg.max_bad_steps:
        raise UserError(
            f"iter {step}: the loss or gradient norm was not finite {run.bad_steps} steps in a row "
            f"(--max_bad_steps={cfg.max_bad_steps}); they were skipped and the run stops here. The last "
            f"good checkpoint is intact in {cfg.out_dir}: try a lower --learning_rate, --grad_clip, or "
            "dtype float32 / bfloat16 before continuing with --init_from=resume"
        )
    return loss, grad_norm, finite


def apply_lr(run: Run, step: int) -> float:
    """Set the schedule's learning rate for `step` on every group (optimizer='muon': its matrices at muon_lr's
    scale); returns it."""
    lr = learning_rate(run.cfg, step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr


def learning_rate(cfg: TrainConfig, step: int) -> float:
    return get_lr(
        step,
        cfg.learning_rate,
        cfg.warmup_iters,
        cfg.lr_decay_iters,
        cfg.min_lr,
        cfg.decay_lr,
        cfg.lr_schedule,
        cfg.decay_frac,
    )


def get_lr(
    it: int,
    learning_rate: float,
    warmup_iters: int,
    lr_decay_iters: int,
    min_lr: float,
    decay_lr: bool = True,
    schedule: str = "cosine",
    decay_frac: float = 0.2,
) -> float:
    """Learning rate at optimizer step `it`: linear warmup, then `schedule`; min_lr from lr_decay_iters on.

    Warmup (every schedule) reaches learning_rate * warmup_iters / (warmup_iters + 1) at its last step, never 0
    at step 0. Then, until lr_decay_iters:
      cosine    nanoGPT's: from learning_rate down to min_lr along half a cosine
      linear    from learning_rate down to min_lr in a straight line
      constant  learning_rate (also after lr_decay_iters: min_lr is not used)
      wsd       warmup-stable-decay: learning_rate until step max(warmup_iters, (1 - decay_frac) * lr_decay_iters),
                then a straight line down to min_lr (decay_frac 1 is `linear`; 0 drops to min_lr at lr_decay_iters)
    decay_lr=False is nanoGPT's constant learning_rate from step 0, whatever the schedule.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {LR_SCHEDULES}")
    if not 0.0 <= decay_frac <= 1.0:
        raise ValueError(f"decay_frac must be in [0, 1], got {decay_frac}")
    if not decay_lr:
        return learning_rate
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if schedule == "constant":
        return learning_rate
    if it >= lr_decay_iters:
        return min_lr
    start = warmup_iters  # where the decay starts; before it, the peak
    if schedule == "wsd":
        start = max(warmup_iters, (1.0 - decay_frac) * lr_decay_iters)
        if it < start:
            return learning_rate
    ratio = (it - start) / (lr_decay_iters - start)  # 0 -> 1 across the decay; start <= it < lr_decay_iters
    if schedule == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    else:  # linear, and wsd's decay
        coeff = 1.0 - ratio
    return min_lr + coeff * (learning_rate - min_lr)


def due(step: int, interval: int, last: bool) -> bool:
    """Every `interval` steps (0 = never) and at the last step."""
    return interval > 0 and (step % interval == 0 or last)


def evaluate(run: Run) -> dict[str, float]:
    """Mean loss per split over eval_iters batches, over the ranks (a chat dataset: over its trained targets), and
    each split's bits per byte (`train_bpb`, `val_bpb`)."""
    mean = functools.partial(all_reduce_mean, env=run.env) if run.env.ddp else None
    if run.cfg.data_loader == "chat":
        summed = (lambda t: mean(t) * run.env.world_size) if mean else None  # the ranks' sums
        return estimate_chat_loss(run.model, run.eval_batches(), run.eval_iters, run.ctx, reduce=summed)
    return estimate_loss(
        run.model, run.eval_batches(), run.eval_iters, run.ctx, reduce=mean, token_bytes=run.token_bytes
    )

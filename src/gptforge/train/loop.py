"""`gptforge train`: nanoGPT's train.py as a function of a TrainConfig, set up once (`setup`), then one loop
(`train_loop`). On the README CPU recipe expect val loss ~1.88 after 2000 steps. docs/ARCHITECTURE.md has the
loop's outline; SIGINT / SIGTERM finish the current step, write a checkpoint and return."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gptforge.core.allocator import keep_freed_memory
from gptforge.core.config import TrainConfig
from gptforge.core.device import autocast_context, configure_backends, peak_flops
from gptforge.core.distributed import DistEnv, StopFlag, all_reduce_mean, setup_distributed, step_is_finite, teardown
from gptforge.core.errors import UserError
from gptforge.data.loader import Batches, dataset_dir, read_meta
from gptforge.evaluate.loss import estimate_loss
from gptforge.infer.sample import Sampler
from gptforge.model.gpt import GPT
from gptforge.model.optim import accumulate_gradients, configure_optimizer, get_lr, muon_settings
from gptforge.tokenizer.spec import tokenizer_spec
from gptforge.train.checkpointer import Checkpointer
from gptforge.train.metrics import Metrics
from gptforge.train.resume import continue_command
from gptforge.train.setup import (
    build_model,
    compile_and_wrap,
    gradient_sync,
    hellaswag_task,
    memory_estimate,
    open_batches,
    open_sinks,
    place_model,
    prepare_out_dir,
    resolve_config,
    restore,
    resume_checkpoint,
)


@dataclass
class Run:
    """What the loop works with: built by setup(), advanced by train_step() and the loop's counters."""

    cfg: TrainConfig  # resolved: no 'auto' left; never changed once training starts
    env: DistEnv
    model: torch.nn.Module  # what the training step calls: compiled and / or DDP-wrapped
    raw_model: GPT  # the GPT itself: evaluation of varying shapes, samples, checkpoints, MFU
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    batches: Batches  # the training batches
    eval_batches: Callable[[], dict[str, Batches]]  # the loaders of one evaluation, by split
    eval_iters: int  # batches per split and rank of one evaluation
    hellaswag: Callable[..., dict[str, Any]] | None  # scores a model on the loaded examples
    sampler: Sampler | None
    metrics: Metrics
    checkpointer: Checkpointer
    peak_flops: float  # what MFU is measured against (rank 0)
    cleanup: contextlib.ExitStack  # closes the metrics sinks, stops the dashboard
    X: torch.Tensor | None = None  # the next step's first micro-batch
    Y: torch.Tensor | None = None
    data_state: dict[str, Any] | None = None  # the loader state that yields X, Y: what a resume restores
    iter_num: int = 0
    best_val_loss: float = math.inf
    # derived from the above in __post_init__
    ctx: contextlib.AbstractContextManager = field(init=False)  # autocast, or nothing for float32
    accum: int = field(init=False)  # micro-batches per step on this rank
    sync: Callable[[bool], None] | None = field(init=False)  # gradient all-reduce on the last micro-batch only

    def __post_init__(self) -> None:
        self.ctx = autocast_context(self.env.device_type, self.cfg.dtype)
        self.accum = self.cfg.gradient_accumulation_steps // self.env.world_size
        fsdp = self.env.ddp and self.cfg.parallel == "fsdp"
        self.sync = gradient_sync(self.model, self.raw_model, self.env, fsdp)

    @property
    def tokens_per_iter(self) -> int:
        return self.accum * self.env.world_size * self.cfg.batch_size * self.cfg.block_size


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as configured; returns {'iter_num', 'best_val_loss', 'losses'} (the last evaluation)."""
    env = setup_distributed(cfg.device, cfg.backend)
    try:
        run = setup(cfg, env)
        with StopFlag(env) as stop, run.cleanup:
            if run.cfg.resume == "auto" and run.cfg.init_from == "resume" and run.iter_num >= run.cfg.max_iters:
                run.metrics.info(  # a requeued job whose run had finished: nothing to train, nothing to write
                    f"resume=auto: the run in {run.cfg.out_dir} is finished (iter {run.iter_num} of max_iters "
                    f"{run.cfg.max_iters}); nothing to do"
                )
                return {"iter_num": run.iter_num, "best_val_loss": run.best_val_loss, "losses": {}}
            result = train_loop(run, stop)
        if env.ddp:  # leave together: no rank tears its process group down while rank 0 still writes files
            torch.distributed.barrier()
        return result
    finally:
        teardown(env)


def train_loop(run: Run, stop: StopFlag) -> dict[str, Any]:
    """At the head of each step the once-in-a-while work (evaluate, save, HellaSwag, samples, stop), then one
    training step and its log line. Step N's head sees the state after N updates."""
    cfg, metrics = run.cfg, run.metrics
    losses: dict[str, float] = {}
    timer, bad_steps = StepTimer(), 0
    while True:
        step, last = run.iter_num, run.iter_num >= cfg.max_iters
        lr = apply_lr(run, step)
        # --- once in a while -----------------------------------------------------------------------------------
        evaluated = improved = False
        if not stop.requested and (due(step, cfg.eval_interval, last) or cfg.eval_only):
            losses = evaluate(run)
            metrics.log(step, "eval", train_loss=losses["train"], val_loss=losses["val"], lr=lr)
            evaluated, improved = True, losses["val"] < run.best_val_loss
            run.best_val_loss = min(run.best_val_loss, losses["val"])
        run.checkpointer.at_step(step, evaluated, improved, stop.requested, run.best_val_loss, run.data_state)
        if not stop.requested and run.hellaswag is not None and due(step, cfg.hellaswag_interval, last):
            hs = run.hellaswag(run.raw_model, ctx=run.ctx)  # uncompiled: every batch has another shape
            metrics.log(step, "hellaswag", acc=hs["acc"], acc_norm=hs["acc_norm"], n=hs["n"])
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
        bad_steps = 0 if finite else bad_steps + 1
        if not finite:
            skip_step(run, step, loss, grad_norm, bad_steps)
            timer.add(time.perf_counter() - t0)
        elif step % cfg.log_interval == 0:
            lossf, normf = torch.stack([all_reduce_mean(loss, run.env), grad_norm.float()]).tolist()  # host sync
            timer.add(time.perf_counter() - t0)
            metrics.log(step, "train", loss=lossf, lr=lr, grad_norm=normf, **timer.report(run, step))
        else:
            timer.add(time.perf_counter() - t0)
        run.iter_num += 1
        stop.sync()
    return {"iter_num": run.iter_num, "best_val_loss": run.best_val_loss, "losses": losses}


def train_step(run: Run) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One optimizer step: gradients summed over the micro-batches, unscaled, clipped, and applied only when the
    loss and the gradient norm are finite on every rank. Returns (mean loss, gradient norm, applied).

    Host syncs: one every step (the finiteness check); a logged step reads the loss and norm in one more; under
    DDP the stop flag's all-reduce is another.
    """
    loss, run.X, run.Y, run.data_state = accumulate_gradients(
        run.model, run.X, run.Y, run.batches, run.accum, run.ctx, run.scaler, run.sync
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
    return loss, grad_norm, finite


def skip_step(run: Run, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, in_a_row: int) -> None:
    """Record a step whose update was skipped (weights and optimizer state untouched); too many in a row stop."""
    cfg = run.cfg
    run.metrics.log(
        step,
        "skip",
        loss=all_reduce_mean(loss, run.env).item(),
        grad_norm=float(grad_norm),
        in_a_row=in_a_row,
        max_bad_steps=cfg.max_bad_steps,
    )
    if in_a_row >= cfg.max_bad_steps:
        raise UserError(
            f"iter {step}: the loss or gradient norm was not finite {in_a_row} steps in a row "
            f"(--max_bad_steps={cfg.max_bad_steps}); they were skipped and the run stops here. The last "
            f"good checkpoint is intact in {cfg.out_dir}: try a lower --learning_rate, --grad_clip, or "
            "dtype float32 / bfloat16 before continuing with --init_from=resume"
        )


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


def due(step: int, interval: int, last: bool) -> bool:
    """Every `interval` steps (0 = never) and at the last step."""
    return interval > 0 and (step % interval == 0 or last)


def evaluate(run: Run) -> dict[str, float]:
    """Mean loss per split over eval_iters batches, averaged over the ranks."""
    reduce = functools.partial(all_reduce_mean, env=run.env) if run.env.ddp else None
    return estimate_loss(run.model, run.eval_batches(), run.eval_iters, run.ctx, reduce=reduce)


class StepTimer:
    """Seconds per step, averaged over the steps since the last log line, with running averages for ETA and MFU."""

    def __init__(self) -> None:
        self.seconds, self.steps, self.ema_dt, self.mfu = 0.0, 0, None, None
        self.warming_up = True

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1

    def report(self, run: Run, step: int) -> dict[str, Any]:
        dt, steps = self.seconds / self.steps, self.steps
        self.seconds, self.steps = 0.0, 0
        settled = step >= 5  # the first steps include compilation and warm-up
        if self.warming_up:  # they would hold the ETA up for long and drag the MFU down
            self.ema_dt = dt
        else:
            keep = 0.9**steps  # the same average per step whatever log_interval is
            self.ema_dt = keep * self.ema_dt + (1 - keep) * dt
        self.warming_up = not settled
        if settled:
            mfu = run.raw_model.estimate_mfu(run.cfg.batch_size * run.accum, dt, run.peak_flops)
            self.mfu = mfu if self.mfu is None else 0.9 * self.mfu + 0.1 * mfu
        return {
            "ms_per_iter": dt * 1000,
            "tokens_per_s": run.tokens_per_iter / dt,
            "mfu": self.mfu,
            "eta_s": self.ema_dt * (run.cfg.max_iters - step - 1),
        }


def setup(cfg: TrainConfig, env: DistEnv) -> Run:
    """Build the run: data, model (new, resumed or GPT-2's), optimizer, batches, evaluators, sinks. Every input is
    checked before anything is written to out_dir, so a mistake leaves the run folder as it was."""
    if cfg.gradient_accumulation_steps % env.world_size:
        raise UserError(
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} (micro-batches per step over all "
            f"processes) does not divide across {env.world_size} processes; make it a multiple of {env.world_size}"
        )
    malloc = keep_freed_memory()  # `gptforge` did it at start; a call of train() from Python does it here
    torch.manual_seed(cfg.seed)  # every rank builds the same initial weights (FSDP keeps each rank's shard)
    configure_backends(env.device_type)
    folder = dataset_dir(cfg.data_dir, cfg.dataset)
    meta = read_meta(folder)
    ckpt, source = resume_checkpoint(cfg, env, meta)
    model, model_args = build_model(cfg, env, meta, ckpt, source)
    cfg = resolve_config(cfg, env, meta, model_args)
    model.use_fast_dropout(cfg.fast_dropout)
    if env.rank:
        torch.manual_seed(cfg.seed + env.rank)  # then each rank its own stream: batches and dropout differ
    fsdp = env.ddp and cfg.parallel == "fsdp"
    place_model(model, env.device, fsdp)  # before the optimizer: it must hold the (sharded) parameters
    scaler = torch.amp.GradScaler(env.device_type, enabled=cfg.dtype == "float16")
    optimizer = configure_optimizer(
        model, cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), env.device_type, muon_settings(cfg)
    )
    accum = cfg.gradient_accumulation_steps // env.world_size
    batches, eval_batches, eval_iters = open_batches(cfg, env, folder, meta, model_args["vocab_size"], accum)
    iter_num, best_val_loss = 0, math.inf
    if ckpt is not None:
        iter_num, best_val_loss = restore(ckpt, source, model, optimizer, scaler, batches, env, fsdp, cfg.seed)
    data_state = batches.state_dict()  # the state that yields X, Y below: what a resume must restore
    X, Y = batches.next_batch()  # (its token ids are checked against the vocabulary here, before any write)
    # a sharded model needs every rank in each forward pass, so under FSDP all ranks sample (rank 0 logs)
    sampler = Sampler(cfg, meta, env) if cfg.sample_interval > 0 and (env.is_main or fsdp) else None
    hellaswag = hellaswag_task(cfg, env, meta)
    if env.is_main:  # every input is checked by now
        prepare_out_dir(cfg)
    metrics, cleanup = open_sinks(cfg, env, ckpt)
    checkpointer = Checkpointer(
        cfg,
        env,
        model,
        optimizer,
        scaler,
        fsdp,
        start_step=iter_num,
        log=metrics.info,
        fixed={"model_args": model_args, "tokenizer": tokenizer_spec(meta), "wandb_run_id": metrics.wandb_id},
    )
    wrapped = compile_and_wrap(model, cfg, env, fsdp, metrics)
    # fmt: off
    run = Run(cfg=cfg, env=env, model=wrapped, raw_model=model, optimizer=optimizer, scaler=scaler,
              batches=batches, eval_batches=eval_batches, eval_iters=eval_iters, hellaswag=hellaswag, sampler=sampler,
              metrics=metrics, checkpointer=checkpointer, cleanup=cleanup,
              peak_flops=peak_flops(env.device, cfg.dtype, cfg.peak_flops) if env.is_main else 1.0,
              X=X, Y=Y, data_state=data_state, iter_num=iter_num, best_val_loss=best_val_loss)
    # fmt: on
    metrics.info(
        f"model: {model.get_num_params() / 1e6:.2f}M parameters | device {env.device}, dtype {cfg.dtype}, "
        f"compile {cfg.compile}, {env.world_size} process(es), dropout {cfg.dropout}"
        f"{' (fast masks)' if cfg.fast_dropout and cfg.dropout > 0 else ''}\n"
        f"tokens per iteration: {run.tokens_per_iter:,} = {accum} accumulation x {env.world_size} processes x "
        f"{cfg.batch_size} batch x {cfg.block_size} block\n"
        f"memory: {memory_estimate(cfg, env, model_args).describe()} estimated per process\n"
        f"{malloc}"
    )
    return run

"""`setup(cfg, env) -> Run`: everything a training run needs, built and checked before the first step and before
anything is written to out_dir (so a mistake leaves the run folder as it was): where it starts, the config resolved
once and the model built (train/resolve.py's begin), the model placed and wrapped, the optimizer, the batches, the
evaluators and the sinks; config.json last."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gptforge.core.allocator import keep_freed_memory
from gptforge.core.config import FIELDS, MUON_ONLY, TrainConfig
from gptforge.core.cpu import adopt_rates, cpu_product_rates, half_pays
from gptforge.core.device import autocast_context, device_type, peak_flops, resolve_device
from gptforge.core.distributed import DistEnv, gather
from gptforge.core.errors import UserError
from gptforge.core.shape import SWITCHES
from gptforge.data.loader import Batches, dataset_dir, make_batches, read_meta
from gptforge.evaluate.chat import chat_task
from gptforge.evaluate.hellaswag import hellaswag_task
from gptforge.evaluate.loss import dataset_byte_table
from gptforge.infer.sample import Sampler
from gptforge.model.gpt import GPT
from gptforge.model.optim import MuonSettings, configure_optimizer
from gptforge.tokenizer.spec import tokenizer_spec
from gptforge.train.checkpointer import Checkpointer
from gptforge.train.metrics import Metrics, open_outputs, write_config
from gptforge.train.parallel import compile_and_wrap, gradient_sync, place_model
from gptforge.train.resolve import begin
from gptforge.train.runstate import restore
from gptforge.train.start import Start


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
    chat_tasks: Callable[..., dict[str, Any]] | None  # SFT: held-out synthetic tasks answered greedily
    sampler: Sampler | None
    metrics: Metrics
    checkpointer: Checkpointer
    cleanup: contextlib.ExitStack  # closes the metrics sinks, stops the dashboard
    batch: tuple  # the next step's first micro-batch: (X, Y), or (X, Y, positions, weight) for a chat dataset
    data_state: dict[str, Any]  # the loader state that yields `batch`: what a resume restores
    iter_num: int = 0
    best_val_loss: float = math.inf
    bad_steps: int = 0  # steps skipped in a row (loss or gradient not finite)
    token_bytes: torch.Tensor | None = None  # bytes of text per id: evaluations' bits per byte
    # derived from the above in __post_init__
    peak_flops: float = field(init=False)  # what MFU is measured against (rank 0)
    ctx: contextlib.AbstractContextManager = field(init=False)  # autocast, or nothing for float32
    sync: Callable[[bool], None] | None = field(init=False)  # gradient all-reduce on the last micro-batch only

    def __post_init__(self) -> None:
        self.peak_flops = peak_flops(self.env.device, self.cfg.peak_flops) if self.env.is_main else 1.0
        self.ctx = autocast_context(self.env.device_type, self.cfg.dtype)
        self.sync = gradient_sync(self.model, self.raw_model, self.env, self.env.fsdp(self.cfg.parallel))

    @property
    def accum(self) -> int:
        """Micro-batches per step on this rank."""
        return self.env.micro_steps(self.cfg.gradient_accumulation_steps)

    @property
    def tokens_per_iter(self) -> int:
        return self.accum * self.env.world_size * self.cfg.batch_size * self.cfg.block_size

    def rows(self, step: int) -> int | None:
        """The sequences each micro-batch of `step` trains on when fewer than batch_size (batch_warmup_iters)."""
        return self.cfg.batch_warmup_size if step < self.cfg.batch_warmup_iters else None

    def tokens_before(self, step: int) -> int:
        """Tokens trained on in steps 0 .. step - 1, the smaller warm-up batches counted as they are."""
        cfg, warm = self.cfg, min(step, self.cfg.batch_warmup_iters)
        fewer = warm * self.accum * self.env.world_size * (cfg.batch_size - cfg.batch_warmup_size) * cfg.block_size
        return step * self.tokens_per_iter - fewer


def setup(cfg: TrainConfig, env: DistEnv) -> Run | None:
    """Build the run: where it starts, its resolved settings, model, optimizer, batches, evaluators and sinks; None
    when it resumes a finished run (nothing to do, nothing written)."""
    check_accumulation(cfg, env)
    malloc = keep_freed_memory()  # `gptforge` did it at start; a call of train() from Python does it here
    torch.manual_seed(cfg.seed)  # every rank builds the same initial weights (FSDP keeps each rank's shard)
    folder = dataset_dir(cfg.data_dir, cfg.dataset)
    meta = read_meta(folder)
    if env.restart:
        env.say(
            f"torchrun restart {env.restart} (of --max-restarts={os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')})"
        )
    if cfg.resume == "auto" and cfg.init_from != "resume":
        env.say(f"resume=auto: no checkpoint in {cfg.out_dir}; a new run (init_from={cfg.init_from})")
    if env.ddp and env.device_type == "cpu":  # every rank decides each 'auto' by rank 0's measured rates
        adopt_rates(gather(cpu_product_rates("bfloat16") if env.is_main else None, env)[0])
    begun = begin(cfg, env, meta)
    if begun is None:
        return None
    cfg, start, model = begun  # cfg resolved: every 'auto' decided, the settings from here on
    optimizer, scaler = build_training(cfg, env, model)
    batches, eval_batches, eval_iters = open_batches(cfg, env, folder, meta, start.args["vocab_size"])
    iter_num, best_val_loss = 0, math.inf
    if start.ckpt is not None:
        fsdp = env.fsdp(cfg.parallel)
        iter_num, best_val_loss, told = restore(
            start.ckpt, start.source, model, optimizer, scaler, batches, env, fsdp, cfg.seed
        )
        env.say(told)
    data_state = batches.state_dict()  # the state that yields the batch below: what a resume must restore
    batch = batches.next_batch()  # (its token ids are checked against the vocabulary here, before any write)
    hellaswag, chat_tasks, sampler, token_bytes = open_evaluators(cfg, env, meta, start.args["vocab_size"])
    metrics, cleanup = open_outputs(cfg, env, start.ckpt)  # every input is checked by now
    fixed = {"model_args": start.args, "tokenizer": tokenizer_spec(meta), "wandb_run_id": metrics.wandb_id}
    checkpointer = Checkpointer(cfg, env, model, optimizer, scaler, iter_num, fixed, metrics.info)
    run = Run(
        cfg, env, compile_and_wrap(model, cfg, env, metrics), model, optimizer, scaler, batches, eval_batches,
        eval_iters, hellaswag, chat_tasks, sampler, metrics, checkpointer, cleanup, batch, data_state, iter_num,
        best_val_loss, token_bytes=token_bytes,
    )  # fmt: skip
    metrics.info(describe(run, start, malloc))
    if env.is_main:
        write_config(cfg)
    return run


def open_evaluators(
    cfg: TrainConfig, env: DistEnv, meta: dict[str, Any], vocab_size: int
) -> tuple[Any, Any, Sampler | None, torch.Tensor | None]:
    """What evaluates the model besides the val loss, each loaded (and checked) before training: HellaSwag, the
    held-out synthetic tasks of SFT (rank 0, not under FSDP), the samples; and the bytes of text per id that turn
    the evaluations' losses into bits per byte."""
    hellaswag = None
    if cfg.hellaswag_interval > 0:
        hellaswag = hellaswag_task(cfg.hellaswag_path or None, cfg.hellaswag_limit or None, env, meta)
    token_bytes = dataset_byte_table(meta, vocab_size, env.device, env.say)
    fsdp = env.fsdp(cfg.parallel)
    chat_tasks = chat_task(cfg.chat_eval_examples if cfg.task == "sft" and env.is_main and not fsdp else 0, env, meta)
    # a sharded model needs every rank in each forward pass, so under FSDP all ranks sample (rank 0 logs)
    sampler = None
    if cfg.sample_interval > 0 and (env.is_main or fsdp):
        given = cfg.sample_prompt != FIELDS["sample_prompt"].default
        sampler = Sampler(cfg.sample_prompt, cfg.num_samples, cfg.sample_tokens, meta, env, given)
    return hellaswag, chat_tasks, sampler, token_bytes


def check_accumulation(cfg: TrainConfig, env: DistEnv) -> None:
    if cfg.gradient_accumulation_steps % env.world_size:
        raise UserError(
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} (micro-batches per step over all "
            f"processes) does not divide across {env.world_size} processes; make it a multiple of {env.world_size}"
        )


def build_training(cfg: TrainConfig, env: DistEnv, model: GPT) -> tuple[torch.optim.Optimizer, Any]:
    """The model placed on its device (sharded under FSDP), then its optimizer and loss scaler."""
    muon = muon_settings(cfg)
    if env.rank:
        torch.manual_seed(cfg.seed + env.rank)  # then each rank its own stream: batches and dropout differ
    place_model(model, env.device, env.fsdp(cfg.parallel))  # before the optimizer: it holds the (sharded) parameters
    betas = (cfg.beta1, cfg.beta2)
    optimizer = configure_optimizer(
        model, cfg.weight_decay, cfg.learning_rate, betas, env.device_type, muon, cfg.embedding_lr_scale
    )
    return optimizer, torch.amp.GradScaler(env.device_type, enabled=cfg.dtype == "float16")


def describe(run: Run, start: Start, malloc: str) -> str:
    """The lines a run opens with: model, device and settings (an automatic dtype with what decided it), tokens per
    step, memory, the allocator; and a warning where this CPU runs the run's bf16 / fp16 products slowly."""
    cfg, env, why, slow = run.cfg, run.env, start.dtype_why, start.slow_products
    return (
        f"model: {run.raw_model.get_num_params() / 1e6:.2f}M parameters | device {env.device}, dtype {cfg.dtype}"
        f"{f' ({why})' if why else ''}, "
        f"compile {cfg.compile}, {env.world_size} process(es), dropout {cfg.dropout}"
        f"{' (fast masks)' if cfg.fast_dropout and cfg.dropout > 0 else ''}"
        f"{', float32 products by oneDNN' if cfg.onednn_f32 and cfg.dtype == 'float32' else ''}\n"
        f"tokens per iteration: {run.tokens_per_iter:,} = {run.accum} accumulation x {env.world_size} processes x "
        f"{cfg.batch_size} batch x {cfg.block_size} block"
        f"{warmup_line(run)}\n"
        f"memory: {start.memory.describe()} estimated per process\n"
        f"{recipe_line(cfg)}{malloc}" + (f"\n{slow}" if slow else "")
    )


def warmup_line(run: Run) -> str:
    """The batch warm-up's part of the tokens line: '' without one."""
    cfg = run.cfg
    if not cfg.batch_warmup_iters:
        return ""
    first = run.tokens_before(1)
    return f" ({first:,}, {cfg.batch_warmup_size} of the batch, in the first {cfg.batch_warmup_iters} steps)"


def muon_settings(cfg: TrainConfig) -> MuonSettings | None:
    """configure_optimizer's `muon` from a run's settings: None unless optimizer='muon'."""
    if cfg.optimizer != "muon":
        return None
    return MuonSettings(
        cfg.muon_lr, cfg.muon_momentum, cfg.muon_warmup, muon_dtype(cfg), cfg.muon_split_qkv, cfg.normuon
    )


def muon_dtype(cfg: TrainConfig) -> str:
    """The Newton-Schulz dtype muon_dtype='auto' stands for: bfloat16 on CUDA and on CPUs whose bf16 products
    measure faster than float32's (core.cpu.half_pays), float32 elsewhere (where bf16 is emulated it is hundreds of
    times slower; some CPUs with bf16 flags multiply it at half float32's rate)."""
    if cfg.muon_dtype != "auto":
        return cfg.muon_dtype
    kind = device_type(resolve_device("auto") if cfg.device == "auto" else cfg.device)  # auto: what it stands for
    return "bfloat16" if kind == "cuda" or (kind == "cpu" and half_pays("bfloat16")) else "float32"


def recipe_line(cfg: TrainConfig) -> str:
    """One line naming the model switches that are on (and GPT-2's tanh GELU) and the optimizer, when they differ
    from nanoGPT's model and AdamW, and Muon's settings given to another optimizer (not applied); '' otherwise (a
    nanoGPT command's header reads as before)."""
    on = [k if isinstance(v, bool) else f"{k}={getattr(cfg, k)}" for k, v in SWITCHES.items() if getattr(cfg, k) != v]
    if cfg.gelu != "erf" and not cfg.relu2:  # nanoGPT's MLP has the exact GELU; relu2 has none
        on.append(f"gelu={cfg.gelu}")
    parts = [f"model switches on: {', '.join(on)}"] if on else []
    if cfg.optimizer == "muon":
        extra = [name for name, chosen in (("q, k, v apart", cfg.muon_split_qkv), ("NorMuon", cfg.normuon)) if chosen]
        parts.append(
            f"optimizer muon (matrices at muon_lr {cfg.muon_lr}, momentum {cfg.muon_momentum} after "
            f"{cfg.muon_warmup} warm-up steps, Newton-Schulz in {muon_dtype(cfg)}{''.join(', ' + e for e in extra)}; "
            f"AdamW at learning_rate {cfg.learning_rate} for the rest)"
        )
    else:
        default = TrainConfig()
        unused = [f"{k}={getattr(cfg, k)}" for k in MUON_ONLY if getattr(cfg, k) != getattr(default, k)]
        if unused:
            parts.append(f"Muon's {', '.join(unused)} not applied: the optimizer is {cfg.optimizer} (--optimizer=muon)")
    return "recipe: " + "; ".join(parts) + "\n" if parts else ""


def open_batches(
    cfg: TrainConfig, env: DistEnv, folder: str, meta: dict[str, Any], vocab_size: int
) -> tuple[Batches, Callable[[], dict[str, Batches]], int]:
    """The training batches, the loaders of one evaluation (by split), and its batches per split and rank."""
    open_split = functools.partial(
        make_batches,
        folder,
        meta,
        kind=cfg.data_loader,
        batch_size=cfg.batch_size,
        block_size=cfg.block_size,
        vocab_size=vocab_size,
        device=env.device,
        seed=cfg.seed,
        global_rng=True,
        rank=env.rank,
        world_size=env.world_size,
    )
    micro = env.micro_steps(cfg.gradient_accumulation_steps)
    train_batches = open_split("train", micro_per_rank=micro, train_on=cfg.sft_loss)
    if cfg.data_loader == "sharded":

        def eval_batches() -> dict[str, Batches]:  # each evaluation: the first windows of each split, over the ranks
            return {split: open_split(split) for split in ("train", "val")}

        return train_batches, eval_batches, -(-cfg.eval_iters // env.world_size)
    # nanoGPT: evaluation batches from torch's global generator, drawn in its order between the training batches,
    # so a nanoGPT command gives nanoGPT's losses (docs/ARCHITECTURE.md, "Randomness and exact resume")
    fixed = {"train": train_batches, "val": open_split("val")}
    return train_batches, fixed.copy, cfg.eval_iters

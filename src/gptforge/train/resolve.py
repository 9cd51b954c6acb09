"""The run's settings resolved once for this device and dataset (every 'auto' decided, the shape of a resumed or
pretrained model), the memory training needs checked against the device's before anything is allocated, and the
model built: `begin` runs these after train/start.py has found where the run starts."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from gptforge.core.config import TrainConfig, loader_kind
from gptforge.core.cpu import emulated_half_products
from gptforge.core.device import (
    available_memory,
    dtype_reason,
    resolve_compile,
    resolve_dtype,
    resolve_fast_dropout,
    resolve_onednn_f32,
)
from gptforge.core.distributed import DistEnv
from gptforge.core.memory import MemoryEstimate, check_fits, estimate_training_memory
from gptforge.core.shape import SHAPE_KEYS
from gptforge.kernels.attention import saved_score_bytes
from gptforge.kernels.head_loss import head_loss_used
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.train.start import Start, find_start
from gptforge.weights.load import checkpoint_model


def begin(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any]) -> tuple[TrainConfig, Start, GPT] | None:
    """Where the run starts (train/start.py); then the settings it uses, as config.json and every checkpoint record
    them: each 'auto' decided for this device and dataset, HellaSwag off for a dataset it cannot read, the shape of
    a resumed or pretrained model; the memory it needs checked against the device's; and its model built. None when
    it resumes a finished run (nothing to do)."""
    start = find_start(cfg, env, meta)
    if start is None:
        return None
    hellaswag_interval = cfg.hellaswag_interval
    if hellaswag_interval > 0 and meta["tokenizer"] != "gpt2":  # e.g. --eval_freq on a char-level dataset
        env.say(
            f"hellaswag_interval={hellaswag_interval} ignored: HellaSwag needs GPT-2 BPE tokens and dataset "
            f"{cfg.dataset!r} is {meta['tokenizer']}-level"
        )
        hellaswag_interval = 0
    shape = {k: start.args[k] for k in SHAPE_KEYS} if cfg.init_from != "scratch" else {}
    n_embd, given_dtype = shape.get("n_embd", cfg.n_embd), cfg.dtype
    cfg = dataclasses.replace(  # the settings from here on: every 'auto' decided
        cfg,
        device=env.device,
        dtype=resolve_dtype(cfg.dtype, env.device_type, n_embd, cfg.cpu_bf16_min_width),
        compile=resolve_compile(cfg.compile, env.device_type),
        fast_dropout=resolve_fast_dropout(cfg.fast_dropout, env.device_type),
        onednn_f32=resolve_onednn_f32(cfg.onednn_f32, env.device_type),
        data_loader=loader_kind(meta, cfg.data_loader),
        hellaswag_interval=hellaswag_interval,
        **shape,
    )
    start.dtype_why = dtype_reason(given_dtype, cfg.dtype, env.device_type, n_embd, cfg.cpu_bf16_min_width)
    start.slow_products = emulated_half_products(cfg.dtype) if env.device_type == "cpu" else ""
    start.memory = check_memory(cfg, env, start.args)
    return cfg, start, build_model(cfg, start)


def build_model(cfg: TrainConfig, start: Start) -> GPT:
    """The network with its dropout draws and float32 CPU products set: the weights already loaded, a resumed
    checkpoint's, or a new GPT."""
    if start.model is not None:
        model = start.model
    elif start.ckpt is not None:
        model, _ = checkpoint_model(start.ckpt, start.source, cfg.dropout)
    else:
        model = GPT(GPTConfig(**start.args, dropout=cfg.dropout))
    model.use_fast_dropout(cfg.fast_dropout)
    model.use_onednn_f32(cfg.onednn_f32)
    return model


def check_memory(cfg: TrainConfig, env: DistEnv, args: dict[str, Any]) -> MemoryEstimate:
    """The estimate of what training needs per process; a model that cannot train here stops before anything is
    allocated (exit 2 naming the keys to lower)."""
    shards = env.world_size if env.fsdp(cfg.parallel) else 1
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if env.device_type == "cpu" else 1
    estimate = training_estimate(
        args, cfg.batch_size, cfg.dtype, cfg.optimizer, env.device_type, cfg.dropout, cfg.fast_dropout, cfg.compile,
        shards,
    )  # fmt: skip
    check_fits(estimate, *available_memory(env.device, processes))
    return estimate


def training_estimate(
    args: dict[str, Any],
    batch_size: int,
    dtype: str,
    optimizer: str,
    device_type: str,
    dropout: float,
    fast_dropout: bool,
    compiled: bool,
    shards: int = 1,
) -> MemoryEstimate:
    """core/memory.estimate_training_memory with what this device's training path keeps: the head's loss step where
    it is taken (kernels/head_loss) and the attention's T x T scores (kernels/attention.saved_score_bytes). dtype,
    fast_dropout and compiled as resolved for the device; check_memory and `gptforge bench` both estimate so."""
    head = head_loss_used(device_type, args["vocab_size"], dtype != "float32", args.get("logit_softcap", 0))
    bf16 = dtype == "bfloat16"
    scores = saved_score_bytes(args["block_size"], args["n_head"], dropout, fast_dropout, device_type, bf16, compiled)
    return estimate_training_memory(args, batch_size, dtype, optimizer, shards, head, scores)

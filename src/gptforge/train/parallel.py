"""How the model runs on its devices: placed (and under FSDP sharded per block) before its optimizer is built,
compiled when asked, wrapped in DDP with several processes, and the gradient all-reduce held back to the last
micro-batch of a step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gptforge.core.config import TrainConfig
from gptforge.core.distributed import DistEnv
from gptforge.model.gpt import GPT
from gptforge.train.metrics import Metrics


def place_model(model: GPT, device: str, fsdp: bool) -> None:
    """Move the model to its device; under FSDP shard each block and the root across the ranks."""
    model.to(device)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)


def compile_and_wrap(model: GPT, cfg: TrainConfig, env: DistEnv, metrics: Metrics) -> torch.nn.Module:
    """What the training step calls: the model compiled when asked, inside DDP with several processes (FSDP
    shards the model itself)."""
    if cfg.compile:
        metrics.info("compiling the model with torch.compile (the first step takes a while)...")
        model = torch.compile(model)
    if env.ddp and not env.fsdp(cfg.parallel):
        # broadcast_buffers off: the only buffers are the rotary tables, the same on every rank by construction
        model = DDP(model, device_ids=[env.local_rank] if env.device_type == "cuda" else None, broadcast_buffers=False)
    return model


def gradient_sync(model: torch.nn.Module, raw_model: GPT, env: DistEnv, fsdp: bool) -> Callable[[bool], None] | None:
    """What accumulate_gradients calls before each micro-batch, so that gradients are reduced on the last only."""
    if fsdp:
        return raw_model.set_requires_gradient_sync
    if not env.ddp:
        return None

    def sync(last: bool) -> None:
        model.require_backward_grad_sync = last

    return sync

"""Validation loss: the mean cross-entropy over `eval_iters` batches per split, shared by training and eval.

    losses = estimate_loss(model, {"train": train_batches, "val": val_batches}, eval_iters=200, ctx=ctx)
    # {"train": 1.61, "val": 1.78}
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from gptforge.data.loader import RandomBatches


@torch.no_grad()
def estimate_loss(
    model: torch.nn.Module,
    loaders: dict[str, RandomBatches],
    eval_iters: int,
    ctx: contextlib.AbstractContextManager | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Mean loss per split in eval mode (no dropout); `reduce` averages across ranks under DDP."""
    was_training = model.training
    model.eval()
    out = {}
    try:
        for split, loader in loaders.items():
            total = torch.zeros((), device=loader.device)
            for _ in range(eval_iters):
                x, y = loader.next_batch()
                with ctx or contextlib.nullcontext():
                    _, loss = model(x, y)
                total += loss.float()
            mean = total / eval_iters
            out[split] = (reduce(mean) if reduce else mean).item()
    finally:
        model.train(was_training)
    return out

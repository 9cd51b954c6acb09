"""AdamW with decoupled weight decay on matrices only (Muon for them where asked), and gradient accumulation; the
learning-rate schedule that sets each step's rate is train/loop.py's get_lr.

optimizer = configure_optimizer(model, weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95), device_type="cuda")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gptforge.core.errors import UserError


@dataclass(frozen=True)
class MuonSettings:
    """Muon's part of the optimizer (train/setup.py builds it from a run's muon_* settings): the peak learning rate
    of the blocks' matrices, its momentum (reached after `warmup` steps from 0.85), the Newton-Schulz dtype
    ('float32' | 'bfloat16'), split_qkv (each fused c_attn matrix as its query, key and value matrices) and normuon
    (each neuron's update normalised, muon.normalize_neurons)."""

    lr: float
    momentum: float
    warmup: int
    dtype: str = "float32"
    split_qkv: bool = False
    normuon: bool = False


def configure_optimizer(
    model: torch.nn.Module,
    weight_decay: float,
    learning_rate: float,
    betas: tuple[float, float],
    device_type: str,
    muon: MuonSettings | None = None,
    embedding_lr_scale: float = 1.0,
) -> torch.optim.Optimizer:
    """AdamW where only tensors of 2 or more dimensions (matmul weights, embeddings) are decayed.

    Biases and LayerNorm gains are left alone: shrinking them towards zero only hurts. The fused kernel is
    used on CUDA (one launch for all parameters instead of several per tensor).

    muon: the blocks' 2-D matrices go to Muon instead (no weight decay, as the published recipes), in one
    MuonAdamW. Every group carries `lr_scale`, its peak over learning_rate. embedding_lr_scale != 1: the token
    embedding (untied) in a group of its own after the first two, at that multiple of learning_rate.
    """
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}  # tied weights appear once
    hidden = [n for n, p in params.items() if muon is not None and p.dim() == 2 and ".h." in f".{n}"]
    embedding = {n for n in params if n.endswith("wte.weight")} if embedding_lr_scale != 1.0 else set()
    check_untied(model, params, embedding, embedding_lr_scale)
    decay = [p for n, p in params.items() if p.dim() >= 2 and n not in hidden and n not in embedding]
    no_decay = [p for p in params.values() if p.dim() < 2]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if embedding:
        group = {"params": [params[n] for n in embedding], "weight_decay": weight_decay}
        groups.append({**group, "lr": learning_rate * embedding_lr_scale, "lr_scale": embedding_lr_scale})
    if muon is None:
        from gptforge.model.eager_optim import EagerAdamW

        fused = device_type == "cuda"
        return EagerAdamW(groups, lr=learning_rate, betas=betas, fused=fused or None)  # torch's AdamW
    from gptforge.model.muon import MuonAdamW

    for group in groups:
        scale = group.get("lr_scale", 1.0)
        group.update(kind="adamw", lr=learning_rate * scale, betas=betas, lr_scale=scale)
    groups.append(muon_group({n: params[n] for n in hidden}, muon, learning_rate))
    return MuonAdamW(groups)


def check_untied(
    model: torch.nn.Module, params: dict[str, torch.Tensor], embedding: set[str], embedding_lr_scale: float
) -> None:
    """An embedding with a learning rate of its own must not be the output head too (tied weights)."""
    every = [q for _, q in model.named_parameters(remove_duplicate=False)] if embedding else []
    if any(sum(q is params[n] for q in every) > 1 for n in embedding):
        raise UserError(
            f"--embedding_lr_scale={embedding_lr_scale}: the embedding is tied to the output head here "
            "(untie_head=False), so its learning rate is the head's too; add --untie_head=True (a new run), or "
            "leave --embedding_lr_scale at 1"
        )


def muon_group(matrices: dict[str, torch.Tensor], muon: MuonSettings, learning_rate: float) -> dict[str, Any]:
    """The Muon parameter group of MuonAdamW: the blocks' matrices, by name."""
    group: dict[str, Any] = dict(
        params=list(matrices.values()),
        kind="muon",
        lr=muon.lr,
        lr_scale=muon.lr / learning_rate,
        momentum=muon.momentum,
        momentum_warmup=int(muon.warmup),
        weight_decay=0.0,
        ns_dtype=muon.dtype,
    )
    if muon.split_qkv:  # c_attn is (3 n_embd, n_embd): query, key and value rows, in that order
        group["row_blocks"] = [3 if n.endswith("attn.c_attn.weight") else 1 for n in matrices]
    if muon.normuon:
        group["normuon_beta2"] = NORMUON_BETA2
    return group


NORMUON_BETA2 = 0.95  # the NorMuon paper's running-mean factor for each neuron's squared update


def accumulate_gradients(model, batch, batches, accum: int, ctx, scaler, sync=None, rows: int | None = None):
    """Forward and backward over `accum` micro-batches, starting with `batch`, summing gradients in .grad.

    Returns (the step's loss as a tensor, the next step's first batch, the loader's state before it was drawn).
    A batch (X, Y) (pretraining): each micro-batch's mean loss divided by accum, so the gradient is the mean over
    all of them, as one big batch would give. A batch (X, Y, P, w) (a chat dataset): the micro-batch's trained
    targets' losses summed and times w (the loader's: 1 / the trained targets of the whole step, times the
    processes), so the step's loss is the mean over every trained target of the step, and a micro-batch without
    one adds nothing. The next batch is fetched before backward: on a GPU the copy overlaps the compute.
    `sync(last)`, when given, turns the gradient all-reduce (DDP) / reduce-scatter (FSDP) on for the last
    micro-batch only. `rows` (batch_warmup_size): each micro-batch (X, Y) trains on its first `rows` sequences; the
    loader draws whole batches as ever, so the data that follows and a resume's state do not change.
    """
    loss_sum = torch.zeros((), device=batch[0].device)
    for micro_step in range(accum):
        if sync is not None:
            sync(micro_step == accum - 1)  # communicate once per step, not once per micro-batch
        with ctx:
            loss = batch_loss(model, batch if rows is None else (batch[0][:rows], batch[1][:rows]), accum)
        if micro_step == accum - 1:
            data_state = batches.state_dict()  # what a resume must restore to draw the same next batch
        batch = batches.next_batch()
        scaler.scale(loss).backward()
        loss_sum += loss.detach()
    return loss_sum, batch, data_state


def batch_loss(model, batch, accum: int) -> torch.Tensor:
    """One micro-batch's share of the step's loss (see accumulate_gradients)."""
    if len(batch) == 2:
        _, loss = model(*batch, need_logits=False)
        return loss / accum
    x, y, positions, weight = batch
    _, loss = model(x, y, positions=positions, reduction="sum", need_logits=False)
    return loss * weight

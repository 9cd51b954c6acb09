"""Loss, perplexity and bits per byte: `estimate_loss` (and `estimate_chat_loss`, a chat dataset's mean over its
trained targets), shared by training and `gptforge eval loss` (`eval_loss`, a checkpoint's loss on a prepared dataset
from seeded batches)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from gptforge.core.config import loader_kind
from gptforge.core.console import log
from gptforge.core.device import autocast_context, device_type, inference_dtype, resolve_device
from gptforge.core.errors import UserError
from gptforge.data.loader import Batches, dataset_dir, make_batches, read_meta
from gptforge.model.cache import evaluating
from gptforge.tokenizer.spec import Tokenizer, from_spec, token_byte_table, tokenizer_spec
from gptforge.weights.load import load_model


@torch.no_grad()
def estimate_loss(
    model: torch.nn.Module,
    loaders: dict[str, Batches],
    eval_iters: int,
    ctx: contextlib.AbstractContextManager | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    token_bytes: torch.Tensor | None = None,
) -> dict[str, float]:
    """Mean loss per split in eval mode (no dropout), keyed by split; with `token_bytes` (the bytes of text each id
    stands for: byte_table) also each split's bits per byte as `<split>_bpb`: the summed loss in nats over ln 2
    times the summed bytes of the target tokens, over the same batches, so runs with different vocabularies
    compare. `reduce` averages across ranks under DDP (the bpb sums are reduced apart, then divided)."""
    out = {}
    with evaluating(model):
        for split, loader in loaders.items():
            total = torch.zeros((), device=loader.device)
            wide = torch.float32 if loader.device.type == "mps" else torch.float64  # MPS has no float64
            nats, n_bytes = torch.zeros(2, dtype=wide, device=loader.device)
            for _ in range(eval_iters):
                x, y = loader.next_batch()
                with ctx or contextlib.nullcontext():
                    _, loss = model(x, y)
                total += loss.float()
                if token_bytes is not None:
                    scored = y >= 0  # -1: a position without a target (ignored by the loss)
                    nats += loss.to(wide) * scored.sum()
                    n_bytes += torch.where(scored, token_bytes[y.clamp(min=0)], 0).sum()
            mean = total / eval_iters
            out[split] = (reduce(mean) if reduce else mean).item()
            if token_bytes is not None:
                sums = torch.stack([nats, n_bytes])
                nats_sum, bytes_sum = (reduce(sums) if reduce else sums).tolist()
                out[f"{split}_bpb"] = nats_sum / (math.log(2) * bytes_sum) if bytes_sum > 0 else math.nan
    return out


@torch.no_grad()
def estimate_chat_loss(
    model: torch.nn.Module,
    loaders: dict[str, Any],
    eval_iters: int,
    ctx: contextlib.AbstractContextManager | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Per split, the mean loss over every trained target of eval_iters batches (X, Y, P, w): the summed loss over
    the summed count, each summed over the ranks (`reduce`: a sum across them under DDP)."""
    out = {}
    with evaluating(model):
        for split, loader in loaders.items():
            total = torch.zeros(2, device=loader.device)  # loss sum, trained targets
            for _ in range(eval_iters):
                x, y, positions, _ = loader.next_batch()
                with ctx or contextlib.nullcontext():
                    _, loss = model(x, y, positions=positions, reduction="sum")
                total += torch.stack([loss.float(), (y != -1).sum().float()])
            total = reduce(total) if reduce else total
            out[split] = (total[0] / total[1].clamp(min=1)).item()
    return out


def byte_table(tok: Tokenizer, rows: int, device: str | torch.device) -> torch.Tensor:
    """The bytes of text each of a model's `rows` ids stands for (specials and padding rows: 0), on `device`:
    estimate_loss's denominator of bits per byte."""
    return torch.tensor(token_byte_table(tok, rows), dtype=torch.long, device=device)


def dataset_byte_table(
    meta: dict[str, Any], rows: int, device: str | torch.device, say: Callable[[str], None] = log
) -> torch.Tensor | None:
    """byte_table for a dataset's tokenizer, or None when that cannot be built here (GPT-2's BPE offline without
    tiktoken's files, which training on GPT-2 token ids does not otherwise need): the run then goes on without
    bits per byte, and `say` tells why."""
    try:
        tok = from_spec(tokenizer_spec(meta))
    except UserError as e:
        say(f"bits per byte left out: {e}")
        return None
    return byte_table(tok, rows, device)


def eval_loss(
    out_dir: str,
    ckpt: str | None,
    init_from: str,
    dataset: str | None,
    data_dir: str | None,
    split: str,
    eval_iters: int | None,
    batch_size: int | None,
    block_size: int | None,
    seed: int,
    device: str,
    dtype: str,
) -> dict[str, float]:
    """`gptforge eval loss`: a model's mean loss per split (one process); prints a line per split to stdout.
    The run's own dataset, batch shape and eval_iters are the defaults."""
    for key, value in (("eval_iters", eval_iters), ("batch_size", batch_size), ("block_size", block_size)):
        if value is not None and value <= 0:
            raise UserError(f"--{key} must be a positive integer, got {value}")
    device = resolve_device(device)
    model, tok, checkpoint = load_model(out_dir, ckpt, init_from, device)
    run = (checkpoint or {}).get("config") or {}  # the run's config: its dataset and batch shape are the defaults
    del checkpoint
    dataset = dataset or run.get("dataset")
    if not dataset:
        raise UserError("--dataset: name the prepared dataset to measure on (e.g. --dataset=shakespeare)")
    folder = dataset_dir(data_dir or run.get("data_dir", "data"), dataset)
    meta = read_meta(folder)
    if tokenizer_spec(meta) != tok.spec():
        raise UserError(
            f"dataset {folder} is tokenized differently ({meta['tokenizer']}) from what the model "
            f"reads ({tok.kind}); choose a dataset made with the model's tokenizer (--dataset)"
        )
    block = min(block_size or run.get("block_size") or model.config.block_size, model.config.block_size)
    batch, iters = batch_size or run.get("batch_size", 8), eval_iters or run.get("eval_iters", 200)
    splits = ["val", "train"] if split == "both" else [split]
    kind = loader_kind(meta)  # a shard dataset: the first windows of each split, in order, as training evaluates
    loaders = {
        s: make_batches(folder, meta, s, kind, batch, block, model.config.vocab_size, device, seed) for s in splits
    }
    dtype = inference_dtype(dtype, device_type(device), model.config.n_embd)  # train's rule, for this model
    log(f"loss: {iters} batches of {batch} x {block} tokens per split from {folder} on {device} ({dtype})")
    ctx = autocast_context(device_type(device), dtype)
    if kind == "chat":  # a chat dataset: the mean over the trained (assistant) targets, as SFT evaluates
        losses = estimate_chat_loss(model, loaders, iters, ctx)
        for s in splits:
            print(f"{s} loss {losses[s]:.4f} (ppl {math.exp(min(losses[s], 700)):.2f}) on the trained tokens")
        return losses
    losses = estimate_loss(model, loaders, iters, ctx, token_bytes=byte_table(tok, model.config.vocab_size, device))
    for s in splits:
        print(f"{s} loss {losses[s]:.4f} (ppl {math.exp(min(losses[s], 700)):.2f}), bpb {losses[s + '_bpb']:.4f}")
    return losses

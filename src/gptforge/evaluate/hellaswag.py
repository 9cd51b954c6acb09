"""HellaSwag: pick the right one of four endings, scored completion style as the GPT-2 papers do (acc on the
summed loss of the ending's tokens, acc_norm on their mean); `gptforge eval hellaswag`. README "Evaluate on
HellaSwag" has what to expect; under torchrun each rank scores every world_size-th example."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from gptforge.core import console
from gptforge.core.device import autocast_context, inference_dtype
from gptforge.core.distributed import DistEnv, setup_distributed, teardown
from gptforge.core.errors import UserError
from gptforge.core.files import cache_dir, download
from gptforge.model.cache import evaluating
from gptforge.tokenizer.spec import Tokenizer, from_spec, tokenizer_spec
from gptforge.weights.load import load_model

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
CACHE_ENV = "GPTFORGE_CACHE_DIR"
NUM_ENDINGS = 4


def default_cache_dir() -> str:
    """Where the downloaded validation set lives: $GPTFORGE_CACHE_DIR/hellaswag, else ~/.cache/gptforge/hellaswag."""
    return os.path.join(cache_dir(), "hellaswag")


def hellaswag_file(path: str | None = None, url: str = HELLASWAG_URL, cache_dir: str | None = None) -> str:
    """The validation jsonl to read: `path` (--hellaswag_path) if given, else the cached copy, downloaded if absent."""
    if path is not None:
        if not os.path.isfile(path):
            raise UserError(
                f"--hellaswag_path={path}: no such file; give the path of HellaSwag's hellaswag_val.jsonl "
                f"(from {url}), or leave the option out to download it"
            )
        return path
    dest = os.path.join(cache_dir or default_cache_dir(), "hellaswag_val.jsonl")
    if not os.path.isfile(dest):
        download(
            url,
            dest,
            f"Get hellaswag_val.jsonl another way and pass --hellaswag_path=PATH (or place it at {dest}, "
            f"or set {CACHE_ENV} to a writable folder)",
        )
    return dest


def load_examples(path: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` examples (all when None) of a HellaSwag jsonl, each checked for ctx, endings, label."""
    examples: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}, line {lineno}: not JSON ({e.msg}); --hellaswag_path must be HellaSwag's "
                    "jsonl (one example per line)"
                ) from None
            ok = (
                isinstance(ex, dict)
                and isinstance(ex.get("ctx"), str)
                and isinstance(ex.get("endings"), list)
                and len(ex["endings"]) == NUM_ENDINGS
                and all(isinstance(s, str) for s in ex["endings"])
                and ex.get("label") in range(NUM_ENDINGS)
            )
            if not ok:
                raise UserError(
                    f"{path}, line {lineno}: not a HellaSwag example (needs 'ctx', 4 'endings' and "
                    "'label' 0-3); --hellaswag_path must be hellaswag_val.jsonl"
                )
            examples.append(ex)
    if not examples:
        raise UserError(f"{path} holds no examples; --hellaswag_path must be HellaSwag's hellaswag_val.jsonl")
    return examples


def check_tokenizer(tokenizer: Tokenizer) -> None:
    """HellaSwag's text needs GPT-2's BPE: a character vocabulary cannot encode it (nor was the model built for it)."""
    if getattr(tokenizer, "kind", None) != "gpt2":
        raise UserError(
            f"HellaSwag needs a model trained with GPT-2's BPE tokenizer; this run uses "
            f"{getattr(tokenizer, 'kind', type(tokenizer).__name__)!r}. Train on a GPT-2 BPE dataset "
            "(e.g. `gptforge prepare shakespeare`) and pass that run's --out_dir"
        )


def render_example(
    example: dict[str, Any], tokenizer: Tokenizer, block_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One example -> (tokens (4, L), mask (4, L), label): row i is context + ending i, right-padded with 0.

    Each ending is encoded as " " + ending (it continues the context's last word). mask is 1 on the ending's
    tokens only. With `block_size`, a row longer than it is cropped from the left (its last block_size tokens
    are kept, the mask cropped alike): the model never sees the start of a long context, but still scores every
    token of an ending shorter than block_size (an ending's first kept token has no position before it).
    """
    ctx = tokenizer.encode(example["ctx"])
    rows, masks = [], []
    for ending in example["endings"]:
        end = tokenizer.encode(" " + ending)
        row, mask = ctx + end, [0] * len(ctx) + [1] * len(end)
        if block_size is not None and len(row) > block_size:
            row, mask = row[-block_size:], mask[-block_size:]
        rows.append(row)
        masks.append(mask)
    L = max(len(r) for r in rows)
    tokens = torch.zeros((NUM_ENDINGS, L), dtype=torch.long)
    mask = torch.zeros((NUM_ENDINGS, L), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        tokens[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m)
    return tokens, mask, int(example["label"])


def _raw_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers, for its config and parts."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def _sharded(model: torch.nn.Module) -> bool:
    """Whether the GPT is sharded with FSDP (fully_shard), so that each forward needs every rank. Only a process that
    has imported FSDP can hold a sharded model: one that has not is not made to (a slow import,
    docs/lab/2026-11-30-epyc-zen4-suite.md)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(_raw_model(model), fsdp.FSDPModule)


Rendered = tuple[torch.Tensor, torch.Tensor, int]  # render_example's (tokens (4, L), mask (4, L), label)


@torch.no_grad()
def score_rendered(
    model: torch.nn.Module,
    rendered: list[Rendered],
    device: str,
    ctx: contextlib.AbstractContextManager | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score rendered examples (render_example, cropped to the model's block_size) in one forward pass ->
    (sum_loss, mean_loss), each (N, 4) float32 on the CPU. sum_loss[n, i] is the cross-entropy summed over ending
    i's tokens, each predicted from the position before it; mean_loss divides it by the number of those tokens."""
    L = max(t.size(1) for t, _, _ in rendered)
    # Right padding: a causal model's outputs at earlier positions do not depend on what follows them.
    tokens = torch.cat([F.pad(t, (0, L - t.size(1))) for t, _, _ in rendered]).to(device)  # (R, L), R = N*4
    mask = torch.cat([F.pad(m, (0, L - m.size(1))) for _, m, _ in rendered]).to(device)  # (R, L)
    # Position t predicts token t+1, so the mask moves one step left with the targets.
    targets, scored = tokens[:, 1:], mask[:, 1:].bool()  # (R, L-1)
    # Only the M positions that predict an ending token need logits: the vocabulary projection, as costly as
    # many blocks (docs/lab/2026-11-21-skylake.md), runs on those M rows, not on all R * L.
    # The unwrapped GPT, so a compiled model runs eagerly: each batch has another length, which would recompile.
    gpt = _raw_model(model)
    with ctx or contextlib.nullcontext():
        x = gpt.hidden_states(tokens)  # (R, L, C)
        logits = gpt.logits(x[:, :-1, :][scored])  # (M, V)
    losses = torch.zeros(targets.shape, device=logits.device)  # (R, L-1)
    # float32 even under autocast, as in GPT.forward: the softmax over 50k entries needs the range.
    losses[scored] = F.cross_entropy(logits.float(), targets[scored], reduction="none")
    sum_loss = losses.sum(dim=1)  # (R,)
    mean_loss = sum_loss / scored.sum(dim=1)  # (R,): a cropped ending still keeps >= 1 predicted token
    return sum_loss.view(-1, NUM_ENDINGS).cpu(), mean_loss.view(-1, NUM_ENDINGS).cpu()


def evaluate_hellaswag(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    examples: list[dict[str, Any]],
    device: str,
    ctx: contextlib.AbstractContextManager | None = None,
    batch_examples: int = 4,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """acc and acc_norm over `examples` -> {n, correct, correct_norm, acc, acc_norm}, the same on every rank.

    Rank r scores examples r, r + world_size, ...; when a process group is initialized the counts are summed
    over all ranks (every rank must call this). `batch_examples` examples (4 rows each) go through one forward
    pass, grouped by length so that little is padding; the logits take vocab floats per ending token of the
    batch.
    """
    check_tokenizer(tokenizer)
    assert batch_examples > 0 and 0 <= rank < world_size, "batch_examples > 0 and 0 <= rank < world_size"
    block_size = _raw_model(model).config.block_size
    assert block_size >= 2, "a model needs block_size >= 2 to predict any ending token"
    rendered = [render_example(ex, tokenizer, block_size) for ex in examples[rank::world_size]]
    rendered.sort(key=lambda r: r[0].size(1))  # the counts do not depend on the order
    desc = "hellaswag" if world_size == 1 else f"hellaswag (rank 0's share of {world_size})"
    bar = console.progress(len(rendered), desc, "ex", enabled=progress and rank == 0)
    sharded = _sharded(model)
    count, dummy = len(rendered), None  # examples this rank goes through
    if sharded:  # every forward gathers each block's weights from all ranks: all ranks run the same count
        count = -(-len(examples) // world_size)  # the largest share
        dummy = [render_example(examples[0], tokenizer, block_size)]  # a forward for the others' sake
        _raw_model(model).unshard()  # the root's own weights (embeddings, head), which hidden_states() reads
    try:
        with evaluating(model):
            counts = _count_share(model, rendered, count, batch_examples, dummy, device, ctx, bar)
    finally:
        if bar is not None:
            bar.close()
        if sharded:
            _raw_model(model).reshard()
    if dist.is_available() and dist.is_initialized():
        counts = counts.to(device)  # NCCL reduces CUDA tensors only
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    n, correct, correct_norm = (int(c) for c in counts.tolist())
    return {
        "n": n,
        "correct": correct,
        "correct_norm": correct_norm,
        "acc": correct / n if n else float("nan"),
        "acc_norm": correct_norm / n if n else float("nan"),
    }


def _count_share(model, rendered, count: int, batch_examples: int, dummy, device: str, ctx, bar) -> torch.Tensor:
    """(n, correct, correct_norm) over this rank's rendered examples, `batch_examples` per forward pass, for
    `count` examples: past its own share a sharded model runs `dummy` (not counted) so every rank takes part."""
    counts = torch.zeros(3, dtype=torch.long)
    for start in range(0, count, batch_examples):
        batch = rendered[start : start + batch_examples]
        if not batch:
            score_rendered(model, dummy, device, ctx)
            continue
        sum_loss, mean_loss = score_rendered(model, batch, device, ctx)
        labels = torch.tensor([label for _, _, label in batch])
        counts += torch.stack(
            [torch.tensor(len(batch)), (sum_loss.argmin(1) == labels).sum(), (mean_loss.argmin(1) == labels).sum()]
        )
        if bar is not None:
            bar.update(len(batch))
            bar.set_postfix(acc_norm=f"{counts[2].item() / counts[0].item():.4f}", refresh=False)
    return counts


def format_result(result: dict[str, Any]) -> str:
    """The one-line summary the CLI prints."""
    n = result["n"]
    return (
        f"hellaswag: {n} examples, acc {result['acc']:.4f} ({result['correct']}/{n}), "
        f"acc_norm {result['acc_norm']:.4f} ({result['correct_norm']}/{n})"
    )


def eval_hellaswag(
    out_dir: str,
    ckpt: str | None,
    init_from: str,
    hellaswag_path: str | None,
    limit: int | None,
    batch_size: int,
    device: str,
    dtype: str,
) -> dict[str, Any] | None:
    """`gptforge eval hellaswag`: one process, or one per device under torchrun; rank 0 prints the result line
    to stdout (and returns the result; other ranks return None)."""
    for key, value in (("limit", limit), ("batch_size", batch_size)):
        if value is not None and value <= 0:
            raise UserError(f"--{key} must be a positive integer, got {value}")
    env = setup_distributed(device, "auto")
    try:
        model, tokenizer, _ = load_model(out_dir, ckpt, init_from, env.device)
        dtype = inference_dtype(dtype, env.device_type, model.config.n_embd)  # train's rule, for this model
        check_tokenizer(tokenizer)
        if env.ddp and not env.is_main:
            dist.barrier()  # rank 0 downloads; the others then find the file in the cache
        try:
            path = hellaswag_file(hellaswag_path)
        finally:
            if env.ddp and env.is_main:
                dist.barrier()
        examples = load_examples(path, limit)
        if env.is_main:
            console.log(
                f"hellaswag: scoring {len(examples)} examples from {path} on {env.device} ({dtype}), "
                f"{env.world_size} process(es)"
            )
        result = evaluate_hellaswag(
            model,
            tokenizer,
            examples,
            env.device,
            autocast_context(env.device_type, dtype),
            batch_examples=batch_size,
            rank=env.rank,
            world_size=env.world_size,
        )
        if env.is_main:
            print(format_result(result), flush=True)
        if env.ddp:  # leave together: a rank that tears gloo down while rank 0 still prints can abort rank 0
            dist.barrier()
        return result if env.is_main else None
    finally:
        teardown(env)


def hellaswag_task(
    path: str | None, limit: int | None, env: DistEnv, meta: dict[str, Any]
) -> Callable[..., dict[str, Any]]:
    """HellaSwag scoring during training, its examples (a local file, or the downloaded one; the first `limit`, or
    all) loaded and checked before any training."""
    tokenizer = from_spec(tokenizer_spec(meta))
    check_tokenizer(tokenizer)
    examples = load_examples(hellaswag_file(path), limit)
    return functools.partial(
        evaluate_hellaswag,
        tokenizer=tokenizer,
        examples=examples,
        device=env.device,
        rank=env.rank,
        world_size=env.world_size,
        progress=env.is_main,
    )

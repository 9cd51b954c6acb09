"""The reference sampler the tests hold rl/rollout.py's batched sample_groups against: one prompt's group at a time,
prefilled once through the generation engine's Rows and its KV cache, its keys and values copied to the group's rows,
then one token a row a step. The same generator state gives the same answers."""

from __future__ import annotations

import contextlib

import torch

from gptforge.infer.engine import Rows, sample_next
from gptforge.model.cache import evaluating
from gptforge.model.gpt import GPT
from gptforge.rl.rollout import Group


@torch.no_grad()
def sample_group(
    model: GPT,
    prompt: list[int],
    group: int,
    max_new_tokens: int,
    end: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_k: int = 0,
    ctx=None,
    vocab: int | None = None,
) -> Group:
    """`group` answers to `prompt`, sampled with `generator` (the same generator state, the same answers).
    max_new_tokens is cut to the room left in the context; vocab: tokens are drawn from ids below it (the
    embedding's padding rows never)."""
    device = model.transformer.wte.weight.device
    room = model.config.block_size - len(prompt)
    steps = min(max_new_tokens, room)
    if steps <= 0:
        raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room in block_size {model.config.block_size}")
    rows = Rows(model)
    with evaluating(model), ctx or contextlib.nullcontext():
        logits = rows.feed(torch.tensor([prompt], device=device))  # (1, V): prefilled once
        rows.cache.k = [k.expand(group, -1, -1, -1).contiguous() for k in rows.cache.k]
        rows.cache.v = [v.expand(group, -1, -1, -1).contiguous() for v in rows.cache.v]
        logits = logits.expand(group, -1)
        done = torch.zeros(group, dtype=torch.bool, device=device)
        out, weights = [], []
        for i in range(steps):
            if vocab is not None and vocab < logits.size(-1):
                logits = logits[:, :vocab]
            token = sample_next(logits, temperature, top_k or None, None, generator)  # (G, 1)
            weights.append((~done).float())
            token = token.masked_fill(done.unsqueeze(1), end)
            out.append(token)
            done |= token.squeeze(1) == end
            if bool(done.all()) or i == steps - 1:
                break
            logits = rows.feed(token)
    return Group(prompt, torch.cat(out, dim=1), torch.stack(weights, dim=1), done)

"""The policy-gradient objective of GRPO-style RL: each answer's advantage (its reward minus its group's mean,
divided by the group's standard deviation when asked), and the loss on the answers' tokens only, normalised per
token over the whole batch (every process's), with the clipped probability ratio to the policy that sampled them
and an optional KL penalty to the starting model (the k3 estimate, exp(ref - logp) - (ref - logp) - 1)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gptforge.model.cache import KVCache
from gptforge.model.gpt import GPT
from gptforge.rl.rollout import right_padded

STD_EPS = 1e-4  # added to a group's standard deviation (TRL's value): a group of equal rewards divides by it


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> torch.Tensor:
    """rewards (N,), N a multiple of group, each group's answers side by side -> advantages (N,)."""
    r = rewards.view(-1, group).double()
    advantages = r - r.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (r.std(dim=1, keepdim=True) + STD_EPS)
    return advantages.view(-1).float()


def answer_logprobs(model: GPT, sequences: torch.Tensor, starts: torch.Tensor | int, length: int) -> torch.Tensor:
    """(B, length) log-probability of each answer token under the model, float32: row b of sequences (B, T) is its
    prompt (starts[b] tokens), then its answer, then any padding. The logits are computed at the answers' positions
    only: the prompt's tokens predict nothing that is scored."""
    B = sequences.size(0)
    starts = torch.as_tensor(starts, device=sequences.device).expand(B)
    hidden = model.hidden_states(sequences[:, :-1])  # (B, T - 1, C)
    where = (starts[:, None] - 1 + torch.arange(length, device=sequences.device)).clamp(max=hidden.size(1) - 1)
    picked = torch.gather(hidden, 1, where.unsqueeze(2).expand(-1, -1, hidden.size(2)))  # (B, length, C)
    logits = model.logits(picked).float()  # (B, length, V): the positions predicting answer tokens
    targets = torch.gather(sequences, 1, (where + 1).clamp(max=sequences.size(1) - 1))
    return torch.gather(F.log_softmax(logits, dim=-1), 2, targets.unsqueeze(2)).squeeze(2)


def groups_logprobs(model: GPT, prompts: list[list[int]], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """answer_logprobs of several groups' answers, tokens[i] (G, A_i) answering prompts[i], each prompt run once: the
    prompts as one right-padded batch whose keys and values (kept in the graph, so the prompts' tokens get the
    gradient their answers send back) are shared by their groups' rows, which then run only their own answer
    tokens, each at its own positions and seeing only its own prompt. Returns one (G, A_i) tensor a group."""
    device, n, G = tokens[0].device, len(prompts), tokens[0].size(0)
    batch, lengths = right_padded(prompts, device)
    width, A = batch.size(1), max(t.size(1) for t in tokens)
    cache = KVCache(model.config.n_layer, width)
    hidden = model.hidden_states(batch, cache=cache)  # (n, width, C): padding after each prompt sees only its past
    logits = model.logits(hidden[torch.arange(n, device=device), lengths - 1]).float()  # (n, V)
    logits = logits.repeat_interleave(G, 0).unsqueeze(1)  # (n G, 1, V): what predicts each answer's first token
    answers = torch.cat([F.pad(t, (0, A - t.size(1)), value=int(t[0, -1])) for t in tokens])  # (n G, A)
    if A > 1:
        starts = lengths.repeat_interleave(G)  # (n G,): each row's first answer position
        rows = KVCache(model.config.n_layer, width + A - 1)
        rows.k = [
            torch.cat([k.repeat_interleave(G, 0), k.new_zeros(n * G, k.size(1), A - 1, k.size(3))], 2) for k in cache.k
        ]
        rows.v = [
            torch.cat([v.repeat_interleave(G, 0), v.new_zeros(n * G, v.size(1), A - 1, v.size(3))], 2) for v in cache.v
        ]
        rows.position = width  # the answers' keys go after the widest prompt; their positions are their own
        t = torch.arange(A - 1, device=device)
        keys = torch.arange(width + A - 1, device=device)
        own_prompt = keys[None, None, :] < starts[:, None, None]
        own_past = (keys[None, None, :] >= width) & (keys[None, None, :] - width <= t[None, :, None])
        mask = (own_prompt | own_past).unsqueeze(1)  # (n G, 1, A - 1, keys)
        positions = starts[:, None] + t  # (n G, A - 1)
        rest = model.hidden_states(answers[:, :-1], cache=rows, positions=positions, mask=mask)
        logits = torch.cat([logits, model.logits(rest).float()], dim=1)  # (n G, A, V)
    logp = torch.gather(F.log_softmax(logits, dim=-1), 2, answers.unsqueeze(2)).squeeze(2)
    return [logp[i * G : (i + 1) * G, : t.size(1)] for i, t in enumerate(tokens)]


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    total_tokens: float,
    epsilon: float,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This micro-batch's share of the batch loss: sum over its weighted tokens of
    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + beta * KL, divided by total_tokens (the batch's weighted
    tokens over all micro-batches and processes). logp, old_logp, ref_logp, weights: (B, A); advantages (B,).
    Returns (loss, the KL summed over the weighted tokens, for the record)."""
    ratio = torch.exp(logp - old_logp)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * a, ratio.clamp(1.0 - epsilon, 1.0 + epsilon) * a)
    kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        delta = ref_logp - logp
        per_kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + beta * per_kl
        kl = (per_kl.detach() * weights).sum()
    return (per_token * weights).sum() / total_tokens, kl

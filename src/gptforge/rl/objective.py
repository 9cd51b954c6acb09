"""The policy-gradient objective of GRPO-style RL: each answer's advantage (its reward minus its group's mean,
divided by the group's standard deviation when asked), and the loss on the answers' tokens only, normalised per
token over the whole batch (every process's), with the clipped probability ratio to the policy that sampled them
and an optional KL penalty to the starting model (the k3 estimate, exp(ref - logp) - (ref - logp) - 1)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gptforge.model.gpt import GPT

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


def stack_answers(groups: list, picks: list[tuple[int, int]], pad: int) -> tuple[torch.Tensor, ...]:
    """Rows (group, row) of several groups as one batch: (sequences (B, T) right-padded with `pad`, starts (B,),
    weights (B, A)), A the longest answer among them."""
    length = max(groups[i].tokens.size(1) for i, _ in picks)
    width = max(len(groups[i].prompt) for i, _ in picks) + length
    device = groups[0].tokens.device
    sequences = torch.full((len(picks), width), pad, dtype=torch.long, device=device)
    weights = torch.zeros(len(picks), length, device=device)
    for b, (i, r) in enumerate(picks):
        prompt, answer = groups[i].prompt, groups[i].tokens[r]
        sequences[b, : len(prompt)] = torch.tensor(prompt, device=device)
        sequences[b, len(prompt) : len(prompt) + answer.size(0)] = answer
        weights[b, : answer.size(0)] = groups[i].weights[r]
    starts = torch.tensor([len(groups[i].prompt) for i, _ in picks], device=device)
    return sequences, starts, weights


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

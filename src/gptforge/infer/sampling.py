"""How one row of a batch picks its next token: penalties on the tokens it has seen (a repetition penalty as
CTRL's, OpenAI's frequency and presence penalties), then the engine's sampling rule (temperature, top-k, top-p) with
the row's own seeded generator, so a row draws the same tokens whatever other rows share its model step. Also the
log-probabilities OpenAI's API reports: the model's own distribution, before any penalty or temperature."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from gptforge.infer.engine import sample_next


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None  # None or 0: every token
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # > 1: a token already in the prompt or the answer is less likely (CTRL)
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often the answer has the token
    presence_penalty: float = 0.0  # OpenAI's: minus this once the answer has the token
    seed: int | None = None  # None: a fresh random seed
    logprobs: int | None = None  # report the chosen token's log-probability and this many alternatives

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass
class Choice:
    """A picked token and, when asked for, its log-probability and the likeliest alternatives (id, logprob)."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


class RowSampler:
    """One row's rule: its parameters, its generator and, with penalties, counts of the tokens it has seen."""

    def __init__(self, params: SamplingParams, vocab: int, device: str, context: Sequence[int] = ()):
        self.params, self.vocab = params, vocab
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seen = self.counts = None
        if params.penalized:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            ids = torch.tensor([i for i in context if 0 <= i < vocab], dtype=torch.long, device=device)
            self.seen[ids] = True

    @property
    def greedy_plain(self) -> bool:
        """Argmax of the raw logits: a batch of such rows is decided in one operation."""
        p = self.params
        return p.temperature <= 0 and not p.penalized and p.logprobs is None

    def choose(self, logits: torch.Tensor) -> Choice:
        """logits (V,) float32, already cut to the vocabulary."""
        p = self.params
        raw = logits
        if p.penalized:
            logits = penalize(logits, self.seen, self.counts, p)
        token = int(sample_next(logits[None], p.temperature, p.top_k or None, p.top_p, self.generator))
        if self.seen is not None:
            self.seen[token] = True
            self.counts[token] += 1
        if p.logprobs is None:
            return Choice(token)
        logp = F.log_softmax(raw, dim=-1)
        return Choice(token, float(logp[token]), top_logprobs(logp, p.logprobs))


def penalize(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """CTRL's repetition penalty on every seen token (positive logits divided by it, negative ones multiplied),
    then OpenAI's frequency and presence penalties on the answer's own tokens."""
    out = logits
    if params.repetition_penalty != 1.0:
        scaled = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
        out = torch.where(seen, scaled, out)
    if params.frequency_penalty or params.presence_penalty:
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return out


def top_logprobs(logp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logp, min(k, logp.size(-1)))
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def choose_rows(logits: torch.Tensor, samplers: Sequence[RowSampler]) -> list[Choice]:
    """Each row's next token from logits (B, V): plain greedy rows by one argmax, the others one by one."""
    plain = [s.greedy_plain for s in samplers]
    greedy = logits.argmax(dim=-1).tolist() if any(plain) else None
    return [Choice(greedy[i]) if plain[i] else s.choose(logits[i]) for i, s in enumerate(samplers)]

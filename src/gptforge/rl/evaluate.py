"""Held-out evaluation during RL (rank 0), never trained on, answered greedily: eval_examples problems per kind, the
same problems, tools and scores as `gptforge eval chat --kinds=KINDS --examples=N --seed=SEED --tools=TOOLS`
(pass@1); or the first eval_examples prompts of --eval_prompts, scored with the run's reward (pass@1: their mean
reward). The first eval_pass_k of each kind (or of the file) also get num_generations sampled answers at the run's
temperature (pass@k: any scored above 0, and the sampled answers' mean), each prompt from its own generator, the
same draws at every evaluation."""

from __future__ import annotations

from typing import Any

import torch

from gptforge.chat.synthetic import generate
from gptforge.core.distributed import DistEnv
from gptforge.evaluate.chat import task_accuracy
from gptforge.rl.options import RLConfig
from gptforge.rl.rewards import Prompt, as_prompt, score
from gptforge.rl.rollout import sample_groups
from gptforge.rl.start import Start


def evaluate(cfg: RLConfig, start: Start, ctx, env: DistEnv, step: int) -> dict[str, Any]:
    """{'pass_at_1', 'pass_at_1_KIND'..., 'ended', and with eval_pass_k: 'pass_at_G', 'sampled_pass_at_1'}; {} for
    a run on a prompts file without --eval_prompts (its problems have no held-out split)."""
    if not cfg.eval_examples or (cfg.prompts and not cfg.eval_prompts):
        return {}
    if start.source.held_out is not None:
        prompts = start.source.held_out[: cfg.eval_examples]
        answers = _answers(cfg, start, ctx, env, prompts, 1, temperature=0.0)
        rewards = [score(start.reward, p, start.answer_text(a[0][0])) for p, a in zip(prompts, answers, strict=True)]
        out: dict[str, Any] = {"pass_at_1": sum(rewards) / len(prompts)}
        out["ended"] = sum(bool(a[0][1]) for a in answers) / len(prompts)
        head = prompts[: cfg.eval_pass_k]
    else:
        kinds = [k for k in cfg.kinds.split(",") if k]
        problems = generate(max(cfg.eval_examples, cfg.eval_pass_k) * len(kinds), cfg.seed, "held_out", kinds=kinds)
        result = task_accuracy(
            start.model, start.tokenizer, problems[: cfg.eval_examples * len(kinds)], env.device, ctx,
            cfg.max_completion_length, tools=start.tools,
        )  # fmt: skip
        out = {"pass_at_1": result["acc"], **{f"pass_at_1_{k}": result[f"acc_{k}"] for k in kinds}}
        out["ended"] = result["ended"]
        head = [as_prompt(e) for e in problems[: cfg.eval_pass_k * len(kinds)]]
    if head:
        out.update(pass_at_k(cfg, start, ctx, env, head))
    return out


def pass_at_k(cfg: RLConfig, start: Start, ctx, env: DistEnv, prompts: list[Prompt]) -> dict[str, float]:
    """num_generations sampled answers to each prompt: the share of prompts with one scored above 0, and the mean."""
    answers = _answers(cfg, start, ctx, env, prompts, cfg.num_generations, cfg.temperature)
    any_right, total = 0, 0.0
    for prompt, group in zip(prompts, answers, strict=True):
        scores = [score(start.reward, prompt, start.answer_text(tokens)) for tokens, _ in group]
        any_right += max(scores) > 0
        total += sum(scores)
    n = len(prompts)
    return {f"pass_at_{cfg.num_generations}": any_right / n, "sampled_pass_at_1": total / (n * cfg.num_generations)}


def _answers(cfg: RLConfig, start: Start, ctx, env: DistEnv, prompts: list[Prompt], group: int, temperature: float):
    """Per prompt, `group` (answer tokens, ended) pairs, sampled together in batches of prompts_per_step prompts;
    prompt i draws from a generator seeded by (seed, i), whatever else shares its batch."""
    out = []
    for first in range(0, len(prompts), cfg.prompts_per_step):
        batch = prompts[first : first + cfg.prompts_per_step]
        seeds = [(cfg.seed + 7) * 1_000_003 + first + i for i in range(len(batch))]
        groups = sample_groups(
            start.model, [start.prompt_ids(p) for p in batch], group, cfg.max_completion_length, start.end,
            [torch.Generator(env.device).manual_seed(s) for s in seeds], temperature, cfg.top_k, ctx, start.vocab,
            start.watcher,
        )  # fmt: skip
        out += [[(g.answer(r), bool(g.ended[r])) for r in range(group)] for g in groups]
    return out

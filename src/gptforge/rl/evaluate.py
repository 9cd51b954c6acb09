"""Held-out evaluation during RL (rank 0): eval_examples problems per kind, never trained on, answered greedily, the
same problems as `gptforge eval chat --kinds=KINDS --examples=N --seed=SEED --tools=none` (pass@1); and for the
first eval_pass_k of each kind num_generations sampled answers at the run's temperature (pass@k: any right, and
the sampled answers' mean)."""

from __future__ import annotations

from typing import Any

import torch

from gptforge.chat.synthetic import generate
from gptforge.core.distributed import DistEnv
from gptforge.evaluate.chat import task_accuracy
from gptforge.rl.options import RLConfig
from gptforge.rl.rewards import exact_match, synthetic_prompts
from gptforge.rl.rollout import sample_group
from gptforge.rl.start import Start


def evaluate(cfg: RLConfig, start: Start, ctx, env: DistEnv, step: int) -> dict[str, Any]:
    """{'pass_at_1', 'pass_at_1_KIND'..., and with eval_pass_k: 'pass_at_k', 'sampled_pass_at_1'}; {} for a run on
    a prompts file (its problems have no held-out split)."""
    if cfg.prompts or not cfg.eval_examples:
        return {}
    kinds = [k for k in cfg.kinds.split(",") if k]
    problems = generate(cfg.eval_examples * len(kinds), cfg.seed, "held_out", kinds=kinds)
    result = task_accuracy(start.model, start.tokenizer, problems, env.device, ctx, cfg.max_completion_length)
    out: dict[str, Any] = {"pass_at_1": result["acc"], **{f"pass_at_1_{k}": result[f"acc_{k}"] for k in kinds}}
    out["ended"] = result["ended"]
    if cfg.eval_pass_k:
        out.update(pass_at_k(cfg, start, ctx, env, kinds))
    return out


def pass_at_k(cfg: RLConfig, start: Start, ctx, env: DistEnv, kinds: list[str]) -> dict[str, float]:
    n = cfg.eval_pass_k * len(kinds)
    prompts = synthetic_prompts(n, cfg.seed, "held_out", kinds)
    generator = torch.Generator(env.device).manual_seed(cfg.seed + 7)  # the same draws at every evaluation
    any_right, right = 0, 0
    for prompt in prompts:
        group = sample_group(
            start.model, start.prompt_ids(prompt.messages), cfg.num_generations, cfg.max_completion_length,
            start.end, generator, cfg.temperature, cfg.top_k, ctx,
        )  # fmt: skip
        scores = [
            exact_match([], start.tokenizer.decode(group.answer(i)), prompt.example) for i in range(len(group.ended))
        ]
        any_right += max(scores) > 0
        right += sum(scores)
    return {f"pass_at_{cfg.num_generations}": any_right / n, "sampled_pass_at_1": right / (n * cfg.num_generations)}

"""`gptforge rl`: the loop. Each step draws prompts, samples a group of answers to each (rl/rollout.py), scores them
(rl/rewards.py), turns the rewards into advantages and takes num_iterations optimizer steps on the answers' tokens
(rl/objective.py). At the head of a step: the held-out evaluation, the checkpoint, a stop request (Ctrl-C,
SIGTERM). Under torchrun each process samples its share of the prompts and the gradients are summed over them."""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gptforge.core.device import autocast_context, inference_dtype
from gptforge.core.distributed import DistEnv, StopFlag, setup_distributed, teardown
from gptforge.rl.evaluate import evaluate
from gptforge.rl.objective import group_advantages, groups_logprobs, policy_loss
from gptforge.rl.options import RLConfig
from gptforge.rl.rewards import score
from gptforge.rl.rollout import Group, sample_groups
from gptforge.rl.start import RL_CONFIG, Start, begin, save
from gptforge.train.metrics import Metrics, write_config


@dataclass
class Batch:
    """One step's sampled answers on this process: the groups, their rewards (G each, side by side) and texts."""

    groups: list[Group] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    seconds: float = 0.0


def rl(cfg: RLConfig) -> dict[str, Any]:
    """Run RL as configured; returns the last step's record and the last evaluation."""
    env = setup_distributed(cfg.device, cfg.backend)
    try:
        return _rl(cfg, env)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        teardown(env)


def _rl(cfg: RLConfig, env: DistEnv) -> dict[str, Any]:
    start = begin(cfg, env)
    dtype = inference_dtype(cfg.dtype, env.device_type, start.model.config.n_embd)
    ctx = autocast_context(env.device_type, dtype)
    if env.is_main:
        write_config(cfg, RL_CONFIG)  # the first writes, after every check
    metrics = Metrics(cfg.out_dir, enabled=env.is_main, resume_step=start.step if start.step else None)
    env.say(
        f"RL from {cfg.init_from}: {start.model.get_num_params() / 1e6:.2f}M parameters, device {env.device}, dtype "
        f"{dtype}, {env.world_size} process(es); {cfg.prompts_per_step} prompts x {cfg.num_generations} answers a "
        f"step, {cfg.max_steps} steps; prompts: {cfg.prompts or cfg.kinds}; reward: {cfg.reward or 'exact match'}"
    )
    last: dict[str, Any] = {}
    evaluated: dict[str, Any] = {}
    ema = None
    with StopFlag(env) as stop, contextlib.closing(metrics):
        step = start.step
        while True:
            done = step >= cfg.max_steps
            if env.is_main and cfg.eval_interval and (step % cfg.eval_interval == 0 or done) and not stop.requested:
                evaluated = evaluate(cfg, start, ctx, env, step)
                metrics.log(step, "rl_eval", **evaluated)
            if step > start.step and (step % cfg.ckpt_interval == 0 or done or stop.requested):
                if env.is_main:
                    save(cfg, start, step)
                    metrics.info(f"saved checkpoint ckpt.pt in {cfg.out_dir} at step {step}")
            if done:
                metrics.log(step, "end", reason="max_steps reached")
                break
            if stop.requested:
                metrics.info(f"stopped at step {step}; run the same command to continue")
                break
            t0 = time.perf_counter()
            last = rl_step(cfg, start, ctx, env, step)
            seconds = time.perf_counter() - t0
            ema = seconds if ema is None else 0.8 * ema + 0.2 * seconds
            last.update(step_s=seconds, eta_s=ema * (cfg.max_steps - step - 1))
            if step % cfg.log_interval == 0:
                metrics.log(step, "rl", **last)
            step += 1
            stop.sync()
    if env.ddp:
        dist.barrier()
    return {**last, **{f"eval_{k}": v for k, v in evaluated.items()}, "step": step}


def rl_step(cfg: RLConfig, start: Start, ctx, env: DistEnv, step: int) -> dict[str, Any]:
    """Sample, score, update. Returns the step's record (over all processes)."""
    batch = sample_batch(cfg, start, ctx, env, step)
    rewards = torch.tensor(batch.rewards)
    advantages = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards == "group")
    lr = learning_rate(cfg, step)
    for group in start.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's matrices: muon_lr's share of the schedule
    tokens = torch.tensor([sum(float(g.weights.sum()) for g in batch.groups)], dtype=torch.float64)
    sums = reduce_sum(torch.cat([tokens, rewards.sum().double().view(1)]), env)
    loss, kl, norm = update(cfg, start, ctx, env, batch, advantages, float(sums[0]))
    passed = rewards.view(-1, cfg.num_generations) > 0
    called = sum(n > 0 for g in batch.groups for n in g.calls)
    counts = reduce_sum(
        torch.tensor([passed.float().sum(), passed.any(1).float().sum(), len(batch.groups), batch.seconds, called]),
        env,
    )
    answers = counts[2] * cfg.num_generations
    return {
        "reward": float(sums[1] / answers),
        "pass_at_1": float(counts[0] / answers),
        f"pass_at_{cfg.num_generations}": float(counts[1] / counts[2]),
        "answer_tokens": float(sums[0] / answers),
        "tool_calls": float(counts[4] / answers),
        "loss": loss,
        "kl": kl / float(sums[0]),
        "grad_norm": norm,
        "sampled_tokens_per_s": float(sums[0]) / max(float(counts[3]) / env.world_size, 1e-9),
        "lr": lr,
    }


def sample_batch(cfg: RLConfig, start: Start, ctx, env: DistEnv, step: int) -> Batch:
    """This process's prompts of the step, num_generations answers to each, and their rewards."""
    t0 = time.perf_counter()
    prompts = start.source.step(step, cfg.prompts_per_step)
    mine = list(range(env.rank, len(prompts), env.world_size))  # this process's share
    # a generator per prompt, seeded by (seed, step, prompt): the same answers on any number of processes
    generators = [torch.Generator(env.device).manual_seed((cfg.seed * 1_000_003 + step) * 100_003 + n) for n in mine]
    ids = [start.prompt_ids(prompts[n]) for n in mine]
    sampled: dict[int, Group] = {}
    # prompts of like lengths sampled together: one long prompt (a function's schema) would widen every row's cache
    for bucket in length_chunks([len(p) for p in ids], len(ids)):
        sampled.update(zip(bucket, sample_groups(
            start.model, [ids[i] for i in bucket], cfg.num_generations, cfg.max_completion_length, start.end,
            [generators[i] for i in bucket], cfg.temperature, cfg.top_k, ctx, start.vocab, start.watcher,
        ), strict=True))  # fmt: skip
    batch = Batch([sampled[i] for i in range(len(mine))])
    for n, group in zip(mine, batch.groups, strict=True):
        texts = [start.answer_text(group.answer(i)) for i in range(cfg.num_generations)]
        batch.rewards += [score(start.reward, prompts[n], text) for text in texts]
    batch.seconds = time.perf_counter() - t0
    return batch


def update(cfg: RLConfig, start: Start, ctx, env: DistEnv, batch: Batch, advantages, total: float):
    """num_iterations optimizer steps on the batch, whole groups (up to micro_batch_rows answers) a forward and
    backward pass, each prompt run once; returns (the first pass's loss, its KL sum, its grad norm)."""
    G, groups = cfg.num_generations, batch.groups
    per = max(1, cfg.micro_batch_rows // G) if cfg.micro_batch_rows else len(groups)
    chunks = length_chunks([g.tokens.size(1) for g in groups], per)
    old = [_logprobs(start.model, groups, c, ctx, no_grad=True) for c in chunks] if cfg.num_iterations > 1 else None
    ref = [_logprobs(start.reference, groups, c, ctx, no_grad=True) for c in chunks] if start.reference else None
    first = None
    for _ in range(cfg.num_iterations):
        start.optimizer.zero_grad(set_to_none=True)
        loss_sum, kl_sum = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for n, chunk in enumerate(chunks):
            loss = torch.zeros((), device=groups[0].tokens.device)
            for m, (i, logp) in enumerate(zip(chunk, _logprobs(start.model, groups, chunk, ctx), strict=True)):
                part, kl = policy_loss(
                    logp, old[n][m] if old else logp.detach(), advantages[i * G : (i + 1) * G], groups[i].weights,
                    total, cfg.epsilon, ref[n][m] if ref else None, cfg.beta,
                )  # fmt: skip
                loss, kl_sum = loss + part, kl_sum + kl.double().cpu()
            loss.backward()
            loss_sum = loss_sum + loss.detach().double().cpu()
        norm = sync_and_clip(start.model, cfg.grad_clip, env)
        start.optimizer.step()
        if first is None:
            sums = reduce_sum(torch.stack([loss_sum, kl_sum]), env)
            first = (float(sums[0]), float(sums[1]), norm)
    start.optimizer.zero_grad(set_to_none=True)
    return first


def length_chunks(widths: list[int], per: int) -> list[list[int]]:
    """The groups (by index) of each forward and backward pass: in order of their answers' width, at most `per` a
    pass, and a new pass where a group's answers are more than twice as wide as the pass's first: a pass pads every
    answer to its widest, so a few long answers (a spelt word) do not make all the short ones (a number) pay for
    their length. The loss is a sum over groups, so the passes change nothing but the order of the additions."""
    chunks: list[list[int]] = []
    for i in sorted(range(len(widths)), key=lambda i: (widths[i], i)):
        if not chunks or len(chunks[-1]) == per or widths[i] > 2 * widths[chunks[-1][0]]:
            chunks.append([])
        chunks[-1].append(i)
    return chunks


def _logprobs(model, groups: list[Group], chunk: list[int], ctx, no_grad: bool = False) -> list[torch.Tensor]:
    with torch.set_grad_enabled(not no_grad), ctx:
        return groups_logprobs(model, [groups[i].prompt for i in chunk], [groups[i].tokens for i in chunk])


def sync_and_clip(model, grad_clip: float, env: DistEnv) -> float:
    """Sum the gradients over the processes (each loss is already divided by the whole batch's tokens), clip them;
    returns the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if env.ddp:
        for p in params:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip or math.inf)
    return float(norm)


def reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.ddp:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def learning_rate(cfg: RLConfig, step: int) -> float:
    """Linear warm-up over warmup_steps, then constant or linear down to 0 at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    return cfg.learning_rate * (cfg.max_steps - step) / max(1, cfg.max_steps - cfg.warmup_steps)

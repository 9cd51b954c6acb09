"""`gptforge bench CONFIG --target_loss=X [--compare=OTHER]`: how long a recipe's run from scratch takes to reach a
val loss. The real training step (train.setup / train_step, with the config's schedule) runs until the loss on a
fixed held-out set (`HeldOut`) first reaches X; the wall time counts the training steps only, not these
evaluations. `--target_bpb=X` races to bits per byte instead, which compares runs whose tokenizers differ (each on
its own dataset's held-out text: prepare both from the same text and split). `--seeds=A,B,C` runs each config once
per seed and reports the median time and its range. docs/RECIPES.md has the figures."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gptforge.core.config import TrainConfig
from gptforge.core.console import log
from gptforge.core.distributed import setup_distributed, teardown
from gptforge.core.errors import UserError
from gptforge.data.loader import DTYPES, dataset_dir, open_tokens, read_meta, split_files
from gptforge.model.cache import evaluating
from gptforge.model.gpt import GPT
from gptforge.tokenizer.spec import from_spec, token_byte_table, tokenizer_spec
from gptforge.train.loop import apply_lr, train_step
from gptforge.train.setup import setup

SCREEN_EVERY = 8  # a cheap first look on every 8th window ...
SCREEN_Z = 3.0  # ... and the whole set only when the screen may have reached the target (within 3 of its std errors)
PROGRESS_S = 10.0  # a progress line at least this often


class HeldOut:
    """Consecutive, non-overlapping block_size windows from the start of the val split: the same tokens at every
    evaluation and for every config of one block_size; each position is scored once, as in a random window."""

    def __init__(self, folder: str, meta: dict[str, Any], block_size: int, eval_tokens: int, device: str):
        parts, have = [], 0
        for path in split_files(folder, "val", meta):
            parts.append(np.asarray(open_tokens(path, meta["dtype"])[: eval_tokens + 1 - have]))
            have += len(parts[-1])
            if have > eval_tokens:
                break
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=DTYPES[meta["dtype"]])
        n = min(eval_tokens, len(tokens) - 1) // block_size
        if n < 1:
            raise UserError(
                f"{folder}: the val split has {len(tokens)} tokens, fewer than one block_size ({block_size}) + 1: "
                "prepare a dataset with more validation text"
            )
        data = torch.from_numpy(tokens[: n * block_size + 1].astype(np.int64))
        self.x = data[:-1].view(n, block_size).to(device)
        self.y = data[1:].view(n, block_size).to(device)
        self.window_bytes, self.no_bytes = None, ""  # (n,) the bytes of text each window's targets stand for
        try:
            lengths = torch.tensor(token_byte_table(from_spec(tokenizer_spec(meta))), dtype=torch.float64)
            self.window_bytes = lengths[self.y.cpu()].sum(1)
        except UserError as e:  # GPT-2's BPE offline without tiktoken's files: the loss alone
            self.no_bytes = str(e)

    @property
    def tokens(self) -> int:
        return self.x.numel()

    @property
    def bytes(self) -> int:
        return int(self.window_bytes.sum()) if self.window_bytes is not None else 0

    def loss(self, model: GPT, ctx: contextlib.AbstractContextManager, batch_size: int, screen: bool = False):
        """(mean loss per token, its standard error from the per-window means) in eval mode; `screen`: every
        SCREEN_EVERY-th window only."""
        return self.measure(model, ctx, batch_size, screen)["loss"]

    def measure(self, model: GPT, ctx: contextlib.AbstractContextManager, batch_size: int, screen: bool = False):
        """{"loss": (mean loss per token, its standard error), "bpb": (bits per byte, its standard error)} from one
        pass. bpb = the windows' summed loss in nats / (ln 2 x their summed bytes); its standard error is the
        ratio estimator's (the windows' nats less bpb's share of their bytes, spread over the windows)."""
        rows = torch.arange(0, len(self.x), SCREEN_EVERY if screen else 1)
        losses = self._window_losses(model, ctx, batch_size, rows)
        k = len(losses)
        se = losses.std().item() / math.sqrt(k) if k > 1 else math.inf
        if self.window_bytes is None:
            return {"loss": (losses.mean().item(), se), "bpb": (math.nan, math.inf)}
        nats, n_bytes = losses * self.x.shape[1], self.window_bytes[rows]
        ratio = nats.sum().item() / n_bytes.sum().item() if n_bytes.sum() > 0 else math.nan
        spread = (nats - ratio * n_bytes).std().item() / math.sqrt(k) if k > 1 else math.inf
        bpb_se = spread / (n_bytes.mean().item() * math.log(2)) if n_bytes.sum() > 0 else math.inf
        return {"loss": (losses.mean().item(), se), "bpb": (ratio / math.log(2), bpb_se)}

    @torch.no_grad()
    def _window_losses(self, model: GPT, ctx: contextlib.AbstractContextManager, batch_size: int, rows: torch.Tensor):
        """The mean loss per token of each window in `rows` (float64, on the CPU), in eval mode."""
        per_window = []
        with evaluating(model):
            for i in range(0, len(rows), batch_size):
                x, y = self.x[rows[i : i + batch_size]], self.y[rows[i : i + batch_size]]
                with ctx:
                    logits = model.logits(model.hidden_states(x))
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
                per_window.append(loss.view(len(x), -1).mean(1).cpu())
        return torch.cat(per_window).double()


def bench_cfg(cfg: TrainConfig, out_dir: str) -> TrainConfig:
    """The config as a throw-away run: from scratch, into out_dir, with nothing on the side (its own evaluations,
    checkpoints, samples, HellaSwag, wandb, dashboard) that would cost time the recipe's steps do not."""
    return dataclasses.replace(
        cfg,
        out_dir=out_dir,
        init_from="scratch",
        eval_only=False,
        always_save_checkpoint=False,
        ckpt_interval=0,
        sample_interval=0,
        hellaswag_interval=0,
        wandb_log=False,
        tensorboard_log=False,
        dashboard=False,
    )


def run_to_target(
    cfg: TrainConfig,
    name: str,
    target: float,
    eval_every: int,
    eval_tokens: int,
    max_seconds: float,
    metric: str = "loss",
) -> dict[str, Any]:
    """Train `cfg` from scratch until the held-out `metric` ('loss' or 'bpb') is <= target, max_iters ends, or
    max_seconds of training."""
    env = setup_distributed(cfg.device, cfg.backend)
    try:
        if env.ddp:
            raise UserError(f"bench --target_{metric} runs one process; start it without torchrun")
        with tempfile.TemporaryDirectory(prefix="gptforge-bench-") as tmp:
            with contextlib.redirect_stdout(sys.stderr):  # the run's own lines are progress, not the result
                run = setup(bench_cfg(cfg, os.path.join(tmp, "run")), env)
            assert run is not None, "a run from scratch always starts"
            with run.cleanup:
                return _train_to_target(run, name, (metric, target), eval_every, eval_tokens, max_seconds)
    finally:
        teardown(env)
        gc.collect()


def _check(held_out: HeldOut, run, metric: str, target: float, ending: bool) -> dict[str, Any]:
    """One check of the held-out set: the screen (every SCREEN_EVERY-th window; se None), and the whole set when
    the screen is within SCREEN_Z of its own standard errors of the target (a step that reaches the target is
    screened out with a chance of ~1 in 700) or the run ends. Both figures come from the same pass."""
    batch = max(1, run.cfg.batch_size * run.accum)
    figures = held_out.measure(run.raw_model, run.ctx, batch, screen=True)
    se = None
    value, screen_se = figures[metric]
    if value - SCREEN_Z * screen_se <= target or ending:
        figures = held_out.measure(run.raw_model, run.ctx, batch)
        se = figures[metric][1]
    return {"val_loss": figures["loss"][0], "val_bpb": figures["bpb"][0], "se": se}


def _train_to_target(run, name: str, goal: tuple[str, float], every: int, eval_tokens: int, max_seconds: float):
    (metric, target), cfg = goal, run.cfg
    folder = dataset_dir(cfg.data_dir, cfg.dataset)
    held_out = HeldOut(folder, read_meta(folder), cfg.block_size, eval_tokens, cfg.device)
    if metric == "bpb" and held_out.window_bytes is None:
        raise UserError(f"--target_bpb needs the bytes each token stands for: {held_out.no_bytes}")
    train_s, curve, best, result = 0.0, [], (math.inf, 0), None
    last_line = time.perf_counter()
    step = 0
    while True:
        ending = step >= cfg.max_iters or train_s >= max_seconds
        if step % every == 0 or ending:
            check = _check(held_out, run, metric, target, ending)
            value, se = check[f"val_{metric}"], check["se"]
            if se is not None:
                best = min(best, (value, step))
            curve.append({"step": step, "seconds": train_s, **check})
            if se is not None and value <= target:
                result = "reached"
            elif step >= cfg.max_iters:
                result = "max_iters"
            elif train_s >= max_seconds:
                result = "max_seconds"
            now = time.perf_counter()
            if result or se is not None or step == 0 or now - last_line >= PROGRESS_S:
                what = f"val {'bpb ' if metric == 'bpb' else ''}{value:.4f}"
                what += f" +- {se:.4f}" if se is not None else " (screen)"
                log(f"  {name}: step {step}/{cfg.max_iters}, {train_s:.1f}s of training, {what}, target {target}")
                last_line = now
            if result:
                break
        t0 = time.perf_counter()
        apply_lr(run, step)
        run.iter_num = step  # what a skipped step's record names
        _, _, finite = train_step(run)
        train_s += time.perf_counter() - t0
        step += 1
        if not finite:
            log(f"  {name}: step {step - 1} skipped (loss or gradient not finite)")
    last = curve[-1]  # always a full evaluation: the last check is one
    return {
        "name": name,
        "reached": result == "reached",
        "stopped": result,
        "seconds": train_s,
        "steps": step,
        "tokens": run.tokens_before(step),
        "val_loss": last["val_loss"],
        "val_bpb": last["val_bpb"],
        "se": last["se"],  # of the metric raced
        f"best_val_{metric}": best[0],
        "best_step": best[1],
        "eval_tokens": held_out.tokens,
        "eval_bytes": held_out.bytes,
        "eval_every": every,
        "curve": curve,
        "settings": {k: getattr(cfg, k) for k in ("dtype", "compile", "device", "optimizer")},
    }


def parse_seeds(text: str | None) -> list[int] | None:
    """--seeds=A,B,C as a list of distinct whole numbers >= 0; None when not given."""
    if text is None:
        return None
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or any(seed < 0 for seed in seeds):
        raise UserError(f"--seeds takes whole numbers >= 0 separated by commas, e.g. --seeds=1337,1,2; got {text!r}")
    if len(set(seeds)) < len(seeds):
        raise UserError(f"--seeds={text} names a seed twice: a seed's run is the same run again")
    return seeds


def run_time_to_loss(
    cfgs: list[tuple[str, TrainConfig]],
    target: float,
    eval_every: int | None,
    eval_tokens: int,
    max_seconds: float,
    as_json: bool,
    metric: str = "loss",
    seeds: list[int] | None = None,
) -> dict[str, Any]:
    """The command: each (name, config) in turn to the same target of `metric` (val 'loss' in nats per token, or
    'bpb', bits per byte), once with its own seed or once per seed of `seeds`; the first against the others as
    ratios (of the medians over the seeds)."""
    assert metric in ("loss", "bpb"), metric
    if not math.isfinite(target) or target <= 0:
        raise UserError(f"--target_{metric} must be a positive number, got {target}")
    if eval_tokens <= 0 or (eval_every is not None and eval_every <= 0) or max_seconds <= 0:
        raise UserError("--eval_every, --eval_tokens and --max_seconds must be positive")
    runs = []
    for name, cfg in cfgs:
        every = eval_every or max(1, cfg.max_iters // 100)
        what = "val loss" if metric == "loss" else "val bits per byte"
        for seed in seeds or [cfg.seed]:
            label = f"{name} seed {seed}" if seeds else name
            log(f"{label}: training from scratch until the {what} on the held-out set is {target} or less")
            seeded = dataclasses.replace(cfg, seed=seed)
            r = run_to_target(seeded, label, target, every, eval_tokens, max_seconds, metric)
            runs.append({**r, "config": name, "seed": seed})
    out: dict[str, Any] = {f"target_{metric}": target, "metric": metric, "runs": runs}
    if seeds:  # each config's median over its seeds, else its one run's
        out["seeds"] = seeds
        out["over_seeds"] = {name: _over_seeds([r for r in runs if r["config"] == name], metric) for name, _ in cfgs}
        seconds = {name: summary["seconds"] for name, summary in out["over_seeds"].items()}
    else:
        seconds = {r["config"]: r["seconds"] for r in runs}
    first, *others = seconds
    for other in others:
        out.setdefault("ratios", {})[other] = seconds[other] / seconds[first] if seconds[first] > 0 else math.inf
    if as_json:
        print(json.dumps(out))
        return out
    for r in runs:
        print(_summary(r, metric))
    for name, summary in out.get("over_seeds", {}).items():
        print(_over_seeds_line(name, summary))
    median = " median" if seeds else ""
    for other in others:
        runs_of = [r for r in runs if r["config"] in (first, other)]
        bound = "" if all(r["reached"] for r in runs_of) else " (a bound: a run did not reach the target)"
        print(f"{other} / {first}: {out['ratios'][other]:.2f}x the{median} wall time{bound}")
    return out


def _over_seeds(runs: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """One config's runs at several seeds: how many reached the target, the median and range of their training
    seconds and steps (a run that did not reach it counts all of its own), and the median final val figure."""
    seconds, steps = [r["seconds"] for r in runs], [r["steps"] for r in runs]
    return {
        "runs": len(runs),
        "reached": sum(r["reached"] for r in runs),
        "seconds": statistics.median(seconds),
        "seconds_range": [min(seconds), max(seconds)],
        "steps": statistics.median(steps),
        "steps_range": [min(steps), max(steps)],
        f"val_{metric}": statistics.median(r[f"val_{metric}"] for r in runs),
    }


def _over_seeds_line(name: str, s: dict[str, Any]) -> str:
    low, high = s["seconds_range"]
    first, last = s["steps_range"]
    return (
        f"{name} over {s['runs']} seeds: reached in {s['reached']} of {s['runs']}, {s['seconds']:.1f}s of training "
        f"(median; {low:.1f}-{high:.1f}s), {s['steps']:g} steps ({first}-{last})"
    )


def _summary(r: dict[str, Any], metric: str) -> str:
    """A run's result line: the raced figure (and for bpb the loss beside it), time, steps, tokens, settings."""
    best = r[f"best_val_{metric}"]
    where = "reached" if r["reached"] else f"NOT reached ({r['stopped']}; best {best:.4f})"
    value = f"val {r['val_loss']:.4f}" if metric == "loss" else f"val bpb {r['val_bpb']:.4f}"
    extra = "" if metric == "loss" else f" (loss {r['val_loss']:.4f})"
    held = f"{r['eval_tokens']:,} held-out tokens" + ("" if metric == "loss" else f" = {r['eval_bytes']:,} bytes")
    return (
        f"{r['name']}: {where} {value} +- {r['se']:.4f}{extra} in {r['seconds']:.1f}s of training, "
        f"{r['steps']} steps, {r['tokens']:,} tokens ({r['settings']['dtype']}, compile={r['settings']['compile']}"
        f", eval every {r['eval_every']} steps on {held})"
    )

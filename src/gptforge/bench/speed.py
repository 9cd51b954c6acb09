"""`gptforge bench`: throughput, MFU and memory of the real training step on random tokens (default settings, and
with --compare nanoGPT's float32 eager baseline, alternated in rounds), of generation and of tokenisation.
docs/PERFORMANCE.md has the figures and how to read them."""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gptforge.bench.profile import print_profile, profile_step
from gptforge.core.allocator import keep_freed_memory
from gptforge.core.config import TrainConfig
from gptforge.core.console import log
from gptforge.core.cpu import cpu_kind, cpu_product_rates, describe_cpu, measure_matmul_flops
from gptforge.core.device import (
    autocast_context,
    available_memory,
    ceiling_dtypes,
    configure_backends,
    device_type,
    dtype_reason,
    peak_flops,
    resolve_compile,
    resolve_device,
    resolve_dtype,
    resolve_fast_dropout,
    resolve_onednn_f32,
)
from gptforge.core.errors import UserError
from gptforge.core.memory import check_fits
from gptforge.core.shape import model_args, model_vocab_size
from gptforge.data.loader import read_meta
from gptforge.infer.engine import generate
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.optim import accumulate_gradients, configure_optimizer
from gptforge.tokenizer.gpt2 import GPT2_VOCAB
from gptforge.train.resolve import training_estimate
from gptforge.train.setup import muon_settings


class RandomTokens:
    """Uniform random (x, y) batches with RandomBatches' interface, from a private generator."""

    def __init__(self, batch_size: int, block_size: int, vocab_size: int, device: str):
        self.shape, self.vocab_size, self.device = (batch_size, block_size), vocab_size, device
        self.generator = torch.Generator().manual_seed(0)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.randint(self.vocab_size, (self.shape[0], self.shape[1] + 1), generator=self.generator)
        return buf[:, :-1].contiguous().to(self.device), buf[:, 1:].contiguous().to(self.device)

    def state_dict(self) -> dict[str, Any]:
        return {}


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> None:
    """Linux resets VmHWM to the current RSS when 5 is written to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


BASELINE = "float32, eager, nanoGPT's AdamW and torch's dropout: nanoGPT's train.py on this machine"


class Mode:
    """One way of running the step: a model, its optimizer and settings, ready to time."""

    def __init__(self, name: str, cfg: TrainConfig, device: str, vocab_size: int, fast: bool):
        """fast: the run's resolved defaults (dtype, compile, fused AdamW on CUDA, fast dropout masks, oneDNN's float32
        products), else nanoGPT's arithmetic (float32, eager, torch's default AdamW, torch's dropout and products)."""
        dev = device_type(device)
        self.name, self.device = name, device
        self.dtype = resolve_dtype(cfg.dtype, dev, cfg.n_embd, cfg.cpu_bf16_min_width) if fast else "float32"
        self.why = dtype_reason(cfg.dtype, self.dtype, dev, cfg.n_embd, cfg.cpu_bf16_min_width) if fast else ""
        self.compile = resolve_compile(cfg.compile, dev) if fast else False
        self.fast_dropout = fast and resolve_fast_dropout(cfg.fast_dropout, dev)
        self.onednn_f32 = fast and resolve_onednn_f32(cfg.onednn_f32, dev)
        fused = fast and dev == "cuda"
        torch.manual_seed(cfg.seed)  # both modes start from the same weights
        self.raw = GPT(GPTConfig(**model_args(cfg, vocab_size), dropout=cfg.dropout)).to(device)
        self.raw.use_fast_dropout(self.fast_dropout)
        self.raw.use_onednn_f32(self.onednn_f32)
        self.optimizer = configure_optimizer(
            self.raw,
            cfg.weight_decay,
            cfg.learning_rate,
            (cfg.beta1, cfg.beta2),
            "cuda" if fused else "cpu",
            muon_settings(cfg) if fast else None,  # the baseline is nanoGPT's AdamW (BASELINE)
            cfg.embedding_lr_scale if fast else 1.0,
        )
        self.model = torch.compile(self.raw) if self.compile else self.raw
        self.ctx = autocast_context(dev, self.dtype)
        self.scaler = torch.amp.GradScaler(dev, enabled=self.dtype == "float16")
        self.batches = RandomTokens(cfg.batch_size, cfg.block_size, vocab_size, device)
        self.accum, self.grad_clip = cfg.gradient_accumulation_steps, cfg.grad_clip
        self.batch = self.batches.next_batch()
        self.times: list[float] = []
        self.compile_s: float | None = None
        self.peak_mem = 0

    def step(self) -> float:
        t0 = time.perf_counter()
        loss, self.batch, _ = accumulate_gradients(
            self.model, self.batch, self.batches, self.accum, self.ctx, self.scaler
        )
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.raw.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # wait for the device
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def bench_training(
    cfg: TrainConfig, compare: bool, iters: int, warmup: int, rounds: int, profile: bool = False
) -> dict[str, Any]:
    device = resolve_device(cfg.device)
    dev_type = device_type(device)
    configure_backends(dev_type)
    vocab_size = _dataset_vocab(cfg)
    # the float32 baseline keeps the larger activations: estimate for it when it runs too
    dtype = "float32" if compare else resolve_dtype(cfg.dtype, dev_type, cfg.n_embd, cfg.cpu_bf16_min_width)
    args = model_args(cfg, vocab_size)
    fast, compiled = resolve_fast_dropout(cfg.fast_dropout, dev_type), resolve_compile(cfg.compile, dev_type)
    estimate = training_estimate(args, cfg.batch_size, dtype, cfg.optimizer, dev_type, cfg.dropout, fast, compiled)
    check_fits(estimate, *available_memory(device))
    log(f"memory: {estimate.describe()} estimated per mode\n{keep_freed_memory()}")
    default = Mode("default", cfg, device, vocab_size, fast=True)
    modes = [default]
    if compare:
        modes.append(Mode("baseline", cfg, device, vocab_size, fast=False))
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    params = f"{default.raw.get_num_params() / 1e6:.2f}M params"
    log(f"model {params}, {tokens_per_iter:,} tokens/iter on {device}; modes: {', '.join(map(describe_mode, modes))}")
    samples: dict[str, list[float]] = {dt: [] for dt in ceiling_dtypes(dev_type)}

    def sample_ceilings() -> None:
        for dt, rates in samples.items():
            rates.append(measure_matmul_flops(device, dt))

    time_modes(modes, device, warmup, iters, rounds, between=sample_ceilings)
    profiled = profile_step(default.step, device) if profile else None
    # a ceiling is the best rate the machine gives: a shared machine's products run slower at times (one bench
    # process has read 1,877 to 2,571 bf16 GFLOP/s on an AMX Xeon), so it is sampled after every round, in the
    # same minutes as the timed steps, and the best sample counts
    peaks = {dt: max(rates) for dt, rates in samples.items()}
    # train's MFU: against the machine's fastest ceiling, whatever format the mode runs in (on a CPU, the best one
    # measured just above), so a slower choice reads lower
    peak = peak_flops(device, cfg.peak_flops, measured=peaks)
    out: dict[str, Any] = {m.name: mode_result(m, tokens_per_iter, peak) for m in modes}
    if profiled is not None:
        out["profile"] = profiled
    if compare:
        out["speedup"] = out["default"]["tokens_per_s"] / out["baseline"]["tokens_per_s"]
        out["baseline_is"] = BASELINE
    out["device"] = device_info(device, peak, peaks, samples)
    return out


def describe_mode(m: Mode) -> str:
    onednn = ", onednn_f32=True" if m.onednn_f32 and m.dtype == "float32" else ""
    why = f" ({m.why})" if m.why else ""
    return f"{m.name} ({m.dtype}{why}, compile={m.compile}, fast_dropout={m.fast_dropout}{onednn})"


def mode_result(m: Mode, tokens_per_iter: int, peak: float) -> dict[str, Any]:
    """One mode's figures: the median step's time, tokens/s and MFU against `peak`, and how it ran."""
    dt = statistics.median(m.times)
    flops = m.raw.flops_per_token() * tokens_per_iter
    return {
        "ms_per_iter": dt * 1000,
        "tokens_per_s": tokens_per_iter / dt,
        "mfu": flops / dt / peak,
        "peak_flops": peak,
        "peak_mem_bytes": m.peak_mem,
        "dtype": m.dtype,
        "compile": m.compile,
        "compile_s": m.compile_s,
        "fast_dropout": m.fast_dropout,
        "onednn_f32": m.onednn_f32,
        "achieved_flops": flops / dt,
    }


def device_info(device: str, peak: float, peaks: dict[str, float], samples: dict[str, list[float]]) -> dict[str, Any]:
    """What the step ran on: the peak MFU is measured against, the measured product ceilings, threads, CPU or GPU."""
    dev_type = device_type(device)
    kind = cpu_kind() if dev_type == "cpu" else {}
    return {
        "name": device,
        "peak_flops": peak,
        "matmul_ceiling_flops": peaks,
        "matmul_ceiling_samples": samples,
        "cpu_product_rates": cpu_product_rates("bfloat16") if dev_type == "cpu" else {},
        "threads": torch.get_num_threads(),
        "cpu": describe_cpu(kind) if kind else "",
        "cpu_kind": kind,
        "gpu": torch.cuda.get_device_name(device) if dev_type == "cuda" else "",
    }


def time_modes(
    modes: list[Mode], device: str, warmup: int, iters: int, rounds: int, between: Callable[[], None] | None = None
) -> None:
    """Warm each mode up, then time `iters` steps of each in turn, `rounds` times (alternating evens out the
    machine's drift), calling `between` after each round; each mode keeps its step times and its peak memory."""
    dev_type = device_type(device)
    for m in modes:  # warm-up: first steps pay for allocation, kernel selection and compilation
        t0 = time.perf_counter()
        for _ in range(warmup):
            m.step()
        if m.compile:
            m.compile_s = time.perf_counter() - t0
        log(f"  {m.name}: warm-up {warmup} step(s) {time.perf_counter() - t0:.1f}s")
    for r in range(rounds):
        for m in modes:
            if dev_type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            else:
                reset_peak_rss()
            for _ in range(iters):
                m.times.append(m.step())
            mem = torch.cuda.max_memory_allocated(device) if dev_type == "cuda" else peak_rss_bytes()
            m.peak_mem = max(m.peak_mem, mem)
            log(f"  round {r + 1}/{rounds} {m.name}: {statistics.median(m.times[-iters:]) * 1000:.1f} ms/iter")
        if between is not None:
            between()


def bench_generation(cfg: TrainConfig, new_tokens: int = 500, batch: int = 1) -> dict[str, Any]:
    """Tokens/s of sampling `new_tokens` from the config's model, with and without the KV cache.

    Random weights: speed does not depend on them. Greedy decoding, so both runs produce the same tokens.
    """
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**model_args(cfg, _dataset_vocab(cfg)))).to(device).eval()
    idx = torch.zeros((batch, 1), dtype=torch.long, device=device)
    out: dict[str, Any] = {"new_tokens": new_tokens, "batch": batch}
    for name, use_cache in (("cached", True), ("uncached", False)):
        generate(model, idx, 4, temperature=0, use_cache=use_cache)  # warm-up
        t0 = time.perf_counter()
        generate(model, idx, new_tokens, temperature=0, use_cache=use_cache)
        dt = time.perf_counter() - t0
        out[name] = {"seconds": dt, "tokens_per_s": batch * new_tokens / dt}
        log(f"  generation, {name}: {batch * new_tokens / dt:,.1f} tokens/s")
    out["cache_speedup"] = out["cached"]["tokens_per_s"] / out["uncached"]["tokens_per_s"]
    return out


def bench_tokenizers(text_path: str | None) -> dict[str, Any]:
    """Tokens/s of encoding text (Tiny Shakespeare when given, else generated text) with each tokenizer."""
    from gptforge.tokenizer.char import CharTokenizer
    from gptforge.tokenizer.gpt2 import GPT2Tokenizer

    if text_path:
        with open(text_path, encoding="utf-8") as fh:
            text = fh.read()
    else:
        text = " ".join(f"word{i % 997} and some more text, number {i}." for i in range(60000))
    out = {}
    for name, make in (("char", functools.partial(CharTokenizer.from_text, text)), ("gpt2", GPT2Tokenizer)):
        try:
            tok = make()
        except UserError as e:
            out[name] = {"error": str(e)}
            continue
        t0 = time.perf_counter()
        n = len(tok.encode(text))
        dt = time.perf_counter() - t0
        out[name] = {"tokens": n, "seconds": dt, "tokens_per_s": n / dt}
    return out


def _dataset_vocab(cfg: TrainConfig) -> int:
    folder = os.path.join(cfg.data_dir, cfg.dataset)
    if os.path.isdir(folder):
        return model_vocab_size(read_meta(folder))  # what train would build
    # no prepared data: nanoGPT's shakespeare_char (65 characters) or GPT-2 BPE
    return model_vocab_size(
        {"vocab_size": 65, "tokenizer": "char"}
        if cfg.dataset.endswith("_char")
        else {"vocab_size": GPT2_VOCAB, "tokenizer": "gpt2"}
    )


def run_bench(
    cfg: TrainConfig,
    compare: bool,
    as_json: bool,
    iters: int,
    warmup: int,
    rounds: int,
    generation: bool,
    tokenizers: str | None,
    profile: bool = False,
) -> dict[str, Any]:
    """The `gptforge bench` command: prints a table to stderr, or one JSON object to stdout with --json."""
    if iters <= 0 or warmup < 0 or rounds <= 0:
        raise UserError("--iters and --rounds must be positive and --warmup not negative")
    result = bench_training(cfg, compare, iters, warmup, rounds, profile)
    if generation:
        result["generation"] = bench_generation(cfg)
    if tokenizers is not None:
        result["tokenizers"] = bench_tokenizers(tokenizers or None)
    shown = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "gradient_accumulation_steps", "dropout")
    result["config"] = {k: getattr(cfg, k) for k in (*shown, "bias", "dtype", "compile", "fast_dropout", "onednn_f32")}
    if as_json:
        print(json.dumps(result))
    else:
        print_result(result, cfg)
    return result


def print_result(result: dict[str, Any], cfg: TrainConfig) -> None:
    """The human-readable table of run_bench's result, on stdout."""
    for name in ("default", "baseline"):
        if name in result:
            m = result[name]
            print(
                f"{name:>8}: {m['ms_per_iter']:9.1f} ms/iter {m['tokens_per_s']:11,.0f} tok/s  "
                f"mfu {m['mfu'] * 100:5.1f}%  peak mem {m['peak_mem_bytes'] / 2**20:,.0f} MiB  "
                f"({m['dtype']}, compile={m['compile']})"
            )
    if "speedup" in result:
        print(f" speedup: {result['speedup']:.2f}x tokens/s over the baseline ({BASELINE})")
        if cfg.optimizer == "muon":
            print(
                "  note: the baseline steps with AdamW, this config with Muon (more work per step, fewer steps "
                "to a loss): per-step speed is not time to quality; compare that with --target_loss"
            )
    dev = result["device"]
    print(
        f"  device: {dev['name']} ({dev['cpu'] or dev['gpu']}), {dev['threads']} threads\n"
        f"  matmul ceilings: "
        + ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in dev["matmul_ceiling_flops"].items())
        + f" GFLOP/s (the best of {len(dev['matmul_ceiling_samples']['float32'])} measured between the rounds: "
        + ", ".join(f"{k} {min(v) / 1e9:,.0f}-{max(v) / 1e9:,.0f}" for k, v in dev["matmul_ceiling_samples"].items())
        + f"); MFU against {dev['peak_flops'] / 1e9:,.0f} GFLOP/s, the fastest of them"
    )
    if "profile" in result:
        print_profile(result["profile"])
    if "generation" in result:
        g = result["generation"]
        print(
            f"generation ({g['new_tokens']} tokens): {g['cached']['tokens_per_s']:,.1f} tokens/s with the KV "
            f"cache, {g['uncached']['tokens_per_s']:,.1f} without ({g['cache_speedup']:.1f}x)"
        )
    for name, t in result.get("tokenizers", {}).items():
        print(f"tokenizer {name}: " + (f"{t['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in t else t["error"]))

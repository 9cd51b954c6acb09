"""`gptforge bench`'s own options, each written once (default, type, help text); everything else it takes is a
config file or key, as for `gptforge train` (core/config.py). The command line is built from them
(cli/parsers.py). No torch here, so `gptforge bench --help` stays instant."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gptforge.core.settings import setting


@dataclass(frozen=True, kw_only=True)
class BenchArgs:
    compare: str | None = setting(
        None,
        "bare: also time the baseline (float32, eager, plain AdamW: nanoGPT on a CPU), alternating with the default "
        "in rounds, and report the speedup (default tokens/s / baseline tokens/s); =FILE with --target_loss: then "
        "train that config (with the same --key=value options) to the same target and print the ratio of the wall "
        "times",
        metavar="OTHER_CONFIG_FILE",
    )
    # time to quality
    target_loss: float | None = setting(
        None,
        "time to loss: train the config from scratch until the val loss on a fixed held-out set is X or less; "
        "prints wall seconds of training (evaluations not counted), steps and tokens",
        metavar="X",
    )
    target_bpb: float | None = setting(
        None,
        "as --target_loss, to a val bits per byte of X (the loss in bits over the bytes of text the tokens stand "
        "for): compares configs whose tokenizers differ, --compare included",
        metavar="X",
    )
    eval_every: int | None = setting(
        None, "with --target_loss: check the loss every N steps (default max_iters / 100)", metavar="N"
    )
    eval_tokens: int = setting(
        131072, "with --target_loss: held-out tokens (the val split's first N, in block_size windows)", metavar="N"
    )
    max_seconds: float = setting(
        math.inf, "with --target_loss: give up after S seconds of training", metavar="S", finite=False
    )
    seeds: str | None = setting(
        None,
        "with --target_loss: train each config once per seed (its `seed` set to each) and report the median time to "
        "the target and its range: the seed alone can move the check where a run crosses it",
        metavar="S1,S2,...",
    )
    # the step's timing
    json: bool = setting(
        False,
        'print one JSON object on stdout: {"default": M, "baseline": M, "speedup": x, ...} with M = '
        '{"ms_per_iter", "tokens_per_s", "mfu", "peak_mem_bytes", ...}',
    )
    iters: int = setting(5, "timed steps per mode and round")
    warmup: int = setting(2, "untimed steps first (compilation happens here)")
    rounds: int = setting(2, "alternating rounds")
    profile: bool = setting(
        False,
        "then one more step under torch.profiler: its time by kind (matrix products, attention, fused kernels, the "
        "loss, the optimizer...) and the largest kernels (GPU) or operators (CPU)",
    )
    generation: bool = setting(False, "also time sampling 500 tokens, with and without the KV cache")
    tokenizers: str | None = setting(
        None,
        "--tokenizers[=F]: also time tokenising F (bare: generated text) with the char and GPT-2 tokenizers",
        metavar="TEXT_FILE",
    )

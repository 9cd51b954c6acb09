"""`gptforge bench`'s own options (step timing, --compare, time to quality); everything else it takes is a config
file or key, as for `gptforge train`."""

from __future__ import annotations

import argparse
import math

from gptforge.cli.args import formatter


def bench_parser() -> argparse.ArgumentParser:
    """`gptforge bench`'s own options; everything else is a config file or key, as for `gptforge train`."""
    p = argparse.ArgumentParser(
        prog="gptforge bench",
        formatter_class=formatter,
        allow_abbrev=False,
        usage="gptforge bench [CONFIG_FILE ...] [--key=value ...] [--compare] [--json] [--iters N] [--warmup N] "
        "[--rounds N] [--profile] [--generation] [--tokenizers[=TEXT_FILE]]\n"
        "       gptforge bench CONFIG_FILE [--key=value ...] --target_loss=X [--compare=OTHER_CONFIG_FILE] "
        "[--eval_every N] [--eval_tokens N] [--max_seconds S] [--json]",
        description="Measure a config. By default: time its real training step (forward, backward, clipping, "
        "the optimizer, with its gradient accumulation) on random tokens after warm-up: ms/iter, tokens/s, MFU, "
        "peak memory; --compare also times nanoGPT's arithmetic (float32, eager, AdamW) as the baseline, "
        "--generation sampling speed, --tokenizers tokenisation speed. With --target_loss: time to quality, "
        "the config trained from scratch until its held-out val loss reaches X (and --compare=OTHER_CONFIG "
        "raced to the same target). Config files and --key=value work as for `gptforge train`.",
    )
    p.add_argument(
        "--compare",
        default=None,
        metavar="OTHER_CONFIG_FILE",
        help="bare: also time the baseline (float32, eager, plain AdamW: nanoGPT on a CPU), alternating "
        "with the default in rounds, and report the speedup (default tokens/s / baseline tokens/s); "
        "=FILE with --target_loss: then train that config (with the same --key=value options) to the "
        "same target and print the ratio of the wall times",
    )
    add_time_to_loss(p)
    p.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object on stdout: {"default": M, "baseline": M, "speedup": x, ...} with M = '
        '{"ms_per_iter", "tokens_per_s", "mfu", "peak_mem_bytes", ...}',
    )
    p.add_argument("--iters", type=int, default=5, help="timed steps per mode and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    p.add_argument(
        "--profile",
        action="store_true",
        help="then one more step under torch.profiler: its time by kind (matrix products, attention, fused "
        "kernels, the loss, the optimizer...) and the largest kernels (GPU) or operators (CPU)",
    )
    p.add_argument(
        "--generation", action="store_true", help="also time sampling 500 tokens, with and without the KV cache"
    )
    p.add_argument(
        "--tokenizers",
        default=None,
        metavar="TEXT_FILE",
        help="--tokenizers[=F]: also time tokenising F (bare: generated text) with the char and GPT-2 tokenizers",
    )
    return p


def add_time_to_loss(p: argparse.ArgumentParser) -> None:
    """bench's time-to-quality options (--target_loss and what goes with it)."""
    p.add_argument(
        "--target_loss",
        type=float,
        default=None,
        metavar="X",
        help="time to loss: train the config from scratch until the val loss on a fixed held-out set is "
        "X or less; prints wall seconds of training (evaluations not counted), steps and tokens",
    )
    p.add_argument(
        "--target_bpb",
        type=float,
        default=None,
        metavar="X",
        help="as --target_loss, to a val bits per byte of X (the loss in bits over the bytes of text the tokens "
        "stand for): compares configs whose tokenizers differ, --compare included",
    )
    p.add_argument(
        "--eval_every",
        type=int,
        default=None,
        metavar="N",
        help="with --target_loss: check the loss every N steps (default max_iters / 100)",
    )
    p.add_argument(
        "--eval_tokens",
        type=int,
        default=131072,
        metavar="N",
        help="with --target_loss: held-out tokens (the val split's first N, in block_size windows)",
    )
    p.add_argument(
        "--max_seconds",
        type=float,
        default=math.inf,
        metavar="S",
        help="with --target_loss: give up after S seconds of training",
    )
    p.add_argument(
        "--seeds",
        default=None,
        metavar="S1,S2,...",
        help="with --target_loss: train each config once per seed (its `seed` set to each) and report the median "
        "time to the target and its range: the seed alone can move the check where a run crosses it",
    )

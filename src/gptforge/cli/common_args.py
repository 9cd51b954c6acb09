"""Options several subcommands share: where the model comes from, and the device it runs on."""

from __future__ import annotations

import argparse

from gptforge.core.config import CHOICES
from gptforge.infer.options import DTYPE_HELP, SOURCE_HELP


def add_device(p: argparse.ArgumentParser, seed_help: str | None = None) -> None:
    """--device and --dtype, and --seed when the command draws random numbers."""
    if seed_help:
        p.add_argument("--seed", type=int, default=1337, help=seed_help)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=CHOICES["dtype"],
        help=DTYPE_HELP,
    )


def add_model_source(p: argparse.ArgumentParser, verb: str, out_dir_help: str) -> None:
    """--out_dir / --ckpt / --init_from: where sample and eval take their model from."""
    p.add_argument("--out_dir", default="out", help=out_dir_help)
    p.add_argument(
        "--ckpt",
        default=None,
        metavar="PATH",
        help=f"a checkpoint file to {verb} instead of <out_dir>/ckpt.pt (e.g. out/model_05000.pt)",
    )
    p.add_argument("--init_from", default="resume", help=SOURCE_HELP)

"""The `gptforge` command: parses each subcommand's arguments into its options (cli/args.py, cli/parsers.py) and
hands them to the function that does the work (cli/handlers.py), whose stage is imported only then, so `gptforge
--help` is instant. README has the commands; exit codes: 0 success, 2 a user error (one message on stderr, no
traceback), 1 anything else (a bug: the traceback is kept)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from gptforge.bench.options import BenchArgs
from gptforge.cli.args import PIPELINE_USAGE, RL_USAGE, TRAIN_USAGE, bench_parser, build_parser
from gptforge.cli.parsers import parsed
from gptforge.core.allocator import keep_freed_memory
from gptforge.core.errors import UserError
from gptforge.core.quick_exit import quick_exit


def run(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv and argv[0] in ("train", "bench", "rl", "pipeline"):  # config files and --key=value: not argparse's
        return {"train": run_train, "bench": run_bench, "rl": run_rl, "pipeline": run_pipeline}[argv[0]](argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    command = args.chosen  # the leaf subcommand (cli/args.py COMMANDS)
    command.handler(parsed(command.options, args))
    return 0


def run_train(args: list[str]) -> int:
    from gptforge.core.aliases import alias_help
    from gptforge.core.config import help_text
    from gptforge.train.resume import load_run_config

    if "-h" in args or "--help" in args:
        print(TRAIN_USAGE + help_text() + "\n\nbuild-nanogpt's flag names (aliases -> key):\n" + alias_help())
        return 0
    cfg = load_run_config(args)
    from gptforge.train.loop import train

    train(cfg)
    return 0


def run_rl(args: list[str]) -> int:
    from gptforge.core.config_file import load_settings
    from gptforge.core.settings import help_text
    from gptforge.rl.options import RLConfig

    if "-h" in args or "--help" in args:
        print(RL_USAGE + help_text(RLConfig))
        return 0
    cfg = load_settings(RLConfig, args, "rl")
    from gptforge.rl.loop import rl

    rl(cfg)
    return 0


def run_pipeline(args: list[str]) -> int:
    if "-h" in args or "--help" in args:
        print(PIPELINE_USAGE)
        return 0
    from gptforge.pipeline.options import parse_pipeline_args
    from gptforge.pipeline.run import StageFailed, run_pipeline

    try:
        run_pipeline(parse_pipeline_args(args))
    except StageFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    return 0


def run_bench(args: list[str]) -> int:
    # a bare --tokenizers means generated text and a bare --compare the baseline: a file is given only as
    # --tokenizers=FILE / --compare=FILE, so that a config file after either stays a config file
    args = [f"{arg}=" if arg in ("--tokenizers", "--compare") else arg for arg in args]
    namespace, rest = bench_parser().parse_known_args(args)
    opts = parsed(BenchArgs, namespace)
    from gptforge.core.config import load_config

    if opts.target_loss is not None and opts.target_bpb is not None:
        raise UserError("--target_loss and --target_bpb each set the target; give one of them")
    if opts.target_loss is not None or opts.target_bpb is not None:
        from gptforge.bench.time_to_loss import parse_seeds, run_time_to_loss

        if opts.profile:
            raise UserError("--profile profiles one training step; it does not go with --target_loss / --target_bpb")

        metric, target = ("loss", opts.target_loss) if opts.target_loss is not None else ("bpb", opts.target_bpb)

        files = [a for a in rest if not a.startswith("--") and a.endswith(".py")]
        name = os.path.basename(files[-1]).removesuffix(".py") if files else "config"
        cfgs = [(name, load_config(rest))]
        if opts.compare == "":
            raise UserError(f"with --target_{metric}, --compare names the config to race: --compare=CONFIG_FILE")
        if opts.compare is not None:  # the other config file, with the same --key=value options on top
            other = os.path.basename(opts.compare).removesuffix(".py")
            other = other if other != name else f"{other} (compare)"
            cfgs.append((other, load_config([opts.compare, *[a for a in rest if a not in files]])))
        seeds = parse_seeds(opts.seeds)
        run_time_to_loss(cfgs, target, opts.eval_every, opts.eval_tokens, opts.max_seconds, opts.json, metric, seeds)
        return 0
    if opts.seeds is not None:
        raise UserError(f"--seeds={opts.seeds} races to a target once per seed: it needs --target_loss or --target_bpb")
    if opts.compare:
        raise UserError(
            f"--compare={opts.compare} races two configs and needs --target_loss or --target_bpb; a bare --compare "
            "times the baseline step"
        )
    from gptforge.bench.speed import run_bench as bench

    bench(
        load_config(rest),
        compare=opts.compare is not None,
        as_json=opts.json,
        iters=opts.iters,
        warmup=opts.warmup,
        rounds=opts.rounds,
        profile=opts.profile,
        generation=opts.generation,
        tokenizers=opts.tokenizers,
    )
    return 0


OTHER_RANKS_WAIT_S = 10.0


def main(argv: Sequence[str] | None = None) -> None:
    keep_freed_memory()  # before torch allocates anything large; reaches every process started from here
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        rank = os.environ.get("RANK", "0")
        if rank != "0":
            # Under torchrun every rank meets the same mistake and rank 0 says it; torchrun ends the other ranks
            # when one exits. A rank that left first would have rank 0 ended before it spoke (seen on a loaded
            # 2-core machine), so the others wait to be ended; a mistake only this rank meets is said after the wait.
            time.sleep(OTHER_RANKS_WAIT_S)
            print(f"gptforge: error (rank {rank}): {e}", file=sys.stderr)
        else:
            print(f"gptforge: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("gptforge: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # `gptforge sample | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


def entry() -> None:
    """The `gptforge` script and `python -m gptforge`: main, then the process ends without Python's teardown of
    torch and the run (core/quick_exit.py: ~0.5 s after training on 2 cores). An exception that is not a user
    error leaves through Python's normal exit, traceback and all."""
    try:
        main()
    except SystemExit as done:
        quick_exit(done.code)

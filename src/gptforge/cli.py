"""The `gptforge` command: prepare data, train, sample, evaluate, export, benchmark, watch runs in a dashboard.

    gptforge prepare shakespeare_char --input ../shared/data/tinyshakespeare/input.txt
    gptforge train config/train_shakespeare_char_cpu.py
    gptforge sample --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3
    gptforge sample --ckpt=out/model_05000.pt
    gptforge eval hellaswag --out_dir=out --limit=200
    gptforge export --out_dir=out --to=hf-out
    gptforge dashboard out-shakespeare-char

Each subcommand imports its module only when it runs, so `gptforge --help` is instant. Exit codes: 0 success,
2 a user error (one message on stderr, no traceback), 1 anything else (a bug: the traceback is kept).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from gptforge import __version__
from gptforge.errors import UserError

TRAIN_USAGE = """usage: gptforge train [CONFIG_FILE ...] [--key=value | --key value ...]

Train a GPT (nanoGPT's train.py). CONFIG_FILEs are nanoGPT-style `name = value` files, read as data; options
override them, in order, the last one winning. Examples:

  gptforge train config/train_shakespeare_char.py --device=cpu --compile=False --max_iters=2000
  torchrun --standalone --nproc_per_node=4 -m gptforge train config/train_gpt2.py

config keys (--key=DEFAULT  (type)):
"""



def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="autocast dtype (auto: bf16/fp16 on CUDA, float32 elsewhere)")


def add_model_source(p: argparse.ArgumentParser, verb: str, out_dir_help: str) -> None:
    """--out_dir / --ckpt / --init_from: where sample and eval take their model from."""
    p.add_argument("--out_dir", default="out", help=out_dir_help)
    p.add_argument("--ckpt", default=None, metavar="PATH",
                   help=f"a checkpoint file to {verb} instead of <out_dir>/ckpt.pt (e.g. out/model_05000.pt)")
    p.add_argument("--init_from", default="resume",
                   help="'resume' (the run in --out_dir), a GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a "
                   "local Hugging Face GPT-2 folder")

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gptforge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"gptforge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    def fmt(prog: str) -> argparse.HelpFormatter:
        return argparse.ArgumentDefaultsHelpFormatter(prog, max_help_position=30, width=110)

    p = sub.add_parser("prepare", help="tokenize a dataset into data/<name>/ (train.bin/val.bin, or token shards)",
                       formatter_class=fmt,
                       description="Tokenize a dataset into <data_dir>/<name>/: train.bin, val.bin and meta.json "
                       "(shakespeare_char, shakespeare, text), or GPT-2 token shards <name>_<split>_NNNNNN.bin and "
                       "meta.json (files, openwebtext, fineweb_edu; resumable: run the same command again).")
    p.add_argument("recipe", choices=["shakespeare_char", "shakespeare", "text", "files", "openwebtext", "fineweb_edu"],
                   help="what to prepare")
    p.add_argument("files", nargs="*", metavar="PATH",
                   help="input files: UTF-8 text (recipe 'text'); .jsonl, .jsonl.gz, .parquet, .txt files or folders "
                   "of them (recipe 'files')")
    p.add_argument("--input", default=None,
                   help="local copy of the recipe's source (skips the download): a text file for the Shakespeare "
                   "recipes; for openwebtext / fineweb_edu a datasets save_to_disk folder or data files")
    p.add_argument("--data_dir", default="data", help="folder that receives the dataset folder")
    p.add_argument("--name", default=None,
                   help="dataset name (folder <data_dir>/<name>); needed by 'text' and 'files', else the recipe's")
    p.add_argument("--tokenizer", default="char", choices=["char", "gpt2"], help="tokenizer for recipe 'text'")
    p.add_argument("--val_fraction", type=float, default=0.1,
                   help="share of the tokens held out for validation (shakespeare*, text)")
    p.add_argument("--text_field", default="text", help="field / column holding the text (sharded recipes)")
    p.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per shard (sharded recipes)")
    p.add_argument("--val_tokens", type=int, default=1_000_000,
                   help="the first documents go to val until it holds this many tokens (sharded recipes)")
    p.add_argument("--num_proc", type=int, default=min(os.cpu_count() or 1, 8),
                   help="tokenizer worker processes (sharded recipes)")

    sub.add_parser("train", help="train a GPT (nanoGPT config files and --key=value options)", add_help=False)
    sub.add_parser("bench", help="time the training step: tokens/s, MFU, memory; --compare with the baseline",
                   add_help=False)

    p = sub.add_parser("sample", help="sample text from a trained run", formatter_class=fmt,
                       description="Print samples from <out_dir>/ckpt.pt (or --ckpt PATH) to stdout, each followed "
                       "by a line of dashes.")
    add_model_source(p, "sample from", "run folder holding ckpt.pt")
    p.add_argument("--start", default="\n",
                   help="prompt text, or FILE:path to read it from a file (default: a newline)")
    p.add_argument("--num_samples", type=int, default=10, help="samples to draw")
    p.add_argument("--max_new_tokens", type=int, default=500, help="tokens generated per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="< 1 sharper, > 1 more random, 0 greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample from the k likeliest tokens only (0 = all)")
    p.add_argument("--top_p", type=float, default=1.0,
                   help="sample from the smallest set of tokens holding this much probability (1 = off)")
    p.add_argument("--stop_token", type=int, default=-1,
                   help="end a sample when this token id is produced (GPT-2's <|endoftext|> is 50256; -1 = never)")
    p.add_argument("--no_cache", dest="use_cache", action="store_false",
                   help="recompute the whole context at every token instead of using the KV cache")
    p.add_argument("--seed", type=int, default=1337, help="random seed: the same seed gives the same samples")
    add_device(p)

    p = sub.add_parser("dashboard", help="live web dashboard of training runs",
                       formatter_class=fmt, description="Serve a live dashboard of the runs under FOLDERs: "
                       "each is a run folder (with metrics.jsonl) or holds run folders a few levels down.")
    p.add_argument("folders", nargs="*", default=["."], metavar="FOLDER", help="run folders or folders of runs")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 lets other machines read your runs")
    p.add_argument("--port", type=int, default=8765, help="port to listen on; 0 picks a free one")
    p = sub.add_parser("eval", help="evaluate a trained run (hellaswag, loss)", formatter_class=fmt,
                       description="Evaluate <out_dir>/ckpt.pt (or --ckpt PATH) on a benchmark; the result goes to "
                       "stdout.")
    tasks = p.add_subparsers(dest="task", required=True)
    t = tasks.add_parser("hellaswag", help="HellaSwag validation accuracy (acc, acc_norm)", formatter_class=fmt,
                         description="Score <out_dir>/ckpt.pt (or --ckpt PATH) on HellaSwag's validation set, "
                         "completion style; prints one line: examples, acc and acc_norm. Works under torchrun "
                         "(sharded).")
    add_model_source(t, "score", "run folder holding ckpt.pt (a GPT-2 BPE run)")
    t.add_argument("--hellaswag_path", default=None,
                   help="local hellaswag_val.jsonl; None = download it once into $GPTFORGE_CACHE_DIR/hellaswag "
                   "(~/.cache/gptforge/hellaswag)")
    t.add_argument("--limit", type=int, default=None, help="score only the first N examples; None = all 10,042")
    t.add_argument("--batch_size", type=int, default=4, help="examples per forward pass (4 sequences each)")
    add_device(t)
    t = tasks.add_parser("loss", help="loss and perplexity on a dataset's splits", formatter_class=fmt,
                         description="Measure <out_dir>/ckpt.pt (or --ckpt PATH, or GPT-2's weights) on a prepared "
                         "dataset: the mean cross-entropy over --eval_iters batches per split and its perplexity. "
                         "Prints one line per split to stdout. The batches come from a private generator seeded "
                         "with --seed, so the same command gives the same figures.")
    add_model_source(t, "measure", "run folder holding ckpt.pt")
    t.add_argument("--dataset", default=None, help="dataset folder name under --data_dir (default: the run's)")
    t.add_argument("--data_dir", default=None, help="folder holding dataset folders (default: the run's, or data)")
    t.add_argument("--split", default="val", choices=["val", "train", "both"], help="which split(s) to measure")
    t.add_argument("--eval_iters", type=int, default=None, help="batches per split (default: the run's, or 200)")
    t.add_argument("--batch_size", type=int, default=None, help="sequences per batch (default: the run's, or 8)")
    t.add_argument("--block_size", type=int, default=None,
                   help="tokens per sequence (default: the run's; at most the model's block_size)")
    t.add_argument("--seed", type=int, default=1337, help="seed of the batch positions")
    add_device(t)

    p = sub.add_parser("export", help="write a run's model as a Hugging Face GPT-2 folder", formatter_class=fmt,
                       description="Write <out_dir>/ckpt.pt (or --ckpt PATH) as a Hugging Face GPT-2 folder "
                       "(config.json, model.safetensors and, for GPT-2 BPE runs, the tokenizer files) that "
                       "transformers' GPT2LMHeadModel.from_pretrained and pipeline() load.")
    p.add_argument("--out_dir", default="out", help="run folder holding ckpt.pt")
    p.add_argument("--ckpt", default=None, metavar="PATH",
                   help="a checkpoint file to export instead of <out_dir>/ckpt.pt (e.g. out/model_05000.pt)")
    p.add_argument("--to", required=True, default=argparse.SUPPRESS, metavar="FOLDER",
                   help="the folder to create (it may exist if empty)")
    p.add_argument("--force", action="store_true", help="replace FOLDER when it holds a previous export")
    return parser


def run(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv and argv[0] == "train":
        return run_train(argv[1:])
    if argv and argv[0] == "bench":
        return run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "prepare":
        if args.recipe in ("files", "openwebtext", "fineweb_edu"):
            from gptforge.data.shards import prepare_shards

            if args.recipe == "files" and args.input:
                raise UserError("recipe 'files' takes its inputs as PATH arguments, not --input")
            prepare_shards(args.recipe, data_dir=args.data_dir, paths=args.files, name=args.name,
                           input_path=args.input, text_field=args.text_field, shard_size=args.shard_size,
                           val_tokens=args.val_tokens, num_proc=args.num_proc)
            return 0
        from gptforge.data.prepare import prepare

        if args.recipe != "text" and args.files:
            raise UserError(f"recipe {args.recipe!r} takes no FILE arguments; use --input PATH for a local copy")
        prepare(args.recipe, data_dir=args.data_dir, input_path=args.input, files=args.files, name=args.name,
                tokenizer=args.tokenizer, val_fraction=args.val_fraction)
    elif args.command == "sample":
        from gptforge.sample import SampleArgs, sample

        sample(SampleArgs(**{k: v for k, v in vars(args).items() if k != "command"}))
    elif args.command == "dashboard":
        from gptforge.dashboard.server import serve

        serve(args.folders, host=args.host, port=args.port)
    elif args.command == "eval":
        run_eval_hellaswag(args) if args.task == "hellaswag" else run_eval_loss(args)
    elif args.command == "export":
        run_export(args)
    return 0


def run_export(args: argparse.Namespace) -> None:
    """`gptforge export`: the checkpoint's model and tokenizer as a Hugging Face GPT-2 folder."""
    from gptforge.pretrained import export_hf
    from gptforge.sample import checkpoint_path, load_checkpoint_model

    path = checkpoint_path(args.out_dir, args.ckpt)
    model, tok, ckpt = load_checkpoint_model(path, "cpu")
    notes = export_hf(model, args.to, tok.spec(), force=args.force)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {args.to}: a Hugging Face GPT-2 folder (GPT2LMHeadModel) of {path}, step "
          f"{ckpt.get('iter_num', '?')}")


def run_train(args: list[str]) -> int:
    from gptforge.config import alias_help, help_text, load_config

    if "-h" in args or "--help" in args:
        print(TRAIN_USAGE + help_text() + "\n\nbuild-nanogpt's flag names (aliases -> key):\n" + alias_help())
        return 0
    cfg = load_config(args)
    from gptforge.train import train

    train(cfg)
    return 0


BENCH_USAGE = """usage: gptforge bench [CONFIG_FILE ...] [--key=value ...] [--compare] [--json] [--iters N] [--warmup N]
                      [--rounds N] [--generation] [--tokenizers[=TEXT_FILE]]

Time the real training step of a config (forward, backward, clipping, AdamW, with its gradient accumulation)
on random tokens, after warm-up. Config files and --key=value work as for `gptforge train`.

  --compare          also time the baseline (float32, eager, plain AdamW: nanoGPT on a CPU), alternating
                     with the default in rounds, and report the speedup (default tokens/s / baseline tokens/s)
  --json             print one JSON object on stdout: {"default": M, "baseline": M, "speedup": x, ...} with
                     M = {"ms_per_iter", "tokens_per_s", "mfu", "peak_mem_bytes", ...}
  --iters N          timed steps per mode and round (default 5)
  --warmup N         untimed steps first (default 2; compilation happens here)
  --rounds N         alternating rounds (default 2)
  --generation       also time sampling 500 tokens, with and without the KV cache
  --tokenizers[=F]   also time tokenising F (default: generated text) with the char and GPT-2 tokenizers
"""


def run_bench(args: list[str]) -> int:
    if "-h" in args or "--help" in args:
        print(BENCH_USAGE)
        return 0
    opts = {"compare": False, "json": False, "iters": 5, "warmup": 2, "rounds": 2, "generation": False,
            "tokenizers": None}
    rest = []
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        name = key[2:] if key.startswith("--") else None
        if name in ("compare", "json", "generation") and not eq:
            opts[name] = True
        elif name == "tokenizers":
            opts[name] = value if eq else ""
        elif name in ("iters", "warmup", "rounds"):
            text = value if eq else next(it, "")
            if not text.lstrip("-").isdigit():
                raise UserError(f"--{name} needs an integer, got {text!r}")
            opts[name] = int(text)
        else:
            rest.append(arg)
    from gptforge.bench import run_bench as bench
    from gptforge.config import load_config

    bench(load_config(rest), as_json=opts.pop("json"), **opts)
    return 0
def run_eval_loss(args: argparse.Namespace) -> None:
    """`gptforge eval loss`: a model's mean loss and perplexity on a dataset's splits (one process)."""
    for key in ("eval_iters", "batch_size", "block_size"):
        if getattr(args, key) is not None and getattr(args, key) <= 0:
            raise UserError(f"--{key} must be a positive integer, got {getattr(args, key)}")
    import math

    from gptforge.data.loader import RandomBatches, ShardedBatches, dataset_dir, read_meta, split_files
    from gptforge.distributed import autocast_context, resolve_device, resolve_dtype
    from gptforge.evaluate.loss import estimate_loss
    from gptforge.sample import SampleArgs, checkpoint_path, load_checkpoint_model, load_model
    from gptforge.tokenizer import tokenizer_spec

    device = resolve_device(args.device)
    run = {}  # the run's config: its dataset and batch shape are the defaults
    if args.init_from == "resume":
        model, tok, ckpt = load_checkpoint_model(checkpoint_path(args.out_dir, args.ckpt), device)
        run = ckpt.get("config") or {}
        del ckpt
    else:
        model, tok = load_model(SampleArgs(out_dir=args.out_dir, init_from=args.init_from, ckpt=args.ckpt), device)
    dataset = args.dataset or run.get("dataset")
    if not dataset:
        raise UserError("--dataset: name the prepared dataset to measure on (e.g. --dataset=shakespeare)")
    folder = dataset_dir(args.data_dir or run.get("data_dir", "data"), dataset)
    meta = read_meta(folder)
    if tokenizer_spec(meta) != tok.spec():
        raise UserError(f"dataset {folder} is tokenized differently ({meta['tokenizer']}) from what the model "
                        f"reads ({tok.kind}); choose a dataset made with the model's tokenizer (--dataset)")
    block = min(args.block_size or run.get("block_size") or model.config.block_size, model.config.block_size)
    batch, iters = args.batch_size or run.get("batch_size", 8), args.eval_iters or run.get("eval_iters", 200)
    splits = ["val", "train"] if args.split == "both" else [args.split]
    vocab = model.config.vocab_size
    if meta.get("format") == "shards":  # the first windows of each split, in order, as training evaluates
        loaders = {s: ShardedBatches(split_files(folder, s, meta), batch, block, vocab, device, 1, 0, 1, args.seed,
                                     meta["dtype"]) for s in splits}
    else:
        loaders = {s: RandomBatches(os.path.join(folder, f"{s}.bin"), batch, block, vocab, device, seed=args.seed,
                                    dtype=meta["dtype"]) for s in splits}
    device_type = device.split(":")[0]
    dtype = resolve_dtype(args.dtype, device_type)
    print(f"loss: {iters} batches of {batch} x {block} tokens per split from {folder} on {device} ({dtype})",
          file=sys.stderr, flush=True)
    losses = estimate_loss(model, loaders, iters, autocast_context(device_type, dtype))
    for split in splits:
        print(f"{split} loss {losses[split]:.4f} (ppl {math.exp(min(losses[split], 700)):.2f})")


def run_eval_hellaswag(args: argparse.Namespace) -> None:
    """`gptforge eval hellaswag`: one process, or one per device under torchrun (rank 0 prints the result)."""
    for key in ("limit", "batch_size"):
        if getattr(args, key) is not None and getattr(args, key) <= 0:
            raise UserError(f"--{key} must be a positive integer, got {getattr(args, key)}")
    import torch.distributed as dist

    from gptforge.distributed import autocast_context, resolve_dtype, setup_distributed, teardown
    from gptforge.evaluate import hellaswag
    from gptforge.sample import SampleArgs, load_model

    env = setup_distributed(args.device, "auto")
    try:
        dtype = resolve_dtype(args.dtype, env.device_type)
        model, tokenizer = load_model(SampleArgs(out_dir=args.out_dir, init_from=args.init_from, ckpt=args.ckpt),
                                      env.device)
        hellaswag.check_tokenizer(tokenizer)
        if env.ddp and not env.is_main:
            dist.barrier()  # rank 0 downloads; the others then find the file in the cache
        try:
            path = hellaswag.hellaswag_file(args.hellaswag_path)
        finally:
            if env.ddp and env.is_main:
                dist.barrier()
        examples = hellaswag.load_examples(path, args.limit)
        if env.is_main:
            print(f"hellaswag: scoring {len(examples)} examples from {path} on {env.device} ({dtype}), "
                  f"{env.world_size} process(es)", file=sys.stderr, flush=True)
        result = hellaswag.evaluate_hellaswag(
            model, tokenizer, examples, env.device, autocast_context(env.device_type, dtype),
            batch_examples=args.batch_size, rank=env.rank, world_size=env.world_size)
        if env.is_main:
            print(hellaswag.format_result(result), flush=True)
    finally:
        teardown(env)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(f"gptforge: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("gptforge: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # `gptforge sample | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)

"""The command line's subcommands: COMMANDS names, for each, its options (a dataclass of settings, kept by its stage in
a module of its own that imports no torch), the function that does its work (cli/handlers.py) and its help texts;
build_parser makes argparse's parsers from them (cli/parsers.py). `train` and `bench` take nanoGPT config files and
--key=value options (core/config.py) and are parsed by cli/main.py; bench's own options are BenchArgs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gptforge import __version__
from gptforge.bench.options import BenchArgs
from gptforge.cli import handlers
from gptforge.cli.parsers import add_options, formatter
from gptforge.dashboard.options import DashboardArgs
from gptforge.data.options import PrepareArgs
from gptforge.evaluate.options import EvalChatArgs, EvalLossArgs, HellaswagArgs, LmEvalArgs
from gptforge.infer.options import ChatArgs, SampleArgs, ServeArgs
from gptforge.tokenizer.options import DecodeArgs, EncodeArgs, TokenizerStatsArgs, TokenizerTrainArgs
from gptforge.weights.options import ExportArgs


@dataclass(frozen=True)
class Command:
    """A subcommand: its options class and handler (the handler takes an object of the class), or its own
    subcommands (`tasks`: eval, tokenizer), or neither (train, bench: parsed by cli/main.py); and its help texts."""

    name: str
    help: str
    description: str | None = None
    options: type | None = None
    handler: Callable[[Any], None] | None = None
    tasks: tuple[Command, ...] = ()


TRAIN_USAGE = """usage: gptforge train [CONFIG_FILE ...] [--key=value | --key value ...]

Train a GPT (nanoGPT's train.py). CONFIG_FILEs are nanoGPT-style `name = value` files, read as data; options
override them, in order, the last one winning. Examples:

  gptforge train config/train_shakespeare_char.py --device=cpu --compile=False --max_iters=2000
  torchrun --standalone --nproc_per_node=4 -m gptforge train config/train_gpt2.py

config keys (--key=DEFAULT  (type)):
"""
RL_USAGE = """usage: gptforge rl [CONFIG_FILE ...] [--key=value | --key value ...]

Improve a chat model by reward (GRPO-style RL): each step samples num_generations answers to each of
prompts_per_step prompts, scores them (exact match, or --reward=FILE.py:FUNCTION), and takes a policy-gradient step
on the answers' tokens with each answer's reward minus its group's mean as its advantage. Config files hold
`name = value` lines, read as data; options override them, the last one winning. Running the same command again
continues the run in --out_dir from its last checkpoint. Examples:

  gptforge rl config/chat_rl_cpu.py
  gptforge rl --init_from=out-chat-sft --kinds=count,spell --max_steps=50
  torchrun --standalone --nproc_per_node=2 -m gptforge rl config/chat_rl_cpu.py

settings (--key=DEFAULT  (type)):
"""
PIPELINE_USAGE = """usage: gptforge pipeline RECIPE [--out_dir=FOLDER] [--dry_run] [--STAGE.KEY=VALUE ...]

Run a recipe's stages in order, each as its own gptforge command in one pipeline folder: texts, tokenizer, data,
pretraining, SFT, RL, evaluations, export. RECIPE is a TOML file or a built-in recipe: chat-cpu (the CPU chat
recipe: about 80-85 minutes on 2 cores), chat-quick (every stage in minutes), chat-gpu (a larger model for one GPU).
Running the same command again skips the stages that finished with the same settings and inputs, continues an
interrupted training or RL stage from its last checkpoint, and re-runs a changed stage and every stage after it
that reads it. report.md in the folder holds each stage's figures; `gptforge dashboard FOLDER` its curves.

  --out_dir=FOLDER      the pipeline folder (default: the recipe's [pipeline] out_dir, else its name)
  --dry_run             print the stages, the command each runs and what is done already; run nothing
  --STAGE.KEY=VALUE     change a setting of one stage (VALUE as in TOML: 300, true, "text", ["a", "b"])

Examples:

  gptforge pipeline chat-quick
  gptforge pipeline chat-cpu --text.shakespeare=path/to/input.txt
  gptforge pipeline my_recipe.toml --sft.max_iters=2000 --dry_run

docs/USAGE.md "One command" lists every kind of stage and its keys.
"""
BENCH_USAGE = (
    "gptforge bench [CONFIG_FILE ...] [--key=value ...] [--compare] [--json] [--iters N] [--warmup N] [--rounds N] "
    "[--profile] [--generation] [--tokenizers[=TEXT_FILE]]\n"
    "       gptforge bench CONFIG_FILE [--key=value ...] --target_loss=X [--compare=OTHER_CONFIG_FILE] "
    "[--eval_every N] [--eval_tokens N] [--max_seconds S] [--json]"
)
BENCH = """Measure a config. By default: time its real training step (forward, backward, clipping, the optimizer, with
its gradient accumulation) on random tokens after warm-up: ms/iter, tokens/s, MFU, peak memory; --compare also times
nanoGPT's arithmetic (float32, eager, AdamW) as the baseline, --generation sampling speed, --tokenizers tokenisation
speed. With --target_loss: time to quality, the config trained from scratch until its held-out val loss reaches X
(and --compare=OTHER_CONFIG raced to the same target). Config files and --key=value work as for `gptforge train`."""
CHAT = """Talk to a model in the terminal: a chat model (fine-tuned on conversations) answers each message,
remembering the conversation (kept in the model's KV cache: a turn costs only its own tokens; when it outgrows the
context the oldest exchanges are dropped, and you are told). A base model continues your text instead (completion
mode; it says so at the start). Ctrl-C stops an answer, Ctrl-D or /quit leaves. Commands: /system TEXT,
/temperature X, /top_p X, /clear, /save FILE, /load FILE, /help, /quit."""
SERVE = """Serve a model over OpenAI's HTTP API (POST /v1/chat/completions and /v1/completions, streamed or not; GET
/v1/models, /health) with a chat page at http://HOST:PORT/. Concurrent requests share each model step (continuous
batching). Needs pip install 'gptforge[serve]'. Ctrl-C finishes the requests in flight, then exits."""
PREPARE = """Tokenize a dataset into <data_dir>/<name>/: train.bin, val.bin and meta.json (shakespeare_char,
shakespeare, text), or GPT-2 token shards <name>_<split>_NNNNNN.bin and meta.json (files, openwebtext, fineweb_edu;
resumable: run the same command again)."""
EXPORT = """Write <out_dir>/ckpt.pt (or --ckpt PATH) as a Hugging Face GPT-2 folder (config.json, model.safetensors
and, for GPT-2 BPE runs, the tokenizer files) that transformers' GPT2LMHeadModel.from_pretrained and pipeline() load;
a model with the nanochat switches on (rotary, rmsnorm, qk_norm, relu2, untie_head) as a NanoChat folder
(NanoChatForCausalLM)."""
LM_EVAL = """Score <out_dir>/ckpt.pt (or --ckpt PATH, or --init_from=gpt2) with lm-evaluation-harness (pip install
'gptforge[eval]'), no export needed; prints lm-eval's table. The options are lm-eval's. Tasks load their datasets
from the Hugging Face hub; offline, give --include_path with a task YAML over local files (README)."""
EVAL_LOSS = """Measure <out_dir>/ckpt.pt (or --ckpt PATH, or GPT-2's weights) on a prepared dataset: the mean
cross-entropy over --eval_iters batches per split and its perplexity. Prints one line per split to stdout. The
batches come from a private generator seeded with --seed, so the same command gives the same figures."""

EVAL = (
    Command(
        "hellaswag",
        "HellaSwag validation accuracy (acc, acc_norm)",
        "Score <out_dir>/ckpt.pt (or --ckpt PATH) on HellaSwag's validation set, completion style; prints one line: "
        "examples, acc and acc_norm. Works under torchrun (sharded).",
        HellaswagArgs,
        handlers.eval_hellaswag,
    ),
    Command(
        "lm-eval",
        "EleutherAI's lm-evaluation-harness tasks (hellaswag, arc_easy, piqa, ...)",
        LM_EVAL,
        LmEvalArgs,
        handlers.eval_lm_eval,
    ),
    Command("loss", "loss and perplexity on a dataset's splits", EVAL_LOSS, EvalLossArgs, handlers.eval_loss),
    Command(
        "chat",
        "a chat model's exact match on held-out synthetic tasks",
        "A chat model (gptforge train --task=sft) answers held-out synthetic problems (never in a training set) "
        "greedily; prints the exact match per kind and the share of answers ending with the end token.",
        EvalChatArgs,
        handlers.eval_chat,
    ),
)
TOKENIZER = (
    Command(
        "train",
        "learn a vocabulary from files or folders of text",
        "Learn a byte-level BPE vocabulary (the 256 bytes, the merges, then the reserved special tokens) from the text "
        "of FILE_OR_FOLDERs and write it to tokenizers/NAME; prints the folder. Folders give their text files (.txt, "
        ".md, .py, ...) and records (.jsonl, .jsonl.gz, .parquet), recursively.",
        TokenizerTrainArgs,
        handlers.tokenizer_train,
    ),
    Command(
        "stats",
        "bytes per token on a file, beside GPT-2's and char-level's",
        "Encode FILE with the tokenizer and print bytes per token beside GPT-2's BPE and a character vocabulary's "
        "(higher: fewer tokens for the same text).",
        TokenizerStatsArgs,
        handlers.tokenizer_stats,
    ),
    Command("encode", "print the ids of a text", None, EncodeArgs, handlers.tokenizer_encode),
    Command("decode", "print the text of ids", None, DecodeArgs, handlers.tokenizer_decode),
)
COMMANDS = (
    Command(
        "prepare",
        "tokenize a dataset into data/<name>/ (train.bin/val.bin, or token shards)",
        PREPARE,
        PrepareArgs,
        handlers.prepare,
    ),
    Command(
        "tokenizer",
        "train an own byte-level BPE tokenizer on your text; measure it, encode, decode",
        "Own byte-level BPE tokenizers, kept as folders under tokenizers/NAME (Hugging Face's tokenizer.json among "
        "their files); `gptforge prepare ... --tokenizer NAME` then uses one.",
        tasks=TOKENIZER,
    ),
    Command("train", "train a GPT (nanoGPT config files and --key=value options)"),
    Command("bench", "time the training step: tokens/s, MFU, memory; --compare with the baseline"),
    Command("rl", "improve a chat model by reward: RL on verifiable tasks (GRPO-style)"),
    Command("pipeline", "run a recipe's stages, text to chat model, in one command; report.md at the end"),
    Command(
        "sample",
        "sample text from a trained run",
        "Print samples from <out_dir>/ckpt.pt (or --ckpt PATH) to stdout, each followed by a line of dashes.",
        SampleArgs,
        handlers.sample,
    ),
    Command("chat", "talk to a model in the terminal", CHAT, ChatArgs, handlers.chat),
    Command("serve", "serve a model over OpenAI's API, with a chat page", SERVE, ServeArgs, handlers.serve),
    Command(
        "export",
        "write a run's model as a Hugging Face GPT-2 (or NanoChat) folder",
        EXPORT,
        ExportArgs,
        handlers.export,
    ),
    Command(
        "dashboard",
        "live web dashboard of training runs",
        "Serve a live dashboard of the runs under FOLDERs: each is a run folder (with metrics.jsonl) or holds run "
        "folders a few levels down.",
        DashboardArgs,
        handlers.dashboard,
    ),
    Command(
        "eval",
        "evaluate a trained run (hellaswag, loss, lm-eval, chat)",
        "Evaluate <out_dir>/ckpt.pt (or --ckpt PATH) on a benchmark; the result goes to stdout.",
        tasks=EVAL,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gptforge",
        description="Prepare data, train, sample, evaluate, export, benchmark, watch runs in a dashboard.",
    )
    parser.add_argument("--version", action="version", version=f"gptforge {__version__}")
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND"), COMMANDS)
    return parser


def add_commands(sub: argparse._SubParsersAction, commands: tuple[Command, ...]) -> None:
    """A parser per command, its arguments from its options class; the command itself is the parse's `chosen`."""
    for command in commands:
        if command.options is None and not command.tasks:  # train, bench, rl: only listed here
            sub.add_parser(command.name, help=command.help, add_help=False)
            continue
        p = sub.add_parser(command.name, help=command.help, formatter_class=formatter, description=command.description)
        if command.tasks:
            add_commands(p.add_subparsers(dest="task", required=True), command.tasks)
        else:
            add_options(p, command.options)
            p.set_defaults(chosen=command)


def bench_parser() -> argparse.ArgumentParser:
    """`gptforge bench`'s own options; everything else is a config file or key, as for `gptforge train`."""
    p = argparse.ArgumentParser(
        prog="gptforge bench", formatter_class=formatter, allow_abbrev=False, usage=BENCH_USAGE, description=BENCH
    )
    add_options(p, BenchArgs)
    return p

"""The command line's arguments: one argparse parser per subcommand, with its help texts and defaults, and for each
the function that does its work (`handler`, a "module:function" name imported only when the command runs; with
`options`, a dataclass built from the options first). `train` and `bench` take nanoGPT config files and
--key=value options instead (core/config.py)."""

from __future__ import annotations

import argparse
import dataclasses

from gptforge import __version__
from gptforge.chat.synthetic import ALL_KINDS, KINDS
from gptforge.cli.chat_args import add_chat, add_chat_template_options, add_serve
from gptforge.cli.common_args import add_device, add_model_source
from gptforge.cli.tokenizer_args import add_tokenizer
from gptforge.core.config import CHOICES, FIELDS
from gptforge.data import CHAT_RECIPE, RECIPES, SHARD_RECIPES
from gptforge.infer.options import WINDOWS, SampleArgs

TRAIN_USAGE = """usage: gptforge train [CONFIG_FILE ...] [--key=value | --key value ...]

Train a GPT (nanoGPT's train.py). CONFIG_FILEs are nanoGPT-style `name = value` files, read as data; options
override them, in order, the last one winning. Examples:

  gptforge train config/train_shakespeare_char.py --device=cpu --compile=False --max_iters=2000
  torchrun --standalone --nproc_per_node=4 -m gptforge train config/train_gpt2.py

config keys (--key=DEFAULT  (type)):
"""


TOKENIZER_HELP = (
    "char, gpt2, or an own tokenizer (`gptforge tokenizer train`: its name under tokenizers/, or its folder) for "
    "recipes text (char when not given), shakespeare, the sharded recipes and chat (gpt2 when not given; chat "
    "takes no char)"
)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each help text, only where it tells the reader something, and once: not for
    None (the help says what happens without the option), not for flags (giving the flag is the setting: --no_cache
    would read "(default: True)"), not where the help states its own default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0 or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def formatter(prog: str) -> argparse.HelpFormatter:
    return DefaultsFormatter(prog, max_help_position=30, width=110)


def add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize a dataset into data/<name>/ (train.bin/val.bin, or token shards)",
        formatter_class=formatter,
        description="Tokenize a dataset into <data_dir>/<name>/: train.bin, val.bin and meta.json "
        "(shakespeare_char, shakespeare, text), or GPT-2 token shards <name>_<split>_NNNNNN.bin and "
        "meta.json (files, openwebtext, fineweb_edu; resumable: run the same command again).",
    )
    p.add_argument("recipe", choices=[*RECIPES, *SHARD_RECIPES, CHAT_RECIPE], help="what to prepare")
    p.add_argument(
        "files",
        nargs="*",
        metavar="PATH",
        help="input files: UTF-8 text (recipe 'text'); .jsonl, .jsonl.gz, .parquet, .txt files or folders "
        "of them (recipe 'files')",
    )
    p.add_argument(
        "--input",
        dest="input_path",
        default=None,
        metavar="PATH",
        help="local copy of the recipe's source (skips the download): a text file for the Shakespeare "
        "recipes; for openwebtext / fineweb_edu a datasets save_to_disk folder or data files",
    )
    p.add_argument("--data_dir", default="data", help="folder that receives the dataset folder")
    p.add_argument(
        "--name",
        default=None,
        help="dataset name (folder <data_dir>/<name>); needed by 'text' and 'files', else the recipe's",
    )
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_FOLDER", help=TOKENIZER_HELP)
    p.add_argument(
        "--val_fraction",
        type=float,
        default=None,
        help="share of the tokens held out for validation (shakespeare*, text; default: 0.1)",
    )
    p.add_argument(
        "--text_field", default=None, help="field / column holding the text (sharded recipes; default: text)"
    )
    p.add_argument(
        "--shard_size", type=int, default=None, help="tokens per shard (sharded recipes; default: 100,000,000)"
    )
    p.add_argument(
        "--val_tokens",
        type=int,
        default=None,
        help="the first documents go to val until it holds this many tokens (sharded recipes; default: 1,000,000)",
    )
    p.add_argument(
        "--num_proc",
        type=int,
        default=None,
        help="tokenizer worker processes (sharded recipes; default: the CPU count, at most 8)",
    )
    add_chat_prepare(p)
    p.set_defaults(handler="gptforge.data.command:prepare_command")


def add_sample(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sample",
        help="sample text from a trained run",
        formatter_class=formatter,
        description="Print samples from <out_dir>/ckpt.pt (or --ckpt PATH) to stdout, each followed "
        "by a line of dashes.",
    )
    p.set_defaults(handler="gptforge.infer.sample:sample", options="gptforge.infer.options:SampleArgs")
    choices = {"window": WINDOWS, "dtype": CHOICES["dtype"]}
    for f in dataclasses.fields(SampleArgs):
        doc = f.metadata["doc"]
        if f.type == "bool":  # a switch that turns a default-on behaviour off
            p.add_argument(f"--no_{f.name.removeprefix('use_')}", dest=f.name, action="store_false", help=doc)
            continue
        kind = {"int": int, "float": float}.get(f.type, str)
        metavar = "PATH" if f.name == "ckpt" else None
        p.add_argument(
            f"--{f.name}", type=kind, default=f.default, choices=choices.get(f.name), help=doc, metavar=metavar
        )


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a trained run (hellaswag, loss, lm-eval, chat)",
        formatter_class=formatter,
        description="Evaluate <out_dir>/ckpt.pt (or --ckpt PATH) on a benchmark; the result goes to stdout.",
    )
    tasks = p.add_subparsers(dest="task", required=True)
    t = tasks.add_parser(
        "hellaswag",
        help="HellaSwag validation accuracy (acc, acc_norm)",
        formatter_class=formatter,
        description="Score <out_dir>/ckpt.pt (or --ckpt PATH) on HellaSwag's validation set, "
        "completion style; prints one line: examples, acc and acc_norm. Works under torchrun "
        "(sharded).",
    )
    t.set_defaults(handler="gptforge.evaluate.hellaswag:eval_hellaswag")
    add_model_source(t, "score", "run folder holding ckpt.pt (a GPT-2 BPE run)")
    t.add_argument(
        "--hellaswag_path",
        default=None,
        help="local hellaswag_val.jsonl (default: download it once into $GPTFORGE_CACHE_DIR/hellaswag, "
        "~/.cache/gptforge/hellaswag)",
    )
    t.add_argument("--limit", type=int, default=None, help="score only the first N examples (default: all 10,042)")
    t.add_argument("--batch_size", type=int, default=4, help="examples per forward pass (4 sequences each)")
    add_device(t)
    add_lm_eval(tasks)
    t = tasks.add_parser(
        "loss",
        help="loss and perplexity on a dataset's splits",
        formatter_class=formatter,
        description="Measure <out_dir>/ckpt.pt (or --ckpt PATH, or GPT-2's weights) on a prepared "
        "dataset: the mean cross-entropy over --eval_iters batches per split and its perplexity. "
        "Prints one line per split to stdout. The batches come from a private generator seeded "
        "with --seed, so the same command gives the same figures.",
    )
    t.set_defaults(handler="gptforge.evaluate.loss:eval_loss")
    add_model_source(t, "measure", "run folder holding ckpt.pt")
    t.add_argument("--dataset", default=None, help="dataset folder name under --data_dir (default: the run's)")
    t.add_argument("--data_dir", default=None, help="folder holding dataset folders (default: the run's, or data)")
    t.add_argument("--split", default="val", choices=["val", "train", "both"], help="which split(s) to measure")
    t.add_argument("--eval_iters", type=int, default=None, help="batches per split (default: the run's, or 200)")
    t.add_argument("--batch_size", type=int, default=None, help="sequences per batch (default: the run's, or 8)")
    t.add_argument(
        "--block_size",
        type=int,
        default=None,
        help="tokens per sequence (default: the run's; at most the model's block_size)",
    )
    add_device(t, seed_help="seed of the batch positions")
    add_eval_chat(tasks)


def add_eval_chat(tasks: argparse._SubParsersAction) -> None:
    t = tasks.add_parser(
        "chat",
        help="a chat model's exact match on held-out synthetic tasks",
        formatter_class=formatter,
        description="A chat model (gptforge train --task=sft) answers held-out synthetic problems (never in a "
        "training set) greedily; prints the exact match per kind and the share of answers ending with the end token.",
    )
    t.set_defaults(handler="gptforge.evaluate.chat:eval_chat")
    add_model_source(t, "score", "run folder holding ckpt.pt (an SFT run)")
    t.add_argument("--kinds", default="add3,recall", help="comma-separated task kinds: " + ",".join(ALL_KINDS))
    t.add_argument("--examples", type=int, default=200, help="problems per kind")
    t.add_argument("--max_new_tokens", type=int, default=48, help="longest answer generated")
    add_device(t, seed_help="seed choosing the problems")


def add_lm_eval(tasks: argparse._SubParsersAction) -> None:
    t = tasks.add_parser(
        "lm-eval",
        help="EleutherAI's lm-evaluation-harness tasks (hellaswag, arc_easy, piqa, ...)",
        formatter_class=formatter,
        description="Score <out_dir>/ckpt.pt (or --ckpt PATH, or --init_from=gpt2) with "
        "lm-evaluation-harness (pip install 'gptforge[eval]'), no export needed; prints lm-eval's "
        "table. The options are lm-eval's. Tasks load their datasets from the Hugging Face hub; "
        "offline, give --include_path with a task YAML over local files (README).",
    )
    add_model_source(t, "score", "run folder holding ckpt.pt (a BPE run: GPT-2's or an own tokenizer's)")
    t.set_defaults(handler="gptforge.evaluate.harness:eval_lm_eval")
    t.add_argument("--tasks", required=True, help="comma-separated lm-eval task, group or tag names")
    t.add_argument("--num_fewshot", type=int, default=None, help="examples in each prompt (default: each task's)")
    t.add_argument(
        "--limit",
        type=float,
        default=None,
        help="only the first N examples of each task (a number below 1: that fraction)",
    )
    t.add_argument("--batch_size", type=int, default=1, help="sequences per forward pass")
    t.add_argument("--include_path", default=None, metavar="DIR", help="a folder of your own task YAML files")
    t.add_argument("--output_path", default=None, metavar="FILE", help="write lm-eval's results as JSON to FILE")
    t.add_argument(
        "--log_samples",
        action="store_true",
        help="also put every example's requests and responses (log-likelihoods) in the JSON",
    )
    add_chat_template_options(t)
    add_device(t, seed_help="seed of lm-eval's few-shot sampling and of any sampling in generation")


def add_export_and_dashboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's model as a Hugging Face GPT-2 (or NanoChat) folder",
        formatter_class=formatter,
        description="Write <out_dir>/ckpt.pt (or --ckpt PATH) as a Hugging Face GPT-2 folder "
        "(config.json, model.safetensors and, for GPT-2 BPE runs, the tokenizer files) that "
        "transformers' GPT2LMHeadModel.from_pretrained and pipeline() load; a model with the "
        "nanochat switches on (rotary, rmsnorm, qk_norm, relu2, untie_head) as a NanoChat folder "
        "(NanoChatForCausalLM).",
    )
    p.add_argument("--out_dir", default="out", help="run folder holding ckpt.pt")
    p.add_argument(
        "--ckpt",
        default=None,
        metavar="PATH",
        help="a checkpoint file to export instead of <out_dir>/ckpt.pt (e.g. out/model_05000.pt)",
    )
    p.add_argument(
        "--to",
        required=True,
        default=argparse.SUPPRESS,
        metavar="FOLDER",
        help="the folder to create (it may exist if empty)",
    )
    p.add_argument("--force", action="store_true", help="replace FOLDER when it holds a previous export")
    p.set_defaults(handler="gptforge.weights.export:export_run")
    p = sub.add_parser(
        "dashboard",
        help="live web dashboard of training runs",
        formatter_class=formatter,
        description="Serve a live dashboard of the runs under FOLDERs: "
        "each is a run folder (with metrics.jsonl) or holds run folders a few levels down.",
    )
    p.add_argument("folders", nargs="*", default=["."], metavar="FOLDER", help="run folders or folders of runs")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 lets other machines read your runs"
    )
    p.add_argument(
        "--port", type=int, default=FIELDS["dashboard_port"].default, help="port to listen on; 0 picks a free one"
    )
    p.set_defaults(handler="gptforge.dashboard.server:serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gptforge",
        description="Prepare data, train, sample, evaluate, export, benchmark, watch runs in a dashboard.",
    )
    parser.add_argument("--version", action="version", version=f"gptforge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_prepare(sub)
    add_tokenizer(sub, formatter)
    sub.add_parser("train", help="train a GPT (nanoGPT config files and --key=value options)", add_help=False)
    sub.add_parser(
        "bench", help="time the training step: tokens/s, MFU, memory; --compare with the baseline", add_help=False
    )
    add_sample(sub)
    add_chat(sub, formatter)
    add_serve(sub, formatter)
    add_export_and_dashboard(sub)
    add_eval(sub)
    return parser


def add_chat_prepare(p: argparse.ArgumentParser) -> None:
    """`gptforge prepare chat`'s own options (issue: conversations packed for SFT)."""
    p.add_argument("--block_size", type=int, default=None, help="chat: tokens per training row (default: 256)")
    p.add_argument(
        "--include",
        default=None,
        metavar="RECIPES",
        help="chat: comma-separated built-in conversations to add: chitchat (the chitchat-dataset package, 4,017 "
        "human conversations), synthetic (offline tasks scored exactly: arithmetic, spelling, counting, recall, "
        "system instructions)",
    )
    p.add_argument(
        "--synthetic_examples", type=int, default=None, help="chat: synthetic conversations (default: 20,000)"
    )
    p.add_argument(
        "--synthetic_kinds",
        default=None,
        metavar="KINDS",
        help="chat: the synthetic task kinds, taken in turn; a kind named twice comes twice as often (default: "
        f"each once: {','.join(KINDS)}; also: {','.join(k for k in ALL_KINDS if k not in KINDS)})",
    )
    p.add_argument(
        "--last_turn_only",
        action="store_const",
        const=True,
        default=None,
        help="chat: train on each conversation's last assistant turn only",
    )
    p.add_argument(
        "--chat_format",
        default=None,
        choices=["openai", "sharegpt", "alpaca"],
        help="chat: the files' format (default: detected per line)",
    )

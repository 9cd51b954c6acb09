"""`gptforge tokenizer`'s parsers (kept apart from args.py, which holds every other subcommand's)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_tokenizer(sub: argparse._SubParsersAction, formatter: Callable[[str], argparse.HelpFormatter]) -> None:
    """`gptforge tokenizer train|stats|encode|decode`: an own byte-level BPE vocabulary (tokenizer/command.py)."""
    p = sub.add_parser(
        "tokenizer",
        help="train an own byte-level BPE tokenizer on your text; measure it, encode, decode",
        formatter_class=formatter,
        description="Own byte-level BPE tokenizers, kept as folders under tokenizers/NAME (Hugging Face's "
        "tokenizer.json among their files); `gptforge prepare ... --tokenizer NAME` then uses one.",
    )
    tasks = p.add_subparsers(dest="task", required=True)
    t = tasks.add_parser(
        "train",
        help="learn a vocabulary from files or folders of text",
        formatter_class=formatter,
        description="Learn a byte-level BPE vocabulary (the 256 bytes, the merges, then the reserved special "
        "tokens) from the text of FILE_OR_FOLDERs and write it to tokenizers/NAME; prints the folder. Folders "
        "give their text files (.txt, .md, .py, ...) and records (.jsonl, .jsonl.gz, .parquet), recursively.",
    )
    t.set_defaults(handler="gptforge.tokenizer.command:train_command")
    t.add_argument("files", nargs="+", metavar="FILE_OR_FOLDER", help="UTF-8 text files, record files or folders")
    t.add_argument("--vocab_size", type=int, required=True, help="ids in all, specials included (e.g. 4096, 32768)")
    t.add_argument("--name", required=True, help="the tokenizer's name: it is written to tokenizers/NAME")
    t.add_argument("--max_chars", type=int, default=1_000_000_000, help="read at most this many characters")
    t.add_argument("--doc_chars", type=int, default=None, help="read at most this many characters of each document")
    t.add_argument("--force", action="store_true", help="replace an existing tokenizer of the same name")
    t.add_argument("--text_field", default="text", help="field / column holding the text of record files")
    t.add_argument(
        "--max_digits",
        type=int,
        default=2,
        choices=(1, 2, 3),
        help="numbers are cut into runs of at most this many digits: 2 as nanochat, 3 as GPT-4, 1 (a token per "
        "digit, as LLaMA) helps a small model with arithmetic",
    )
    t = tasks.add_parser(
        "stats",
        help="bytes per token on a file, beside GPT-2's and char-level's",
        formatter_class=formatter,
        description="Encode FILE with the tokenizer and print bytes per token beside GPT-2's BPE and a "
        "character vocabulary's (higher: fewer tokens for the same text).",
    )
    t.set_defaults(handler="gptforge.tokenizer.command:stats_command")
    t.add_argument("--tokenizer", required=True, metavar="NAME_OR_FOLDER", help="an own tokenizer")
    t.add_argument("file", metavar="FILE", help="a UTF-8 text file (held-out text of the kind it was trained on)")
    t = tasks.add_parser("encode", help="print the ids of a text", formatter_class=formatter)
    t.set_defaults(handler="gptforge.tokenizer.command:encode_command")
    t.add_argument("--tokenizer", required=True, metavar="NAME_OR_FOLDER", help="an own tokenizer, or gpt2")
    t.add_argument("text", metavar="TEXT", help="the text (its pieces are shown on stderr)")
    t = tasks.add_parser("decode", help="print the text of ids", formatter_class=formatter)
    t.set_defaults(handler="gptforge.tokenizer.command:decode_command")
    t.add_argument("--tokenizer", required=True, metavar="NAME_OR_FOLDER", help="an own tokenizer, or gpt2")
    t.add_argument("ids", nargs="+", type=int, metavar="IDS", help="token ids")

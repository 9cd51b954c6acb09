"""`gptforge tokenizer train | stats | encode | decode`'s options, each written once (default, type, allowed values,
help text); the command line is built from them (cli/parsers.py) and tokenizer/command.py takes them as its
parameters."""

from __future__ import annotations

from dataclasses import dataclass

from gptforge.core.settings import REQUIRED, setting
from gptforge.tokenizer.bpe import MAX_DIGITS
from gptforge.tokenizer.train import MAX_CHARS


@dataclass(frozen=True, kw_only=True)
class TokenizerTrainArgs:
    files: list[str] = setting(
        REQUIRED, "UTF-8 text files, record files or folders", positional=True, metavar="FILE_OR_FOLDER"
    )
    vocab_size: int = setting(REQUIRED, "ids in all, specials included (e.g. 4096, 32768)")
    name: str = setting(REQUIRED, "the tokenizer's name: it is written to tokenizers/NAME")
    max_chars: int = setting(MAX_CHARS, "read at most this many characters")
    doc_chars: int | None = setting(None, "read at most this many characters of each document")
    force: bool = setting(False, "replace an existing tokenizer of the same name")
    text_field: str = setting("text", "field / column holding the text of record files")
    max_digits: int = setting(
        MAX_DIGITS,
        "numbers are cut into runs of at most this many digits: 2 as nanochat, 3 as GPT-4, 1 (a token per digit, as "
        "LLaMA) helps a small model with arithmetic",
        choices=(1, 2, 3),
    )


@dataclass(frozen=True, kw_only=True)
class TokenizerStatsArgs:
    tokenizer: str = setting(REQUIRED, "an own tokenizer", metavar="NAME_OR_FOLDER")
    file: str = setting(
        REQUIRED, "a UTF-8 text file (held-out text of the kind it was trained on)", positional=True, metavar="FILE"
    )


@dataclass(frozen=True, kw_only=True)
class EncodeArgs:
    tokenizer: str = setting(REQUIRED, "an own tokenizer, or gpt2", metavar="NAME_OR_FOLDER")
    text: str = setting(REQUIRED, "the text (its pieces are shown on stderr)", positional=True, metavar="TEXT")


@dataclass(frozen=True, kw_only=True)
class DecodeArgs:
    tokenizer: str = setting(REQUIRED, "an own tokenizer, or gpt2", metavar="NAME_OR_FOLDER")
    ids: list[int] = setting(REQUIRED, "token ids", positional=True, metavar="IDS")

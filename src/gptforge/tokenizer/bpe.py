"""An own byte-level BPE vocabulary (issue 26): `BPETokenizer` encodes with tiktoken from the trained ranks, the split
pattern and the reserved specials of `specials.py` (at the top ids), and lives in one folder (`save` / `load`, the
files below) that Hugging Face's tokenizers and transformers load as well. Training it: `tokenizer/train.py`."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from gptforge.core.errors import UserError
from gptforge.core.files import write_bytes
from gptforge.tokenizer.hf_format import GPTFORGE_FILE, tokenizer_config, tokenizer_json
from gptforge.tokenizer.specials import BOS, SPECIALS

# GPT-4's (cl100k) split pattern with numbers cut into runs of at most two digits (nanochat's variant). Training and
# encoding both use the pattern a tokenizer stores. Written without GPT-4's possessive quantifiers: they cut the same
# pieces here (no alternative can backtrack into a different match), but make tiktoken's regex engine (fancy-regex)
# run its slow backtracking path, about 25% slower on code; Oniguruma (Hugging Face tokenizers) reads it alike.
PATTERN_TEMPLATE = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,DIGITS}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
MAX_DIGITS = 2  # nanochat's; GPT-4's is 3; 1 (every digit its own token, as LLaMA) suits arithmetic in small models


def split_pattern(max_digits: int = MAX_DIGITS) -> str:
    """The split pattern with numbers cut into runs of at most `max_digits` digits."""
    return PATTERN_TEMPLATE.replace("DIGITS", str(max_digits))


PATTERN = split_pattern()

# A tokenizer folder's files
RANKS_FILE = "tokenizer.tiktoken"  # each ordinary token's bytes (base64) and rank, a line each, as OpenAI's files
HF_FILE = "tokenizer.json"  # Hugging Face tokenizers
HF_CONFIG_FILE = "tokenizer_config.json"  # transformers' AutoTokenizer
TOKEN_BYTES_FILE = "token_bytes.json"  # the bytes each id stands for (0 for specials): bits per byte
FOLDER_FILES = (GPTFORGE_FILE, RANKS_FILE, HF_FILE, HF_CONFIG_FILE, TOKEN_BYTES_FILE)
FORMAT = 1


class BPETokenizer:
    """Byte-level BPE: ids 0..len(ranks)-1 are the ranked byte strings (every single byte among them), the specials
    follow. `info` holds what `save` records beside the spec (trainer, corpus); it never changes encoding."""

    kind = "bpe"

    def __init__(
        self,
        ranks: Sequence[bytes],
        name: str,
        pattern: str = PATTERN,
        specials: Mapping[str, int] | None = None,
        info: Mapping[str, Any] | None = None,
    ):
        import tiktoken

        self.ranks = [bytes(t) for t in ranks]
        self.name, self.pattern, self.info = name, pattern, dict(info or {})
        self.specials = (
            dict(specials) if specials is not None else {s: len(self.ranks) + i for i, s in enumerate(SPECIALS)}
        )
        _check(self.ranks, self.specials, name)
        self.vocab_size = len(self.ranks) + len(self.specials)
        self.eot_token: int | None = self.specials[BOS]
        try:
            self.enc = tiktoken.Encoding(
                name=f"gptforge-{name}",
                pat_str=pattern,
                mergeable_ranks={t: i for i, t in enumerate(self.ranks)},
                special_tokens=self.specials,
            )
        except ValueError as e:  # tiktoken's message for a pattern its regex engine rejects
            raise UserError(f"tokenizer {name!r}: its split pattern does not compile ({e})") from None

    def encode(self, text: str) -> list[int]:
        """Ordinary text: special-token strings in it ("<|bos|>") are encoded as the characters they are."""
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        # ids past the vocabulary exist only as padding rows of a model's embedding; they carry no text
        return self.enc.decode([i for i in ids if 0 <= i < self.vocab_size])

    def special_id(self, name: str) -> int:
        """The id of a reserved special token (specials.py), e.g. special_id("<|bos|>")."""
        assert name in self.specials, f"{name!r} is not a special token of {self.name!r}: {list(self.specials)}"
        return self.specials[name]

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` decodes to (a special token: its string's UTF-8 bytes, as decode gives it)."""
        return self.enc.decode_single_token_bytes(i)

    def token_byte_lengths(self) -> list[int]:
        """For each id, how many bytes of text it stands for, 0 for the specials: the denominator of bits per byte
        (a model's padding rows past vocab_size count 0 too)."""
        return [len(t) for t in self.ranks] + [0] * len(self.specials)

    def spec(self) -> dict[str, Any]:
        """Everything encoding needs, in plain JSON types: meta.json and every checkpoint store it."""
        return {
            "tokenizer": self.kind,
            "name": self.name,
            "pattern": self.pattern,
            "ranks": [base64.b64encode(t).decode("ascii") for t in self.ranks],
            "specials": dict(self.specials),
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> BPETokenizer:
        try:
            ranks = [base64.b64decode(t, validate=True) for t in spec["ranks"]]
            return cls(ranks, spec["name"], spec["pattern"], {str(k): int(v) for k, v in spec["specials"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"a 'bpe' tokenizer record is damaged ({type(e).__name__}: {e}); re-create it") from None

    def save(self, folder: str, model_max_length: int | None = None) -> None:
        """Write this tokenizer's files (FOLDER_FILES) into `folder`, each atomically; `train_tokenizer` assembles a
        new folder under a temporary name. model_max_length goes into tokenizer_config.json (export sets it)."""
        os.makedirs(folder, exist_ok=True)
        meta = {
            "format": FORMAT,
            "tokenizer": self.kind,
            "name": self.name,
            "vocab_size": self.vocab_size,
            "pattern": self.pattern,
            "specials": self.specials,
        }
        meta.update({k: v for k, v in self.info.items() if k not in meta})  # trainer, corpus
        ranks = b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(self.ranks))
        files = {
            RANKS_FILE: ranks,
            HF_FILE: _json(tokenizer_json(self.ranks, self.pattern, self.specials), indent=None),
            HF_CONFIG_FILE: _json(tokenizer_config(self.specials, BOS, model_max_length)),
            TOKEN_BYTES_FILE: _json(self.token_byte_lengths(), indent=None),
            GPTFORGE_FILE: _json(meta),  # last: a folder with this file is whole
        }
        for name, data in files.items():
            write_bytes(os.path.join(folder, name), data, what=folder)

    @classmethod
    def load(cls, folder: str) -> BPETokenizer:
        """A tokenizer folder written by `save` (its gptforge_tokenizer.json and tokenizer.tiktoken)."""
        meta_path, ranks_path = os.path.join(folder, GPTFORGE_FILE), os.path.join(folder, RANKS_FILE)
        for path in (meta_path, ranks_path):
            if not os.path.isfile(path):
                raise UserError(f"{folder}: not a gptforge tokenizer folder ({os.path.basename(path)} is missing)")
        try:
            with open(meta_path, encoding="utf-8") as fh:
                meta = json.load(fh)
            ranks = _read_ranks(ranks_path)
            specials = {str(k): int(v) for k, v in meta["specials"].items()}
            tok = cls(ranks, meta["name"], meta["pattern"], specials, info=meta)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{folder}: cannot read the tokenizer ({type(e).__name__}: {e}); re-create it") from None
        if meta.get("vocab_size", tok.vocab_size) != tok.vocab_size:
            raise UserError(
                f"{folder}: {GPTFORGE_FILE} says vocab_size {meta['vocab_size']} but the files hold "
                f"{tok.vocab_size} tokens; re-create the tokenizer"
            )
        return tok


def resolve_folder(name_or_folder: str, root: str = "tokenizers") -> str:
    """A tokenizer's folder: `name_or_folder` itself when it is a folder, else `<root>/<name>` (like data/<dataset>,
    relative to the current directory)."""
    if os.path.isdir(name_or_folder):
        return name_or_folder
    candidate = os.path.join(root, name_or_folder)
    if os.sep not in name_or_folder and os.path.isdir(candidate):
        return candidate
    raise UserError(
        f"tokenizer {name_or_folder!r} not found: it is neither a folder nor a name under {root}/; train one with "
        f"`gptforge tokenizer train FILES --vocab_size N --name NAME` or give a tokenizer folder"
    )


def load_tokenizer(name_or_folder: str, root: str = "tokenizers") -> BPETokenizer:
    """The own tokenizer a flag names (--tokenizer NAME_OR_FOLDER): see `resolve_folder`."""
    return BPETokenizer.load(resolve_folder(name_or_folder, root))


def _check(ranks: list[bytes], specials: dict[str, int], name: str) -> None:
    """A vocabulary tiktoken can encode every text with: each byte alone is a token, no token twice, the specials
    on the ids after the ranks."""
    problems = []
    if len(set(ranks)) != len(ranks):
        problems.append("a token appears twice")
    if not {bytes([b]) for b in range(256)} <= set(ranks):
        problems.append("not every single byte is a token")
    if sorted(specials.values()) != list(range(len(ranks), len(ranks) + len(specials))):
        problems.append("the special tokens do not take the ids right after the ordinary tokens")
    if BOS not in specials:
        problems.append(f"no {BOS} token")
    if problems:
        raise UserError(f"tokenizer {name!r} is not a usable byte-level BPE: {'; '.join(problems)}; re-create it")


def _read_ranks(path: str) -> list[bytes]:
    ranks = []
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            token, rank = line.split()
            if int(rank) != len(ranks):
                raise ValueError(f"{path}:{lineno}: rank {int(rank)} out of order (expected {len(ranks)})")
            ranks.append(base64.b64decode(token, validate=True))
    return ranks


def _json(obj: Any, indent: int | None = 2) -> bytes:
    return (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode("utf-8")

"""Vocabularies in Hugging Face's formats (and the file that tells gptforge which tokenizer a folder holds). An own
byte-level BPE vocabulary: `tokenizer.json` (what `tokenizers.Tokenizer.from_file`
and transformers' fast tokenizers read) and `tokenizer_config.json`. Built from the ranks alone (each token's bytes,
lowest rank merged first, as tiktoken encodes), so a checkpoint's spec is enough to write them. Standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from gptforge.core.files import write_bytes

# Written into every tokenizer folder gptforge makes (an own tokenizer's, and every export's): which tokenizer the
# folder's model reads ({"tokenizer": "char" | "gpt2" | "bpe", ...}), so gptforge reads the folder back with it.
GPTFORGE_FILE = "gptforge_tokenizer.json"


def byte_to_char() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as Hugging Face's ByteLevel pre-tokenizer and decoder use it: the
    printable Latin-1 bytes stand for themselves, the 68 others (controls, space, ...) take U+0100 on, in byte
    order. (weights/export.py holds the same table for GPT-2's files; it sits above this stage and imports torch.)"""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    for offset, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(0x100 + offset)
    return table


def merges_from_ranks(ranks: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
    """The pair merges that make a rank-based byte-pair encoder (tiktoken's) and a merge-list encoder (Hugging
    Face's BPE) agree, in priority order.

    tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest rank; Hugging Face merges
    the adjacent pair listed first. So every way of cutting token r into two tokens of lower rank is listed, the
    cuts of token r after those of every token below r (among one token's cuts, the lower-ranked left part first).
    Only tokens whose two halves are both tokens can ever be produced by merging; the others (a trainer may keep
    a few) are reached only as a whole pre-tokenized piece, which both encoders look up before merging.
    """
    rank = {token: r for r, token in enumerate(ranks)}
    merges = []
    for r, token in enumerate(ranks):
        cuts = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if rank.get(left, r) < r and rank.get(right, r) < r:
                cuts.append((rank[left], rank[right], left, right))
        merges.extend((left, right) for _, _, left, right in sorted(cuts))
    return merges


def tokenizer_json(ranks: Sequence[bytes], pattern: str, specials: Mapping[str, int]) -> dict[str, Any]:
    """The tokenizer.json object: our split pattern, then bytes to GPT-2's characters, then BPE with the merges of
    `merges_from_ranks`; whole pieces found in the vocabulary are taken as they are (ignore_merges), as tiktoken
    does. Special tokens are added tokens: Hugging Face, unlike `BPETokenizer.encode`, maps their strings in text to
    their ids, which is what a chat template rendered to text needs."""
    to_char = byte_to_char()

    def text(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    added = [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s, i in sorted(specials.items(), key=lambda item: item[1])
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text(token): i for i, token in enumerate(ranks)},
            # "a b" strings, which every tokenizers version reads: GPT-2's characters hold no space
            "merges": [f"{text(a)} {text(b)}" for a, b in merges_from_ranks(ranks)],
        },
    }


def tokenizer_config(specials: Mapping[str, int], bos: str, model_max_length: int | None = None) -> dict[str, Any]:
    """tokenizer_config.json for transformers' AutoTokenizer: a plain fast tokenizer over tokenizer.json that adds
    no tokens of its own and leaves spaces alone on decode; the document boundary is both bos and eos (as GPT-2's
    <|endoftext|> is). model_max_length is the model's business: set only when a model is exported with it."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": bos,
        "additional_special_tokens": [s for s in specials if s != bos],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for s, i in specials.items()
        },
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return config


def char_tokenizer_json(itos: Sequence[str]) -> dict[str, Any]:
    """tokenizer.json for a character vocabulary: a BPE model with no merges and no pre-tokenizer splits text into
    its characters, each one token (a character outside the vocabulary is dropped: gptforge refuses it instead);
    the Fuse decoder joins them back without spaces."""
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None}
    model.update(end_of_word_suffix=None, fuse_unk=False, byte_fallback=False, ignore_merges=False)
    model.update(vocab={c: i for i, c in enumerate(itos)}, merges=[])
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": model,
    }


def write_json(folder: str, name: str, obj: Any) -> None:
    """One JSON file of a tokenizer folder, written atomically."""
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    write_bytes(os.path.join(folder, name), text.encode("utf-8"), what=folder)

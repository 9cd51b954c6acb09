"""`prepare_chat`: conversations (JSONL files, the chit-chat set, synthetic tasks) rendered with the loss mask, packed
into rows of block_size + 1 tokens and written to <data_dir>/<name>/ (chat/pack.py names the files) with a
meta.json that says "format": "chat", the tokenizer, and what happened (counts, cuts, drops, padding).

    from gptforge.chat.prepare import prepare_chat
    prepare_chat(["talk.jsonl"], "talk", {"tokenizer": "gpt2"}, block_size=512, recipes=["chitchat", "synthetic"])

Every input is read and checked before anything is written: a bad line is a UserError naming FILE:LINE and the
folder is left as it was. The held-out split is chosen by a hash of each conversation's content, so a conversation
that appears twice is never in both splits.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from gptforge.chat.conversations import Conversation, read_chitchat, read_file
from gptforge.chat.pack import Packed, fill_rows, plan_rows, write_packed
from gptforge.chat.render import TRAINED_ROLES, chat_special_ids, encode
from gptforge.chat.synthetic import ALL_KINDS, KINDS, generate, words_from_text
from gptforge.core.console import log
from gptforge.core.errors import UserError
from gptforge.tokenizer.spec import from_spec
from gptforge.tokenizer.specials import BOS

CHAT_RECIPES = ("chitchat", "synthetic")
MIN_BLOCK_SIZE = 8


def _token_meta(tok: Any, special_ids: dict[str, int], vocab_size: int, dtype: Any) -> dict[str, Any]:
    """The meta keys of a chat dataset's tokens: its format, vocabulary, tokenizer, id dtype and special ids."""
    return {
        "format": "chat",
        "vocab_size": vocab_size,
        **tok.spec(),
        "dtype": np.dtype(dtype).name,
        "eot_token": tok.eot_token,
        "bos_token": special_ids[BOS],
        "pad_token": special_ids[BOS],  # padding's mask is 0: it is never trained on
        "special_ids": special_ids,
    }


def prepare_chat(
    paths: Sequence[str],
    name: str,
    tokenizer_spec: dict[str, Any],
    block_size: int,
    data_dir: str = "data",
    val_fraction: float = 0.05,
    fmt: str | None = None,
    last_turn_only: bool = False,
    recipes: Sequence[str] = (),
    synthetic_examples: int = 20_000,
    synthetic_kinds: Sequence[str] | None = None,
    seed: int = 1337,
    split_long: bool = True,
    words_file: str | None = None,
    synthetic_tools: str = "none",
) -> dict[str, Any]:
    """Write the chat dataset <data_dir>/<name>/ and return its meta. paths: JSONL / JSON files (fmt: 'openai',
    'sharegpt', 'alpaca', or None to detect per record); recipes: 'chitchat' (the chitchat-dataset package) and
    'synthetic' (synthetic_examples train-split tasks of chat/synthetic.py, the kinds of synthetic_kinds in turn,
    None: each once; words from words_file's text or made up; synthetic_tools 'calculator': arithmetic answered
    with a calculator call). A conversation longer than a row is cut at a turn
    boundary; split_long (not with last_turn_only) keeps its rest as further documents, each starting with the
    system message again, else the rest is dropped. seed fixes the synthetic tasks and the row order."""
    _check_options(name, block_size, val_fraction)
    tok = from_spec(tokenizer_spec)
    special_ids = chat_special_ids(tok)
    conversations, sources = gather(
        paths, fmt, recipes, synthetic_examples, seed, words_file, synthetic_kinds, synthetic_tools
    )
    trainable = [c for c in conversations if any(m.role in TRAINED_ROLES and m.train for m in c.messages)]
    splits = split_conversations(trainable, val_fraction)
    vocab_size = max(tok.vocab_size, max(special_ids.values()) + 1)
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    done = {
        s: pack_split(c, tok, special_ids, block_size + 1, last_turn_only, split_long, seed, dtype)
        for s, c in splits.items()
    }
    packed: dict[str, Packed] = {split: rows for split, (rows, _) in done.items()}
    counts: dict[str, dict[str, Any]] = {split: n for split, (_, n) in done.items()}
    meta = {
        **_token_meta(tok, special_ids, vocab_size, dtype),
        "block_size": block_size,
        "row_tokens": block_size + 1,
        "last_turn_only": last_turn_only,
        "split_long": split_long and not last_turn_only,
        "val_fraction": val_fraction,
        "seed": seed,
        "sources": sources,
        "synthetic_kinds": _kinds_made(synthetic_kinds, sources),
        "synthetic_tools": synthetic_tools if "synthetic" in sources else None,
        "untrained": len(conversations) - len(trainable),
        "counts": counts,
    }
    folder = os.path.join(data_dir, name)
    meta = write_packed(folder, packed, meta)
    _log_summary(folder, meta)
    return meta


def _kinds_made(synthetic_kinds: Sequence[str] | None, sources: dict[str, int]) -> list[str] | None:
    """The synthetic task kinds in the dataset (what SFT's evaluation asks), None without synthetic tasks."""
    return [k for k in ALL_KINDS if k in (synthetic_kinds or KINDS)] if "synthetic" in sources else None


def _check_options(name: str, block_size: int, val_fraction: float) -> None:
    if not name:
        raise UserError("a chat dataset needs a --name")
    if block_size < MIN_BLOCK_SIZE:
        raise UserError(f"--block_size must be at least {MIN_BLOCK_SIZE} for chat rows, got {block_size}")
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val_fraction must be between 0 and 1, got {val_fraction}")


def gather(
    paths: Sequence[str],
    fmt: str | None,
    recipes: Sequence[str],
    synthetic_examples: int,
    seed: int,
    words_file: str | None,
    synthetic_kinds: Sequence[str] | None = None,
    synthetic_tools: str = "none",
) -> tuple[list[Conversation], dict[str, int]]:
    """Every conversation of the files and recipes, checked, and how many came from each."""
    unknown = [r for r in recipes if r not in CHAT_RECIPES]
    if unknown:
        raise UserError(f"unknown chat recipe(s) {', '.join(unknown)}; choose from {', '.join(CHAT_RECIPES)}")
    conversations: list[Conversation] = []
    sources: dict[str, int] = {}
    for path in paths:
        read = read_file(path, fmt)
        sources[path] = len(read)
        conversations += read
    if "chitchat" in recipes:
        read = read_chitchat()
        sources["chitchat"] = len(read)
        conversations += read
    if "synthetic" in recipes:
        if synthetic_examples < 1:
            raise UserError(f"the synthetic recipe needs a positive number of examples, got {synthetic_examples}")
        words = words_from_text(_read_words_file(words_file)) if words_file else None
        kinds = synthetic_kinds or KINDS
        examples = generate(synthetic_examples, seed, "train", kinds=kinds, words=words, tools=synthetic_tools)
        sources["synthetic"] = len(examples)
        conversations += [e.conversation() for e in examples]
    if not conversations:
        raise UserError("no conversations to prepare: give chat FILEs (JSONL) or a recipe (chitchat, synthetic)")
    return conversations, sources


def _read_words_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"words file {path!r} cannot be read as UTF-8 text ({e})") from None


def split_conversations(conversations: list[Conversation], val_fraction: float) -> dict[str, list[Conversation]]:
    """{'train': ..., 'val': ...}: a conversation is held out when the hash of its content falls under
    val_fraction (at least one is)."""
    if len(conversations) < 2:
        raise UserError(
            f"{len(conversations)} trainable conversation(s): too few for a train and a held-out split; give more"
        )
    hashes = [_content_hash(c) for c in conversations]
    val = {i for i, h in enumerate(hashes) if h < val_fraction} or {min(range(len(hashes)), key=hashes.__getitem__)}
    if len(val) == len(conversations):
        val = set(list(val)[:-1])
    return {
        "train": [c for i, c in enumerate(conversations) if i not in val],
        "val": [c for i, c in enumerate(conversations) if i in val],
    }


def _content_hash(conversation: Conversation) -> float:
    text = json.dumps([[m.role, m.content, m.train] for m in conversation.messages], ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big") / 2.0**64


def pack_split(
    conversations: list[Conversation],
    tok: Any,
    special_ids: dict[str, int],
    row_len: int,
    last_turn_only: bool,
    split_long: bool,
    seed: int,
    dtype: Any,
) -> tuple[Packed, dict[str, Any]]:
    """One split's rows (chat/pack.py's plan_rows, then each piece rendered) and its counts."""
    encoded = [encode(c, tok) for c in conversations]
    plan = plan_rows([(e.header, e.exchange_lengths()) for e in encoded], row_len, split_long and not last_turn_only)
    order = np.random.default_rng(seed).permutation(len(plan.rows))
    rows = [[encoded[d].render(special_ids, a, b, last_turn_only) for d, a, b in plan.rows[r]] for r in order]
    packed = fill_rows(rows, row_len, special_ids[BOS], dtype)
    tokens = packed.tokens.size - packed.padding
    counts = {
        "conversations": len(conversations),
        "documents": sum(len(row) for row in rows),
        "rows": len(packed),
        "tokens": tokens,
        "trained_tokens": int(packed.mask.sum(dtype=np.int64)),
        "cut": plan.cut,
        "pieces": plan.pieces,
        "dropped": plan.dropped,
        "dropped_exchanges": plan.dropped_exchanges,
        "waste": round(packed.waste, 6),
        "left_out_sources": _left_out_sources(conversations, encoded, row_len),
    }
    return packed, counts


def _left_out_sources(conversations: list[Conversation], encoded: list[Any], row_len: int) -> dict[str, list[int]]:
    """{source: [left out, of]} for each source (a synthetic kind, a file, chitchat) that loses at least half its
    conversations because not even one exchange of them fits a row: a whole kind lost is said by name."""
    lost: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for conversation, e in zip(conversations, encoded, strict=True):
        where = conversation.where
        source = where if where.startswith("synthetic:") else (where.rpartition(":")[0] or where)
        total[source] += 1
        lost[source] += not any(e.header + n <= row_len for n in e.exchange_lengths())
    return {source: [n, total[source]] for source, n in sorted(lost.items()) if n and 2 * n >= total[source]}


def _log_summary(folder: str, meta: dict[str, Any]) -> None:
    row_len = meta["row_tokens"]
    log("read " + "; ".join(f"{source}: {n:,}" for source, n in meta["sources"].items()) + " conversations")
    if meta["untrained"]:
        log(f"skipped {meta['untrained']:,} conversations with no trained message (all marked train: false)")
    for split, c in meta["counts"].items():
        log(
            f"{split}: {c['conversations']:,} conversations, {c['documents']:,} documents in {c['rows']:,} rows of "
            f"{row_len} tokens; {c['tokens']:,} tokens, {c['trained_tokens']:,} trained "
            f"({c['trained_tokens'] / max(c['tokens'], 1):.0%}); padding {c['waste']:.2%} of the rows"
        )
        if c["cut"]:
            rest = f"the rest in {c['pieces']:,} more documents" if meta["split_long"] else "the rest dropped"
            log(f"  {c['cut']:,} conversations longer than {row_len} tokens cut at a turn boundary, {rest}")
        if c["dropped"] or c["dropped_exchanges"]:
            log(
                f"  left out: {c['dropped_exchanges']:,} exchanges (too long for a row, or past a cut), "
                f"{c['dropped']:,} conversations with no exchange that fits"
            )
        for source, (lost, of) in (c.get("left_out_sources") or {}).items():
            log(
                f"  warning: {source}: {lost:,} of {of:,} conversations left out, longer than a {row_len}-token row "
                "even one exchange at a time: raise --block_size (and the model's) or shorten them"
            )
    log(f"wrote {folder}/{{train,val}}_{{tokens,mask,bounds,offsets}}.npy, meta.json")

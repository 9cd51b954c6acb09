"""Corpora too big for memory (files, openwebtext, fineweb_edu): documents in, GPT-2 token shards out, resumable
after a crash (build-nanogpt's fineweb.py as a tool). Commands in README.md, "Data at scale"; the shard format
and how a killed run resumes in docs/ARCHITECTURE.md, "Files"."""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gptforge.core.console import log, progress
from gptforge.core.errors import UserError
from gptforge.core.files import atomic_write, write_bytes
from gptforge.data import SHARD_RECIPES
from gptforge.data.prepare import token_dtype
from gptforge.data.sources import Source, files_source, hub_source
from gptforge.tokenizer.spec import Tokenizer, from_spec, named_tokenizer

STATE_FILE = ".prepare_state.json"
STATE_VERSION = 1
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}  # little-endian on every machine
CHUNK_CHARS = 1 << 20  # text per task sent to a worker: big enough to amortise the pickling, small for memory


def prepare_shards(
    recipe: str,
    data_dir: str = "data",
    paths: Sequence[str] = (),
    name: str | None = None,
    input_path: str | None = None,
    text_field: str = "text",
    shard_size: int = 100_000_000,
    val_tokens: int = 1_000_000,
    num_proc: int | None = None,
    tokenizer: str = "gpt2",
) -> dict[str, Any]:
    """Run a sharded recipe (files, openwebtext, fineweb_edu); returns the meta.json it wrote. tokenizer: 'gpt2' or
    an own tokenizer's name or folder."""
    if recipe not in SHARD_RECIPES:
        raise UserError(f"unknown sharded recipe {recipe!r}; choose one of {', '.join(SHARD_RECIPES)}")
    if shard_size < 1:
        raise UserError(f"--shard_size must be a positive number of tokens, got {shard_size}")
    if val_tokens < 1:
        raise UserError(f"--val_tokens must be at least 1 (the loader needs a val split), got {val_tokens}")
    num_proc = num_proc if num_proc is not None else min(os.cpu_count() or 1, 8)
    if num_proc < 1:
        raise UserError(f"--num_proc must be at least 1, got {num_proc}")
    tok = shard_tokenizer(tokenizer)
    if recipe == "files":
        if not paths or not name:
            raise UserError("`gptforge prepare files` needs one or more PATHs (files or folders) and --name NAME")
        source = files_source(paths, text_field)
    else:
        if paths:
            raise UserError(f"recipe {recipe!r} takes no PATH arguments; use --input PATH for a local copy")
        name = name or recipe
        source = hub_source(recipe, input_path, text_field)
    options = {
        "version": STATE_VERSION,
        "recipe": recipe,
        "source": source.fingerprint,
        "text_field": text_field,
        "shard_size": shard_size,
        "val_tokens": val_tokens,
        "tokenizer": tokenizer_fingerprint(tok),
    }
    folder = os.path.join(data_dir, name)
    return ShardWriter(folder, name, options, shard_size, val_tokens, tok).run(source, num_proc)


def shard_tokenizer(value: str) -> Tokenizer:
    """GPT-2 BPE or an own BPE: a character vocabulary is built from the whole text, which shards never hold."""
    if value == "char":
        raise UserError(
            "--tokenizer char: a character vocabulary is made from the whole text, and the sharded recipes stream "
            "theirs; use gpt2 or an own tokenizer (`gptforge tokenizer train`), or recipe 'text' for char-level"
        )
    return named_tokenizer(value)


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """What the resume state records of the tokenizer: 'gpt2', or an own BPE's name and a hash of its spec (a
    retrained tokenizer of the same name starts the shards over)."""
    if tok.kind == "gpt2":
        return "gpt2"
    spec = json.dumps(tok.spec(), sort_keys=True).encode("utf-8")
    return f"{tok.kind}:{tok.spec().get('name')}:{hashlib.sha256(spec).hexdigest()[:16]}"


# ---------------------------------------------------------------------------------------------- tokenizing


def _init_worker(parent: int, spec: dict[str, Any]) -> None:
    """Worker setup: the tokenizer rebuilt from its spec, once per process, and exit when the parent dies (even by
    SIGKILL)."""
    global _TOKENIZER  # per-process state of a pool worker, never of the library
    _TOKENIZER = from_spec(spec)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


_TOKENIZER: Tokenizer | None = None


def encode_chunk(docs: list[str], tok: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of docs, each preceded by the document boundary (GPT-2's <|endoftext|>, an own BPE's <|bos|>),
    concatenated (uint16, or uint32 for a vocabulary past 65,536), and each document's length."""
    tok = tok or _TOKENIZER
    assert tok is not None, "encode_chunk runs in a worker set up by _init_worker, or is given a tokenizer"
    encoded = tok.encode_batch(docs)
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.empty(int(lengths.sum()), dtype=TOKEN_DTYPES[token_dtype(tok.vocab_size)])
    pos = 0
    for ids in encoded:
        tokens[pos] = tok.eot_token
        tokens[pos + 1 : pos + 1 + len(ids)] = ids
        pos += len(ids) + 1
    return tokens, lengths


def chunks(documents: Iterable[str]) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for doc in documents:
        chunk.append(doc)
        chars += len(doc)
        if chars >= CHUNK_CHARS or len(chunk) >= 4096:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def encoded_documents(
    documents: Iterable[str], num_proc: int, tok: Tokenizer
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, lengths) per chunk, in input order. At most 2 * num_proc chunks are in flight, so memory stays
    bounded however long the stream (Pool.imap would read the whole input ahead)."""
    if num_proc == 1:
        for chunk in chunks(documents):
            yield encode_chunk(chunk, tok)
        return
    import multiprocessing

    with multiprocessing.Pool(num_proc, initializer=_init_worker, initargs=(os.getpid(), tok.spec())) as pool:
        pending: deque = deque()
        for chunk in chunks(documents):
            pending.append(pool.apply_async(encode_chunk, (chunk,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---------------------------------------------------------------------------------------------- writing


@dataclass
class State:
    """What is on disk for sure: whole shards, and where in the document stream the next token comes from."""

    options: dict[str, Any]
    shards: dict[str, list[str]] = field(default_factory=lambda: {"val": [], "train": []})
    tokens: dict[str, int] = field(default_factory=lambda: {"val": 0, "train": 0})
    document: int = 0  # index of the document the next unwritten token belongs to
    offset: int = 0  # tokens of that document already in written shards
    val_documents: int | None = None  # set once val is closed: the number of documents it holds
    complete: bool = False


class ShardWriter:
    def __init__(
        self, folder: str, name: str, options: dict[str, Any], shard_size: int, val_tokens: int, tok: Tokenizer
    ):
        self.folder, self.name, self.options = folder, name, options
        self.shard_size, self.val_tokens, self.tok = shard_size, val_tokens, tok
        self.dtype = TOKEN_DTYPES[token_dtype(tok.vocab_size)]

    def run(self, source: Source, num_proc: int) -> dict[str, Any]:
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create {self.folder!r}: {e.strerror}; check --data_dir") from None
        state = self.load_state()
        if state.complete:
            log(f"{self.folder} is already complete for these inputs and options; nothing to do")
            return self.write_meta(state, source)
        self.remove_stale_files(state)
        if state.shards["val"] or state.shards["train"]:
            log(
                f"resuming {self.folder}: {len(state.shards['val'])} val and {len(state.shards['train'])} train "
                f"shards done, continuing at document {state.document:,}"
            )
        try:
            self.fill(state, source, num_proc)
        except KeyboardInterrupt:
            log("interrupted: the whole shards are kept; run the same command again to resume")
            raise
        state.complete = True
        self.save_state(state)
        meta = self.write_meta(state, source)
        for split in ("val", "train"):
            log(
                f"{split}: {meta['documents'][split]:,} documents, {meta['tokens'][split]:,} tokens in "
                f"{len(meta['shards'][split])} shards"
            )
        log(f"wrote {self.folder}/{self.name}_{{val,train}}_*.bin, meta.json")
        return meta

    # -- the main loop

    def fill(self, state: State, source: Source, num_proc: int) -> None:
        buffer = np.empty(self.shard_size, dtype=self.dtype)
        fill = 0
        split = "train" if state.val_documents is not None else "val"
        doc = state.document
        skip = state.offset  # tokens of the first document already written
        # val so far, counting whole documents: the tokens in val shards less the carried-over part
        val_seen = state.tokens["val"] - (skip if split == "val" else 0)
        bar = progress(source.total, f"tokenizing {self.name}", "doc", initial=doc, mininterval=1.0)
        try:
            documents = itertools.islice(source.documents, doc, None)
            for tokens, lengths in encoded_documents(documents, num_proc, self.tok):
                starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
                for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
                    if split == "val" and val_seen >= self.val_tokens:  # val is full: close it, train begins
                        if fill:
                            self.write_shard(state, "val", buffer[:fill])
                            fill = 0
                        split, state.val_documents = "train", doc
                        state.document, state.offset = doc, 0
                        self.save_state(state)
                    if split == "val":
                        val_seen += length
                    pos = skip
                    skip = 0
                    while pos < length:
                        take = min(self.shard_size - fill, length - pos)
                        buffer[fill : fill + take] = tokens[start + pos : start + pos + take]
                        fill, pos = fill + take, pos + take
                        if fill == self.shard_size:
                            self.write_shard(state, split, buffer)
                            fill = 0
                            state.document, state.offset = (doc, pos) if pos < length else (doc + 1, 0)
                            self.save_state(state)
                    doc += 1
                bar.update(len(lengths))
        finally:
            bar.close()
        if split == "val":
            raise UserError(
                f"all {doc:,} documents ({val_seen:,} tokens) went to the val split; lower --val_tokens "
                f"(now {self.val_tokens:,}) or give more text"
            )
        if fill:
            self.write_shard(state, "train", buffer[:fill])
        if not state.shards["train"]:
            raise UserError(f"no documents left for train after {doc:,} val documents; lower --val_tokens")
        state.document, state.offset = doc, 0

    def write_shard(self, state: State, split: str, tokens: np.ndarray) -> None:
        index = len(state.shards[split])
        name = f"{self.name}_{split}_{index:06d}.bin"
        final = os.path.join(self.folder, name)
        try:
            with atomic_write(final) as fh:
                fh.write(tokens.tobytes())
        except OSError as e:
            raise UserError(f"cannot write {final}: {e.strerror}; check free space in {self.folder}") from None
        state.shards[split].append(name)
        state.tokens[split] += len(tokens)

    # -- state and meta

    @property
    def state_path(self) -> str:
        return os.path.join(self.folder, STATE_FILE)

    def load_state(self) -> State:
        """The previous run's state when it matches these options and its shards are whole, else a fresh one."""
        fresh = State(options=self.options)
        try:
            with open(self.state_path, encoding="utf-8") as fh:
                saved = json.load(fh)
            state = State(**saved)
        except FileNotFoundError:
            return fresh
        except (OSError, ValueError, TypeError):
            log(f"{self.state_path} is unreadable: starting over")
            return fresh
        if state.options != self.options:
            changed = sorted(k for k in {*state.options, *self.options} if state.options.get(k) != self.options.get(k))
            log(
                f"{self.folder}: the inputs or options changed since the last run ({', '.join(changed)}): starting over"
            )
            return fresh
        for split, names in state.shards.items():
            for i, shard in enumerate(names):
                path = os.path.join(self.folder, shard)
                last = i == len(names) - 1 and (split == "val" and state.val_documents is not None or state.complete)
                expected = (state.tokens[split] - i * self.shard_size) if last else self.shard_size
                if not os.path.isfile(path) or os.path.getsize(path) != expected * self.dtype.itemsize:
                    log(f"{path} is missing or has the wrong size: starting over")
                    return fresh
        return state

    def save_state(self, state: State) -> None:
        write_bytes(self.state_path, json.dumps(state.__dict__, indent=1).encode("utf-8"))

    def remove_stale_files(self, state: State) -> None:
        """Delete what the state does not vouch for: meta.json, shards of an abandoned run, temporary files."""
        keep = set(state.shards["val"]) | set(state.shards["train"])
        folder = glob.escape(self.folder)
        shards = [f"{glob.escape(self.name)}_{split}_" + "[0-9]" * 6 + ".bin" for split in ("val", "train")]
        stale = [os.path.join(self.folder, "meta.json")]
        for pattern in shards:
            stale += [p for p in glob.glob(os.path.join(folder, pattern)) if os.path.basename(p) not in keep]
        for pattern in [*shards, "meta.json", glob.escape(STATE_FILE)]:
            # left by a killed writer: files.temp_path's `.<name>.<pid>.tmp`, or the `<name>.tmp` of earlier versions
            for temporary in (f".{pattern}.*.tmp", f"{pattern}.tmp"):
                stale += glob.glob(os.path.join(folder, temporary))
        for path in stale:
            if os.path.exists(path):
                os.remove(path)
        self.save_state(state)

    def write_meta(self, state: State, source: Source) -> dict[str, Any]:
        assert state.val_documents is not None, "meta is written only after val was closed"
        meta = {
            "vocab_size": self.tok.vocab_size,
            **self.tok.spec(),
            "dtype": token_dtype(self.tok.vocab_size),
            "eot_token": self.tok.eot_token,
            "format": "shards",
            "shard_size": self.shard_size,
            "shards": state.shards,
            "tokens": state.tokens,
            "documents": {"train": state.document - state.val_documents, "val": state.val_documents},
            "source": source.description,
        }
        write_bytes(os.path.join(self.folder, "meta.json"), (json.dumps(meta, indent=1) + "\n").encode("utf-8"))
        return meta

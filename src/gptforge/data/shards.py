"""Corpora too big for memory: documents in, GPT-2 token shards out (build-nanogpt's fineweb.py as a tool).

    gptforge prepare files corpus/ more.jsonl.gz --name web --shard_size 100000000 --val_tokens 1000000
    gptforge prepare openwebtext [--input PATH]          # Hugging Face "openwebtext"
    gptforge prepare fineweb_edu [--input PATH]          # Hugging Face "HuggingFaceFW/fineweb-edu", sample-10BT

Writes `<data_dir>/<name>/<name>_<split>_<NNNNNN>.bin`: flat little-endian uint16 GPT-2 token ids, every
document preceded by the end-of-text token 50256, in input order. Every shard holds exactly `shard_size`
tokens except the last of its split. The first documents go to `val` until it holds `val_tokens` tokens,
the rest to `train`. `meta.json` ({"format": "shards", "shards": {...}, "tokens", "documents", ...}) is
written last.

Documents are tokenized in `num_proc` worker processes. Each shard is written under a `.tmp` name, fsynced
and renamed, then `.prepare_state.json` records what is done (shards and the position in the document
stream), so a killed run leaves only whole shards; running the same command again resumes after the last
whole shard, and the result is byte-identical to an uninterrupted run. Changed inputs or options start over.
"""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gptforge.errors import UserError
from gptforge.tokenizer import GPT2Tokenizer

SHARD_RECIPES = ("files", "openwebtext", "fineweb_edu")
HUB = {  # recipe -> load_dataset arguments
    "openwebtext": {"path": "openwebtext", "split": "train"},
    "fineweb_edu": {"path": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT", "split": "train", "streaming": True},
}
EXTENSIONS = (".jsonl", ".jsonl.gz", ".parquet", ".txt")
EOT = 50256
STATE_FILE = ".prepare_state.json"
STATE_VERSION = 1
TOKEN_DTYPE = np.dtype("<u2")  # GPT-2's 50,257 ids fit in 16 bits; little-endian on every machine
CHUNK_CHARS = 1 << 20  # text per task sent to a worker: big enough to amortise the pickling, small for memory
# Fault injection for the crash-safety tests: SIGKILL this process halfway through writing shard number N.
FAULT_ENV = "GPTFORGE_FAULT_SHARD"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Source:
    """An ordered stream of documents plus what identifies it (for resume) and how to describe it (meta)."""

    documents: Iterable[str]
    fingerprint: Any
    description: str
    total: int | None = None  # number of documents, when known (progress bar)


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
) -> dict[str, Any]:
    """Run a sharded recipe (files, openwebtext, fineweb_edu); returns the meta.json it wrote."""
    if recipe not in SHARD_RECIPES:
        raise UserError(f"unknown sharded recipe {recipe!r}; choose one of {', '.join(SHARD_RECIPES)}")
    if shard_size < 1:
        raise UserError(f"--shard_size must be a positive number of tokens, got {shard_size}")
    if val_tokens < 1:
        raise UserError(f"--val_tokens must be at least 1 (the loader needs a val split), got {val_tokens}")
    num_proc = num_proc if num_proc is not None else min(os.cpu_count() or 1, 8)
    if num_proc < 1:
        raise UserError(f"--num_proc must be at least 1, got {num_proc}")
    if recipe == "files":
        if not paths or not name:
            raise UserError("`gptforge prepare files` needs one or more PATHs (files or folders) and --name NAME")
        source = files_source(paths, text_field)
    else:
        if paths:
            raise UserError(f"recipe {recipe!r} takes no PATH arguments; use --input PATH for a local copy")
        name = name or recipe
        source = hub_source(recipe, input_path, text_field)
    options = {"version": STATE_VERSION, "recipe": recipe, "source": source.fingerprint, "text_field": text_field,
               "shard_size": shard_size, "val_tokens": val_tokens, "tokenizer": "gpt2"}
    folder = os.path.join(data_dir, name)
    return ShardWriter(folder, name, options, shard_size, val_tokens).run(source, num_proc)


# ---------------------------------------------------------------------------------------------- sources


def expand_paths(paths: Sequence[str]) -> list[str]:
    """Files in the order given; a folder contributes its supported files, sorted, recursively."""
    out = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(
                p for p in glob.glob(os.path.join(glob.escape(path), "**", "*"), recursive=True)
                if os.path.isfile(p) and p.endswith(EXTENSIONS)
            )
            if not found:
                raise UserError(f"folder {path!r} holds no {', '.join(EXTENSIONS)} files")
            out.extend(found)
        elif not os.path.exists(path):
            raise UserError(f"input {path!r} not found; give existing files or folders")
        elif not path.endswith(EXTENSIONS):
            raise UserError(f"{path}: unsupported file type; give {', '.join(EXTENSIONS)} files (or a folder of them)")
        elif not os.access(path, os.R_OK):
            raise UserError(f"{path}: not readable (permission denied); fix its permissions")
        else:
            out.append(path)
    return out


def files_source(paths: Sequence[str], text_field: str) -> Source:
    files = expand_paths(paths)
    fingerprint = []
    for f in files:
        st = os.stat(f)
        fingerprint.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    shown = ", ".join(files[:5]) + (f", ... ({len(files)} files)" if len(files) > 5 else "")
    return Source(iter_files(files, text_field), fingerprint, f"files: {shown}")


def iter_files(files: Sequence[str], text_field: str) -> Iterator[str]:
    for path in files:
        if path.endswith(".txt"):
            yield read_txt(path)
        elif path.endswith(".parquet"):
            yield from iter_parquet(path, text_field)
        else:
            yield from iter_jsonl(path, text_field)


def read_txt(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e}); convert it to UTF-8 first") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None


def iter_jsonl(path: str, text_field: str) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise UserError(f"{path}:{lineno}: not a JSON object per line ({e}); is this JSON Lines?") from None
                text = row.get(text_field) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                    raise UserError(
                        f"{path}:{lineno}: no string field {text_field!r} (found: {keys}); "
                        "choose the field with --text_field"
                    )
                yield text
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e}); convert it to UTF-8 first") from None
    except (gzip.BadGzipFile, EOFError) as e:
        raise UserError(f"{path}: not a whole gzip file ({e}); re-download or re-compress it") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None


def iter_parquet(path: str, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading .parquet needs pyarrow: pip install 'gptforge[data]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for files that are not parquet
        raise UserError(f"{path}: not a readable parquet file ({e})") from None
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise UserError(f"{path}: no column {text_field!r} (found: {', '.join(columns)}); choose one with --text_field")
    for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise UserError(f"{path}: column {text_field!r} holds a {type(text).__name__}, not text")
            yield text


def hub_source(recipe: str, input_path: str | None, text_field: str) -> Source:
    """The recipe's Hugging Face dataset, or --input: a `save_to_disk` folder or data files / folders."""
    if input_path and not _is_saved_dataset(input_path):
        source = files_source([input_path], text_field)
        source.description = f"{recipe} from {input_path}"
        return source
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"recipe {recipe!r} reads Hugging Face datasets: pip install 'gptforge[data]', or pass --input PATH "
            "to local .jsonl / .jsonl.gz / .parquet / .txt files"
        ) from None
    if input_path:
        try:
            ds = datasets.load_from_disk(input_path)
        except Exception as e:  # corrupt or foreign folders raise a variety of errors
            raise UserError(f"--input {input_path}: not a dataset saved with save_to_disk ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise UserError(f"--input {input_path}: a DatasetDict without a 'train' split ({', '.join(ds)})")
            ds = ds["train"]
        fingerprint = ["disk", _folder_fingerprint(input_path)]
        description = f"{recipe} from {input_path}"
    else:
        args = HUB[recipe]
        log(f"loading {args['path']} through Hugging Face datasets (this downloads it the first time)")
        try:
            ds = datasets.load_dataset(**args)
        except Exception as e:  # offline / hub errors come as ConnectionError, OSError, ValueError, ...
            raise UserError(
                f"could not load {args['path']!r} from the Hugging Face hub ({type(e).__name__}: {e}). Offline? "
                f"Pass --input PATH: a local copy saved with datasets' save_to_disk, or .jsonl / .parquet files"
            ) from None
        fingerprint = ["hub", args]
        description = f"hf: {args['path']}" + (f" ({args['name']})" if "name" in args else "")
    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise UserError(f"{description}: no column {text_field!r} (found: {', '.join(columns)}); use --text_field")
    total = len(ds) if isinstance(ds, datasets.Dataset) else None
    return Source(_iter_dataset(ds, text_field), fingerprint, description, total)


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def _folder_fingerprint(folder: str) -> list[list[Any]]:
    out = []
    for root, _, names in sorted(os.walk(folder)):
        for n in sorted(names):
            st = os.stat(os.path.join(root, n))
            out.append([os.path.relpath(os.path.join(root, n), folder), st.st_size, st.st_mtime_ns])
    return [[os.path.abspath(folder)], *out]


def _iter_dataset(ds: Any, text_field: str) -> Iterator[str]:
    for batch in ds.iter(batch_size=1000):
        if text_field not in batch:
            raise UserError(f"the dataset has no column {text_field!r} (found: {', '.join(batch)}); use --text_field")
        yield from batch[text_field]


# ---------------------------------------------------------------------------------------------- tokenizing


def _init_worker(parent: int) -> None:
    """Worker setup: a tokenizer per process, and exit when the parent dies (even by SIGKILL)."""
    global _TOKENIZER  # per-process state of a pool worker, never of the library
    _TOKENIZER = GPT2Tokenizer()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


_TOKENIZER: GPT2Tokenizer | None = None


def encode_chunk(docs: list[str], tok: GPT2Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of docs, each preceded by EOT, concatenated (uint16), and each document's length."""
    tok = tok or _TOKENIZER
    assert tok is not None, "encode_chunk runs in a worker set up by _init_worker, or is given a tokenizer"
    encoded = tok.encode_batch(docs)
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.empty(int(lengths.sum()), dtype=TOKEN_DTYPE)
    pos = 0
    for ids in encoded:
        tokens[pos] = EOT
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


def encoded_documents(documents: Iterable[str], num_proc: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, lengths) per chunk, in input order. At most 2 * num_proc chunks are in flight, so memory stays
    bounded however long the stream (Pool.imap would read the whole input ahead)."""
    if num_proc == 1:
        tok = GPT2Tokenizer()
        for chunk in chunks(documents):
            yield encode_chunk(chunk, tok)
        return
    import multiprocessing

    with multiprocessing.Pool(num_proc, initializer=_init_worker, initargs=(os.getpid(),)) as pool:
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
    def __init__(self, folder: str, name: str, options: dict[str, Any], shard_size: int, val_tokens: int):
        self.folder, self.name, self.options = folder, name, options
        self.shard_size, self.val_tokens = shard_size, val_tokens
        self.fault_at = int(os.environ.get(FAULT_ENV, "-1"))

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
            log(f"resuming {self.folder}: {len(state.shards['val'])} val and {len(state.shards['train'])} train "
                f"shards done, continuing at document {state.document:,}")
        try:
            self.fill(state, source, num_proc)
        except KeyboardInterrupt:
            log("interrupted: the whole shards are kept; run the same command again to resume")
            raise
        state.complete = True
        self.save_state(state)
        meta = self.write_meta(state, source)
        for split in ("val", "train"):
            log(f"{split}: {meta['documents'][split]:,} documents, {meta['tokens'][split]:,} tokens in "
                f"{len(meta['shards'][split])} shards")
        log(f"wrote {self.folder}/{self.name}_{{val,train}}_*.bin, meta.json")
        return meta

    # -- the main loop

    def fill(self, state: State, source: Source, num_proc: int) -> None:
        buffer = np.empty(self.shard_size, dtype=TOKEN_DTYPE)
        fill = 0
        split = "train" if state.val_documents is not None else "val"
        doc = state.document
        skip = state.offset  # tokens of the first document already written
        # val so far, counting whole documents: the tokens in val shards less the carried-over part
        val_seen = state.tokens["val"] - (skip if split == "val" else 0)
        from tqdm import tqdm

        bar = tqdm(total=source.total, initial=doc, unit="doc", desc=f"tokenizing {self.name}", file=sys.stderr,
                   mininterval=1.0, dynamic_ncols=True)
        try:
            documents = itertools.islice(source.documents, doc, None)
            for tokens, lengths in encoded_documents(documents, num_proc):
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
        data = tokens.tobytes()
        n_written = len(state.shards["val"]) + len(state.shards["train"])
        try:
            with open(final + ".tmp", "wb") as fh:
                if n_written == self.fault_at:
                    fh.write(data[: len(data) // 2])
                    fh.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(final + ".tmp", final)
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
            log(f"{self.folder}: the inputs or options changed since the last run ({', '.join(changed)}): "
                "starting over")
            return fresh
        for split, names in state.shards.items():
            for i, shard in enumerate(names):
                path = os.path.join(self.folder, shard)
                last = i == len(names) - 1 and (split == "val" and state.val_documents is not None or state.complete)
                expected = (state.tokens[split] - i * self.shard_size) if last else self.shard_size
                if not os.path.isfile(path) or os.path.getsize(path) != expected * TOKEN_DTYPE.itemsize:
                    log(f"{path} is missing or has the wrong size: starting over")
                    return fresh
        return state

    def save_state(self, state: State) -> None:
        data = json.dumps(state.__dict__, indent=1).encode("utf-8")
        _write_atomic(self.state_path, data)

    def remove_stale_files(self, state: State) -> None:
        """Delete what the state does not vouch for: meta.json, .tmp files, shards of an abandoned run."""
        keep = set(state.shards["val"]) | set(state.shards["train"])
        folder = glob.escape(self.folder)
        stale = [os.path.join(self.folder, "meta.json"), os.path.join(self.folder, "meta.json.tmp")]
        for split in ("val", "train"):
            pattern = os.path.join(folder, f"{glob.escape(self.name)}_{split}_" + "[0-9]" * 6 + ".bin")
            stale += [p for p in glob.glob(pattern) if os.path.basename(p) not in keep] + glob.glob(pattern + ".tmp")
        for path in stale:
            if os.path.exists(path):
                os.remove(path)
        self.save_state(state)

    def write_meta(self, state: State, source: Source) -> dict[str, Any]:
        assert state.val_documents is not None, "meta is written only after val was closed"
        meta = {
            "vocab_size": 50257, "tokenizer": "gpt2", "dtype": "uint16", "eot_token": EOT, "format": "shards",
            "shard_size": self.shard_size, "shards": state.shards, "tokens": state.tokens,
            "documents": {"train": state.document - state.val_documents, "val": state.val_documents},
            "source": source.description,
        }
        _write_atomic(os.path.join(self.folder, "meta.json"), (json.dumps(meta, indent=1) + "\n").encode("utf-8"))
        return meta


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}; check the folder and free space") from None

"""Where a shard dataset's documents come from: local files and folders, or a Hugging Face dataset (the hub or a
save_to_disk copy), each an ordered stream of texts with a fingerprint that tells a resumed prepare whether the
inputs changed. Supported inputs in README.md, "Data at scale"; docs/ARCHITECTURE.md, "Files"."""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gptforge.core.console import log
from gptforge.core.errors import UserError

HUB = {  # recipe -> load_dataset arguments
    "openwebtext": {"path": "openwebtext", "split": "train"},
    "fineweb_edu": {"path": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT", "split": "train", "streaming": True},
}
EXTENSIONS = (".jsonl", ".jsonl.gz", ".parquet", ".txt")


@dataclass
class Source:
    """An ordered stream of documents plus what identifies it (for resume) and how to describe it (meta)."""

    documents: Iterable[str]
    fingerprint: Any
    description: str
    total: int | None = None  # number of documents, when known (progress bar)


def expand_paths(paths: Sequence[str]) -> list[str]:
    """Files in the order given; a folder contributes its supported files, sorted, recursively."""
    out = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(
                p
                for p in glob.glob(os.path.join(glob.escape(path), "**", "*"), recursive=True)
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


def read_txt(path: str, name: str | None = None) -> str:
    """A whole UTF-8 text file; failures are user errors naming `name` (the flag or file; default the path)."""
    name = name or path
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as e:
        raise UserError(f"{name}: not UTF-8 text ({e}); convert it to UTF-8 first") from None
    except OSError as e:
        raise UserError(f"{name}: cannot read it ({e.strerror or e})") from None


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

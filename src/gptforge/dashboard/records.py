"""The JSON files of a run folder, read without trusting them: metrics.jsonl incrementally, samples.jsonl's tail,
config.json. Bounded reads, malformed lines skipped and counted, NaN made null (docs/ARCHITECTURE.md, "The
dashboard")."""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass
from typing import Any

MAX_LINE = 1 << 20  # bytes; a longer metrics line is skipped (a metrics line is ~200 bytes)
MAX_READ = 4 << 20  # bytes of metrics.jsonl read per request; the client asks again for the rest
MAX_SMALL_FILE = 1 << 20  # config.json larger than this is not read
SAMPLES_TAIL = 1 << 20  # bytes read from the end of samples.jsonl
MARK_BYTES = 64  # the bytes before a read's offset that its mark sums up


def clean(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities (metrics.py writes them with allow_nan) become None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value


def parse_line(raw: bytes) -> dict[str, Any] | None:
    """One metrics.jsonl line -> a record with an int `step` and a str `kind`, or None if it is not one."""
    if len(raw) > MAX_LINE:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return None
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    record["step"] = int(step)
    return clean(record)


def file_id(st: os.stat_result) -> str:
    """Names one version of a file: train rewrites metrics.jsonl through a rename, which changes the inode."""
    return f"{st.st_dev:x}-{st.st_ino:x}"


def tail_mark(fh, offset: int) -> str:
    """A checksum of the MARK_BYTES bytes before `offset` of an open binary file ("" at 0). A resume rewrites
    metrics.jsonl through renames, and the file system may give the new file the old one's inode number (two
    rewrites between polls: the resumed run replaces its step's record): the mark tells the old content from the
    new where the file id cannot."""
    if offset <= 0:
        return ""
    start = max(0, offset - MARK_BYTES)
    fh.seek(start)
    return f"{zlib.crc32(fh.read(offset - start)):08x}"


@dataclass
class Chunk:
    """The records read from metrics.jsonl between `start` and `offset` (bytes)."""

    records: list[dict[str, Any]]
    offset: int  # where the next read starts: after the last complete line read
    file: str  # file_id of the file read; when it changes, the client starts again from 0
    size: int  # bytes in the file now
    skipped: int = 0  # malformed or oversized lines passed over
    reset: bool = False  # the client's offset or file id did not match this file: read from 0
    mark: str = ""  # tail_mark at `offset`: sent back with it, a file rewritten under the same id reads from 0

    @property
    def more(self) -> bool:
        return self.offset < self.size


def read_lines(fh, offset: int, limit: int = MAX_READ) -> tuple[list[bytes], int, int]:
    """Complete lines of an open binary file from byte `offset`, about `limit` bytes of them at most.

    Returns (lines, offset after the last one, oversized lines passed over). A partial last line (being
    written) is left for the next read. A line over MAX_LINE bytes is skipped whole, even when its end is not
    written yet: the next read resumes mid-line and that rest fails to parse.
    """
    fh.seek(offset)
    lines: list[bytes] = []
    oversized = 0
    read = 0
    while read < limit:
        line = fh.readline(MAX_LINE + 1)
        if not line:
            break
        if not line.endswith(b"\n"):
            if len(line) <= MAX_LINE:
                break  # still being written
            oversized += 1  # skip to the end of the line, or of the file for now
            read += len(line)
            while line and not line.endswith(b"\n"):
                line = fh.readline(MAX_LINE)
                read += len(line)
            offset = fh.tell()
            continue
        read += len(line)
        offset += len(line)
        if line.strip():
            lines.append(line)
    return lines, offset, oversized


def open_at(path: str, offset: int, file: str | None, mark: str | None = None):
    """(binary file, its stat, start offset, reset): reset when `file` names another file, offset is past its end,
    or `mark` is not the tail_mark of the bytes before offset (the file was rewritten under the same id).

    Raises OSError (FileNotFoundError when the run was deleted).
    """
    fh = open(path, "rb")
    try:
        st = os.fstat(fh.fileno())
        reset = offset < 0 or offset > st.st_size or (file is not None and file != file_id(st))
        reset = reset or (mark is not None and mark != tail_mark(fh, offset))
    except OSError:
        fh.close()
        raise
    return fh, st, 0 if reset else offset, reset


def read_records(
    path: str, offset: int = 0, file: str | None = None, limit: int = MAX_READ, mark: str | None = None
) -> Chunk:
    """The records of a metrics.jsonl from byte `offset` (see read_lines); malformed lines are counted, not kept.

    `file` and `mark` are the file id and mark of the previous read: a different file (a new run renamed in), or
    other bytes before `offset`, restarts from 0. Raises OSError (FileNotFoundError when the run was deleted).
    """
    fh, st, offset, reset = open_at(path, offset, file, mark)
    with fh:
        lines, offset, skipped = read_lines(fh, offset, limit)
        end_mark = tail_mark(fh, offset)
    records = []
    for line in lines:
        record = parse_line(line)
        if record is None:
            skipped += 1
        else:
            records.append(record)
    return Chunk(records, offset, file_id(st), st.st_size, skipped, reset, end_mark)


def read_json(path: str) -> Any:
    """A small JSON file, or None when it is missing, too big or malformed."""
    try:
        if os.path.getsize(path) > MAX_SMALL_FILE:
            return None
        with open(path, "rb") as fh:
            return clean(json.loads(fh.read()))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None


def read_samples(path: str, limit: int = 20) -> list[dict[str, Any]]:
    """The last `limit` objects of samples.jsonl (one JSON object per line), read from its last megabyte."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - SAMPLES_TAIL))
            data = fh.read(SAMPLES_TAIL)
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > SAMPLES_TAIL:
        lines = lines[1:]  # the first piece may be the end of a line cut by the seek
    out: list[dict[str, Any]] = []
    for line in reversed(lines):
        if len(out) >= limit:
            break
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(obj, dict):
            out.append(clean(obj))
    return out[::-1]

"""Packing rendered conversations into training rows, and the files that hold them.

A row is block_size + 1 tokens (the inputs and, shifted by one, the targets). Documents (rendered conversations,
each starting with <|bos|>) are placed by best-fit decreasing: the longest first, each into the row whose free
space it fills most tightly, a new row when none has room. A conversation longer than a row is cut between
exchanges beforehand (`plan_rows`), its pieces chosen to fill the space the others leave. So every document starts
at a row's start or right after another one (BOS-aligned), none is split across rows, and the rest of a row is
padding whose mask is 0. Each row keeps its document boundaries, for a block-diagonal causal attention mask
(`Packed.doc_ids`). On the chit-chat set the padding is 1.3% of the rows at block_size 256, 0.5% at 512.

On disk, per split: <split>_tokens.npy (rows, block_size + 1) uint16 / uint32, <split>_mask.npy (same shape,
uint8), <split>_bounds.npy (int32: for each row its documents' starts, then where its padding starts) and
<split>_offsets.npy (int64, rows + 1: row r's bounds are bounds[offsets[r]:offsets[r + 1]]), with meta.json
("format": "chat", written by chat/prepare.py) renamed into place last.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gptforge.core.errors import UserError
from gptforge.core.files import atomic_write

ARRAYS = ("tokens", "mask", "bounds", "offsets")


@dataclass
class Packed:
    tokens: np.ndarray  # (rows, row_len) token ids; padding is pad_id
    mask: np.ndarray  # (rows, row_len) uint8: 1 where the token is a trained target
    bounds: np.ndarray  # int32: per row, each document's start, then the end of its last document
    offsets: np.ndarray  # (rows + 1,) int64 into bounds

    def __len__(self) -> int:
        return len(self.tokens)

    def row_bounds(self, row: int) -> np.ndarray:
        """[start of document 0, start of document 1, ..., end of the last document (where padding starts)]."""
        return self.bounds[self.offsets[row] : self.offsets[row + 1]]

    def doc_ids(self, row: int) -> np.ndarray:
        """Each position's document index in the row; the padding is one more 'document' after the last.
        Attention from i to j is allowed when doc_ids[i] == doc_ids[j] and j <= i."""
        ends = self.row_bounds(row)[1:]
        return np.searchsorted(ends, np.arange(self.tokens.shape[1]), side="right").astype(np.int32)

    @property
    def padding(self) -> int:
        used = self.bounds[self.offsets[1:] - 1]  # each row's last bound: where its padding starts
        return int(self.tokens.size - used.sum(dtype=np.int64))

    @property
    def waste(self) -> float:
        """The share of the rows' tokens that is padding."""
        return self.padding / self.tokens.size if self.tokens.size else 0.0


def best_fit(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Rows as lists of document indices, by best-fit decreasing (ties in index order, so it is deterministic)."""
    free: list[tuple[int, int]] = []  # (free space, row), sorted: the tightest fit is the first with enough space
    rows: list[list[int]] = []
    for doc in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[doc]
        assert 0 < n <= row_len, f"document {doc} has {n} tokens; rows hold {row_len} (cut it before packing)"
        _, space, row = _tightest(free, n, row_len)
        _take(rows, free, space, row, n).append(doc)
    return rows


@dataclass
class Plan:
    """Which piece of which document goes in which row: rows[r] lists (document, first exchange, end exchange)."""

    rows: list[list[tuple[int, int, int]]]
    cut: int = 0  # documents longer than a row
    pieces: int = 0  # pieces of them past their first (split_long)
    dropped: int = 0  # documents with no exchange that fits a row
    dropped_exchanges: int = 0  # exchanges longer than a row with the header, or (not split_long) past the cut


def plan_rows(layouts: Sequence[tuple[int, Sequence[int]]], row_len: int, split_long: bool = True) -> Plan:
    """Place documents given as (header tokens, exchange lengths) in rows of row_len tokens.

    Those that fit go whole, by best-fit decreasing; without split_long a longer one is cut to its longest start
    that fits and goes with them. With split_long a longer one (the longest first) is cut between exchanges into
    pieces that each start with the header: each piece the run of exchanges, from where the last one ended, that
    fills an open row's free space or a new row most tightly (the longer run on a tie), so pieces of the long
    documents fill what the whole ones leave free. An exchange too long for a row with the header is skipped."""
    plan, ends = Plan([]), {}
    for doc, (header, lengths) in enumerate(layouts):
        runs = _runs(header, lengths, 0, row_len)
        if runs and runs[-1][1] == len(lengths):
            ends[doc] = len(lengths)
        elif not split_long:
            plan.cut += 1
            plan.dropped += not runs
            ends[doc] = runs[-1][1] if runs else 0
            plan.dropped_exchanges += len(lengths) - ends[doc]
    fixed = [doc for doc, end in ends.items() if end]
    sizes = [layouts[doc][0] + sum(layouts[doc][1][: ends[doc]]) for doc in fixed]
    fits = best_fit(sizes, row_len)
    plan.rows = [[(fixed[i], 0, ends[fixed[i]]) for i in row] for row in fits]
    free = sorted((row_len - sum(sizes[i] for i in row), r) for r, row in enumerate(fits))
    free = [(space, r) for space, r in free if space > 0]
    long = [doc for doc in range(len(layouts)) if doc not in ends]
    for doc in sorted(long, key=lambda d: (-layouts[d][0] - sum(layouts[d][1]), d)):
        _split(plan, free, doc, *layouts[doc], row_len)
    return plan


def _split(
    plan: Plan, free: list[tuple[int, int]], doc: int, header: int, lengths: Sequence[int], row_len: int
) -> None:
    """Document `doc`, longer than a row, in pieces that fill rows most tightly (plan_rows)."""
    first, placed = 0, 0
    while first < len(lengths):
        runs = _runs(header, lengths, first, row_len)
        if not runs:
            plan.dropped_exchanges += 1
            first += 1
            continue
        options = [(*_tightest(free, n, row_len), end, n) for n, end in runs]  # (left, space, row, end, n)
        _, space, row, end, n = min(options, key=lambda o: (o[0], -o[3]))
        _take(plan.rows, free, space, row, n).append((doc, first, end))
        first, placed = end, placed + 1
    plan.cut += 1
    plan.pieces += max(placed - 1, 0)
    plan.dropped += placed == 0


def _runs(header: int, lengths: Sequence[int], first: int, row_len: int) -> list[tuple[int, int]]:
    """(tokens, end) of each run of exchanges first..end-1 that fits in a row after the header."""
    out, total = [], header
    for j in range(first, len(lengths)):
        total += lengths[j]
        if total > row_len:
            break
        out.append((total, j + 1))
    return out


def _tightest(free: list[tuple[int, int]], n: int, row_len: int) -> tuple[int, int, int]:
    """(space left after n tokens, free space, row) for the open row that n tokens fill most tightly, or a new
    row (row -1) when none has room."""
    at = bisect.bisect_left(free, (n, -1))
    space, row = free[at] if at < len(free) else (row_len, -1)
    return space - n, space, row


def _take(rows: list[list[Any]], free: list[tuple[int, int]], space: int, row: int, n: int) -> list[Any]:
    """Row `row` (-1: a new one) with n of its `space` free tokens taken; returns its list to append to."""
    if row < 0:
        row = len(rows)
        rows.append([])
    else:
        free.pop(bisect.bisect_left(free, (space, row)))
    if space > n:
        bisect.insort(free, (space - n, row))
    return rows[row]


def pack_documents(
    docs: Sequence[tuple[Sequence[int], Sequence[int]]],
    row_len: int,
    pad_id: int,
    dtype: Any = np.uint16,
    seed: int = 0,
) -> Packed:
    """Whole (ids, mask) documents into rows of exactly row_len tokens by best-fit decreasing, the rows in a seeded
    random order."""
    rows = best_fit([len(ids) for ids, _ in docs], row_len)
    order = np.random.default_rng(seed).permutation(len(rows))
    return fill_rows([[docs[i] for i in rows[r]] for r in order], row_len, pad_id, dtype)


def fill_rows(
    rows: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]], row_len: int, pad_id: int, dtype: Any = np.uint16
) -> Packed:
    """The arrays of rows given as lists of (ids, mask) documents, each row's documents one after another from its
    start, the rest pad_id with mask 0."""
    tokens = np.full((len(rows), row_len), pad_id, dtype=dtype)
    mask = np.zeros((len(rows), row_len), dtype=np.uint8)
    bounds: list[int] = []
    offsets = [0]
    for r, row in enumerate(rows):
        at = 0
        for ids, doc_mask in row:
            assert len(ids) == len(doc_mask), f"row {r}: a document has {len(ids)} ids but {len(doc_mask)} mask values"
            assert at + len(ids) <= row_len, f"row {r}: documents of {at + len(ids)} tokens overflow {row_len}"
            bounds.append(at)
            tokens[r, at : at + len(ids)] = ids
            mask[r, at : at + len(ids)] = doc_mask
            at += len(ids)
        bounds.append(at)
        offsets.append(len(bounds))
    return Packed(tokens, mask, np.asarray(bounds, dtype=np.int32), np.asarray(offsets, dtype=np.int64))


def split_files(split: str) -> dict[str, str]:
    return {array: f"{split}_{array}.npy" for array in ARRAYS}


def write_packed(folder: str, splits: dict[str, Packed], meta: dict[str, Any]) -> dict[str, Any]:
    """Every split's arrays and meta.json (`meta` with the file names added: returned), all or nothing: meta.json
    takes its name last, so a reader never sees a meta whose files are not all in place; a failed write leaves the
    folder as it was (or, stopped between renames, without a meta.json)."""
    meta = {**meta, "files": {split: split_files(split) for split in splits}}
    try:
        os.makedirs(folder, exist_ok=True)
        with contextlib.ExitStack() as staged:  # nested atomic writes rename in reverse order: meta.json last
            meta_fh = staged.enter_context(atomic_write(os.path.join(folder, "meta.json")))
            for split, packed in splits.items():
                for array, name in split_files(split).items():
                    fh = staged.enter_context(atomic_write(os.path.join(folder, name)))
                    np.save(fh, getattr(packed, array), allow_pickle=False)
                    _sync(fh)  # a full disk fails here, before anything is renamed
            meta_fh.write((json.dumps(meta, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))
            _sync(meta_fh)
            with contextlib.suppress(FileNotFoundError):  # no old meta beside new arrays if the renames stop halfway
                os.remove(os.path.join(folder, "meta.json"))
    except OSError as e:
        raise UserError(
            f"cannot write the chat dataset into {folder!r}: {e.strerror or e}; check its free space"
        ) from None
    return meta


def _sync(fh: Any) -> None:
    fh.flush()
    os.fsync(fh.fileno())


def read_packed(folder: str, split: str, meta: dict[str, Any] | None = None, mmap: bool = True) -> Packed:
    """One split of a prepared chat dataset (memory-mapped by default), checked against its meta."""
    meta = meta if meta is not None else read_chat_meta(folder)
    names = (meta.get("files") or {}).get(split)
    if not names:
        raise UserError(f"{folder}/meta.json lists no {split!r} split; re-run the chat prepare")
    arrays = {}
    for array in ARRAYS:
        path = os.path.join(folder, names[array])
        try:
            arrays[array] = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: missing or not a numpy array ({e}); re-run the chat prepare") from None
    packed = Packed(**arrays)
    rows, row_len = packed.tokens.shape
    if packed.mask.shape != (rows, row_len) or len(packed.offsets) != rows + 1 or row_len != meta.get("row_tokens"):
        raise UserError(f"{folder}: the {split} arrays do not fit together or the meta; re-run the chat prepare")
    return packed


def read_chat_meta(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "meta.json")
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: missing or not JSON ({e}); prepare the chat dataset first") from None
    if meta.get("format") != "chat":
        raise UserError(f"{path}: not a chat dataset (format {meta.get('format', 'tokens')!r}); prepare one for chat")
    return meta

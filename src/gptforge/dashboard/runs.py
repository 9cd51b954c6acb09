"""Run folders on disk, read without ever writing: discovery, incremental metrics reads, run state.

A run folder is any folder holding `metrics.jsonl` (gptforge train writes it with `config.json`, `log.txt`,
`ckpt.pt`, and later `samples.jsonl`). The dashboard's server asks a `RunIndex` for the runs under the folders
it was given and reads each run's files through the `Run` it returns; nothing here takes a path from a client.

State of a run (`Run.state()`), decided from the files alone:
  finished  a `{"kind": "end"}` line, or an eval line at step >= config.json's max_iters (train's last step
            always evaluates, so this line is the last thing a complete run writes)
  running   otherwise, metrics.jsonl changed within RUNNING_WINDOW_S seconds (or 3 x the usual gap between
            its recent lines, when lines come slower than that: a big log_interval on a slow machine)
  stopped   otherwise, and ckpt.pt is newer than the last line: the run was interrupted (Ctrl-C, SIGTERM) and
            saved a checkpoint on the way out; `--init_from=resume` continues it
  crashed   otherwise: no new line for a while and no checkpoint after the last one
  missing   metrics.jsonl is gone (the folder was deleted or renamed while watched)

Skipped steps: train writes `{"kind": "skip", "loss": NaN, "grad_norm": NaN, "in_a_row": k, "max_bad_steps": m}`
for a step whose loss or gradient norm was not finite (the weights stay as they were), and stops after m such
steps in a row without an `end` line. The summary counts them (`skipped`) and keeps the last one (`last_skip`).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

METRICS = "metrics.jsonl"
CONFIG = "config.json"
SAMPLES = "samples.jsonl"
CHECKPOINT = "ckpt.pt"

MAX_DEPTH = 3  # a run folder, a folder of runs, a sweep of folders of runs, one more level
MAX_SCAN_ENTRIES = 20_000  # per root and scan, so a dashboard started in $HOME does not crawl the disk
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "wandb"}
MAX_LINE = 1 << 20  # bytes; a longer metrics line is skipped (a metrics line is ~200 bytes)
MAX_READ = 4 << 20  # bytes of metrics.jsonl read per request; the client asks again for the rest
MAX_SMALL_FILE = 1 << 20  # config.json larger than this is not read
SAMPLES_TAIL = 1 << 20  # bytes read from the end of samples.jsonl
RUNNING_WINDOW_S = 60.0


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


@dataclass
class Chunk:
    """The records read from metrics.jsonl between `start` and `offset` (bytes)."""

    records: list[dict[str, Any]]
    offset: int  # where the next read starts: after the last complete line read
    file: str  # file_id of the file read; when it changes, the client starts again from 0
    size: int  # bytes in the file now
    skipped: int = 0  # malformed or oversized lines passed over
    reset: bool = False  # the client's offset or file id did not match this file: read from 0

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


def open_at(path: str, offset: int, file: str | None):
    """(binary file, its stat, start offset, reset): reset when `file` names another file or offset is past its end.

    Raises OSError (FileNotFoundError when the run was deleted).
    """
    fh = open(path, "rb")
    st = os.fstat(fh.fileno())
    reset = offset < 0 or offset > st.st_size or (file is not None and file != file_id(st))
    return fh, st, 0 if reset else offset, reset


def read_records(path: str, offset: int = 0, file: str | None = None, limit: int = MAX_READ) -> Chunk:
    """The records of a metrics.jsonl from byte `offset` (see read_lines); malformed lines are counted, not kept.

    `file` is the file id of the previous read: a different file (a new run renamed in) restarts from 0.
    Raises OSError (FileNotFoundError when the run was deleted).
    """
    fh, st, offset, reset = open_at(path, offset, file)
    with fh:
        lines, offset, skipped = read_lines(fh, offset, limit)
    records = []
    for line in lines:
        record = parse_line(line)
        if record is None:
            skipped += 1
        else:
            records.append(record)
    return Chunk(records, offset, file_id(st), st.st_size, skipped, reset)


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


@dataclass
class Summary:
    """What the run list shows, kept up to date by reading only the new bytes of metrics.jsonl."""

    offset: int = 0
    file: str | None = None
    first_time: float | None = None
    last: dict[str, Any] | None = None  # the last record of any kind
    last_train: dict[str, Any] | None = None
    last_eval: dict[str, Any] | None = None
    best_val: float | None = None
    ended: bool = False
    skipped: int = 0  # skip records: steps whose loss or gradient norm was not finite
    last_skip: dict[str, Any] | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between recent lines

    def add_lines(self, lines: list[bytes]) -> None:
        """Parse what the summary needs: every line but train lines, except the last train line and the last
        few lines (for the gaps). A long run's history is skimmed, not parsed: fast on 100 MB of metrics.
        Skip lines (and every other kind) lack the marker, so each one is parsed and counted."""
        marker = b'"kind": "train"'  # as metrics.py writes it; a line written otherwise is simply parsed
        last_train = max((i for i in range(len(lines) - 1, -1, -1) if marker in lines[i]), default=-1)
        tail = len(lines) - 20
        for i, line in enumerate(lines):
            if i < tail and i != last_train and self.first_time is not None and marker in line:
                continue
            record = parse_line(line)
            if record is not None:
                self.add(record)

    def add(self, record: dict[str, Any]) -> None:
        t = record.get("time")
        if isinstance(t, (int, float)):
            if self.first_time is None:
                self.first_time = t
            prev = self.last.get("time") if self.last else None
            if isinstance(prev, (int, float)) and t >= prev:
                self.gaps = (self.gaps + [t - prev])[-20:]
        self.last = record
        kind = record["kind"]
        if kind == "train":
            self.last_train = record
        elif kind == "eval":
            self.last_eval = record
            val = record.get("val_loss")
            if isinstance(val, (int, float)) and (self.best_val is None or val < self.best_val):
                self.best_val = val
        elif kind == "skip":
            self.skipped += 1
            self.last_skip = record
        elif kind == "end":
            self.ended = True


class Run:
    """One run folder. `id` is a slug made by the index (safe in a URL); the path never leaves the server."""

    def __init__(self, run_id: str, index: int, path: str, name: str):
        self.id, self.index, self.path, self.name = run_id, index, path, name
        self.summary = Summary()
        self.lock = threading.Lock()

    def file(self, name: str) -> str:
        assert name in (METRICS, CONFIG, SAMPLES, CHECKPOINT), name  # the only files the dashboard reads
        return os.path.join(self.path, name)

    def exists(self) -> bool:
        return os.path.isfile(self.file(METRICS))

    def config(self) -> dict[str, Any] | None:
        cfg = read_json(self.file(CONFIG))
        return cfg if isinstance(cfg, dict) else None

    def refresh(self) -> os.stat_result | None:
        """Read the new lines of metrics.jsonl into the summary; the file's stat, or None if it is gone."""
        with self.lock:
            s = self.summary
            try:
                fh, st, offset, reset = open_at(self.file(METRICS), s.offset, s.file)
                with fh:
                    if reset:
                        s = self.summary = Summary()
                    s.file = file_id(st)
                    while True:
                        lines, s.offset, _ = read_lines(fh, offset)
                        s.add_lines(lines)
                        if s.offset == offset or s.offset >= st.st_size:
                            break
                        offset = s.offset
                return os.stat(self.file(METRICS))
            except OSError:
                return None

    def state(self, st: os.stat_result | None, cfg: dict[str, Any] | None, now: float) -> str:
        """running / finished / stopped / crashed / missing: the rule in this module's docstring."""
        if st is None:
            return "missing"
        s = self.summary
        max_iters = cfg.get("max_iters") if cfg else None
        if s.ended or (
            s.last_eval is not None and isinstance(max_iters, (int, float)) and s.last_eval["step"] >= max_iters
        ):
            return "finished"
        window = RUNNING_WINDOW_S
        if len(s.gaps) >= 3:
            window = max(window, 3 * statistics.median(s.gaps))
        if now - st.st_mtime <= window:
            return "running"
        try:
            ckpt_mtime = os.stat(self.file(CHECKPOINT)).st_mtime
        except OSError:
            ckpt_mtime = None
        return "stopped" if ckpt_mtime is not None and ckpt_mtime >= st.st_mtime - 1.0 else "crashed"

    def describe(self, now: float) -> dict[str, Any]:
        """The run list entry: name, state, progress, latest figures and a few config keys."""
        st = self.refresh()
        cfg = self.config() if st is not None else None
        s = self.summary
        max_iters = cfg.get("max_iters") if cfg else None
        state = self.state(st, cfg, now)
        eta = s.last_train.get("eta_s") if s.last_train else None
        if state == "finished":
            eta = 0.0
        elif isinstance(eta, (int, float)) and s.last_train and isinstance(s.last_train.get("time"), (int, float)):
            if state == "running":  # eta_s was written with the line: count down from then
                eta = max(0.0, eta - max(0.0, now - s.last_train["time"]))
            else:
                eta = None
        keys = ("dataset", "n_layer", "n_head", "n_embd", "block_size", "batch_size", "learning_rate", "device")
        return {
            "id": self.id,
            "index": self.index,
            "name": self.name,
            "state": state,
            "step": s.last["step"] if s.last else None,
            "max_iters": max_iters if isinstance(max_iters, (int, float)) else None,
            "eta_s": eta,
            "loss": s.last_train.get("loss") if s.last_train else None,
            "val_loss": s.last_eval.get("val_loss") if s.last_eval else None,
            "best_val_loss": s.best_val,
            "skipped": s.skipped,
            "last_skip": {k: s.last_skip.get(k) for k in ("step", "loss", "grad_norm", "in_a_row", "max_bad_steps")}
            if s.last_skip else None,
            "started": s.first_time,
            "updated": st.st_mtime if st is not None else None,
            "size": st.st_size if st is not None else None,
            "has_config": cfg is not None,
            "has_samples": os.path.isfile(self.file(SAMPLES)),
            "config": {k: cfg[k] for k in keys if k in cfg} if cfg else {},
        }


def slug(name: str) -> str:
    """A URL-safe id made of letters, digits, '.', '_' and '-' (never '..', never empty)."""
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")
    s = re.sub(r"\.{2,}", ".", s)
    return s or "run"


class RunIndex:
    """The runs under some folders: each folder is a run folder or holds run folders up to MAX_DEPTH deep.

    Folders are scanned again at most every `rescan_s` seconds, so runs started later appear; a run whose
    metrics.jsonl disappears stays listed with state `missing`. Ids are given once and never reused.
    """

    def __init__(self, folders: list[str], rescan_s: float = 3.0):
        self.roots = [os.path.abspath(f) for f in folders] or [os.getcwd()]
        self.rescan_s = rescan_s
        self._runs: dict[str, Run] = {}  # by id
        self._by_path: dict[str, Run] = {}
        self._scanned = -math.inf
        self._lock = threading.Lock()

    def runs(self) -> list[Run]:
        """All runs seen so far, sorted by name, after a rescan if the last one is older than rescan_s."""
        with self._lock:
            if time.monotonic() - self._scanned >= self.rescan_s:
                self._scan()
                self._scanned = time.monotonic()
            return sorted(self._runs.values(), key=lambda r: (r.name, r.index))

    def get(self, run_id: str) -> Run | None:
        """The run with this id; unknown ids (and anything that is not an id) give None."""
        with self._lock:
            if run_id not in self._runs and time.monotonic() - self._scanned > 0.5:  # maybe started since
                self._scan()
                self._scanned = time.monotonic()
            return self._runs.get(run_id)

    def _scan(self) -> None:
        for root in self.roots:
            for path in find_run_folders(root):
                if path not in self._by_path:
                    self._add(root, path)

    def _add(self, root: str, path: str) -> None:
        rel = os.path.relpath(path, root)
        name = os.path.basename(root) if rel == "." else rel.replace(os.sep, "/")
        if len(self.roots) > 1 and rel != ".":
            name = f"{os.path.basename(root)}/{name}"
        base = slug(name)
        run_id, n = base, 2
        while run_id in self._runs:
            run_id, n = f"{base}-{n}", n + 1
        run = Run(run_id, len(self._by_path), path, name or path)
        self._runs[run_id] = run
        self._by_path[path] = run


def find_run_folders(root: str, max_depth: int = MAX_DEPTH) -> list[str]:
    """Folders holding metrics.jsonl: `root` itself and its subfolders up to max_depth levels down.

    Hidden folders, caches and symlinked folders are not entered (a symlink loop cannot trap the scan).
    """
    found: list[str] = []
    budget = MAX_SCAN_ENTRIES
    level = [root]
    for depth in range(max_depth + 1):
        below: list[str] = []
        for folder in level:
            try:
                with os.scandir(folder) as it:
                    entries = list(it)
            except OSError:
                continue
            budget -= len(entries)
            for entry in entries:
                try:
                    if entry.name == METRICS and entry.is_file():
                        found.append(folder)
                    elif (depth < max_depth and entry.is_dir(follow_symlinks=False)
                          and not entry.name.startswith(".") and entry.name not in SKIP_DIRS):
                        below.append(entry.path)
                except OSError:
                    continue
            if budget <= 0:
                return found
        level = sorted(below)
    return found

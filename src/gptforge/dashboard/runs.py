"""The runs under the watched folders: discovery (RunIndex, find_run_folders), each run's summary, kept up to date
from the new bytes of metrics.jsonl, and its state. Reads only; no path comes from a client. The state rule is
README's "Dashboard" table; the rest is docs/ARCHITECTURE.md, "The dashboard"."""

from __future__ import annotations

import math
import os
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gptforge.core.files import CKPT, CONFIG, METRICS, SAMPLES
from gptforge.dashboard.records import file_id, open_at, parse_line, read_json, read_lines, tail_mark

MAX_DEPTH = 3  # a run folder, a folder of runs, a sweep of folders of runs, one more level
MAX_SCAN_ENTRIES = 20_000  # per root and scan, so a dashboard started in $HOME does not crawl the disk
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "wandb"}
RUNNING_WINDOW_S = 60.0
RL_CONFIG = "rl_config.json"  # `gptforge rl`'s settings (rl/start.py, which imports torch: named again here)


@dataclass
class Summary:
    """What the run list shows, kept up to date by reading only the new bytes of metrics.jsonl."""

    offset: int = 0
    file: str | None = None
    mark: str | None = None  # records.tail_mark at offset: a file rewritten under the same id is read again
    first_time: float | None = None
    last: dict[str, Any] | None = None  # the last record of any kind
    last_train: dict[str, Any] | None = None
    last_eval: dict[str, Any] | None = None
    last_rl: dict[str, Any] | None = None  # `gptforge rl`'s step records
    last_rl_eval: dict[str, Any] | None = None  # its held-out evaluations
    last_chat: dict[str, Any] | None = None  # SFT's held-out evaluations
    last_timed: dict[str, Any] | None = None  # the last train or rl record: the one whose eta_s holds
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
        if kind in ("train", "rl"):
            self.last_timed = record
        if kind == "train":
            self.last_train = record
        elif kind == "rl":
            self.last_rl = record
        elif kind == "rl_eval":
            self.last_rl_eval = record
        elif kind == "chat":
            self.last_chat = record
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
        assert name in (METRICS, CONFIG, RL_CONFIG, SAMPLES, CKPT), name  # the only files the dashboard reads
        return os.path.join(self.path, name)

    def exists(self) -> bool:
        return os.path.isfile(self.file(METRICS))

    def config(self) -> dict[str, Any] | None:
        """config.json (train's), or rl_config.json for a `gptforge rl` run folder (first when the run logs RL
        steps: a folder holding both was RL'd into)."""
        rl = self.summary.last_rl is not None or self.summary.last_rl_eval is not None
        names = (RL_CONFIG, CONFIG) if rl else (CONFIG, RL_CONFIG)
        for name in names:
            cfg = read_json(self.file(name))
            if isinstance(cfg, dict):
                return cfg
        return None

    def has_samples(self) -> bool:
        """samples.jsonl holds something. train writes it with the first samples, but earlier versions created it
        empty in every run: an empty file is no samples, or the page would wait for them forever."""
        try:
            return os.stat(self.file(SAMPLES)).st_size > 0
        except OSError:
            return False

    def refresh(self) -> os.stat_result | None:
        """Read the new lines of metrics.jsonl into the summary; the file's stat, or None if it is gone."""
        with self.lock:
            s = self.summary
            try:
                fh, st, offset, reset = open_at(self.file(METRICS), s.offset, s.file, s.mark)
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
                    s.mark = tail_mark(fh, s.offset)
                return os.stat(self.file(METRICS))
            except OSError:
                return None

    def state(self, st: os.stat_result | None, cfg: dict[str, Any] | None, now: float) -> str:
        """running / finished / stopped / crashed / missing, from the files alone: README's "Dashboard" table."""
        if st is None:
            return "missing"  # metrics.jsonl is gone: the folder was deleted or renamed while watched
        s = self.summary
        max_iters = cfg.get("max_iters") if cfg else None
        # train's last step always evaluates, so that eval line is the last thing a complete run writes
        if s.ended or (
            s.last_eval is not None and isinstance(max_iters, (int, float)) and s.last_eval["step"] >= max_iters
        ):
            return "finished"
        window = RUNNING_WINDOW_S
        if len(s.gaps) >= 3:  # lines may come slower than the window: a big log_interval on a slow machine
            window = max(window, 3 * statistics.median(s.gaps))
        if now - st.st_mtime <= window:
            return "running"
        try:
            ckpt_mtime = os.stat(self.file(CKPT)).st_mtime
        except OSError:
            ckpt_mtime = None
        # a checkpoint after the last line: interrupted (Ctrl-C, SIGTERM) and saved on the way out, resumable
        return "stopped" if ckpt_mtime is not None and ckpt_mtime >= st.st_mtime - 1.0 else "crashed"

    def describe(self, now: float) -> dict[str, Any]:
        """The run list entry: name, state, progress, latest figures and a few config keys."""
        st = self.refresh()
        cfg = self.config() if st is not None else None
        s = self.summary
        max_iters = cfg.get("max_iters", cfg.get("max_steps")) if cfg else None  # max_steps: rl_config.json's
        state = self.state(st, cfg, now)
        keys = ("dataset", "n_layer", "n_head", "n_embd", "block_size", "batch_size", "learning_rate", "device")
        return {
            "id": self.id,
            "index": self.index,
            "name": self.name,
            "state": state,
            "step": s.last["step"] if s.last else None,
            "max_iters": max_iters if isinstance(max_iters, (int, float)) else None,
            "eta_s": self.eta(state, now),
            "loss": s.last_train.get("loss") if s.last_train else None,
            "val_loss": s.last_eval.get("val_loss") if s.last_eval else None,
            "best_val_loss": s.best_val,
            "skipped": s.skipped,
            "last_skip": {k: s.last_skip.get(k) for k in ("step", "loss", "grad_norm", "in_a_row", "max_bad_steps")}
            if s.last_skip
            else None,
            "rl": s.last_rl is not None or s.last_rl_eval is not None,  # a `gptforge rl` run
            "reward": s.last_rl.get("reward") if s.last_rl else None,
            "pass_at_1": s.last_rl.get("pass_at_1") if s.last_rl else None,  # of the step's sampled answers
            "held_out_pass_at_1": s.last_rl_eval.get("pass_at_1") if s.last_rl_eval else None,
            "chat_acc": s.last_chat.get("acc") if s.last_chat else None,  # SFT's held-out exact match
            "started": s.first_time,
            "updated": st.st_mtime if st is not None else None,
            "size": st.st_size if st is not None else None,
            "has_config": cfg is not None,
            "has_samples": self.has_samples(),
            "config": {k: cfg[k] for k in keys if k in cfg} if cfg else {},
        }

    def eta(self, state: str, now: float) -> float | None:
        """Seconds left while running: the eta_s of the last train (or rl) line, counted down since it was
        written; 0 when finished."""
        if state == "finished":
            return 0.0
        last = self.summary.last_timed
        eta = last.get("eta_s") if last else None
        if state != "running" or not isinstance(eta, (int, float)):
            return None
        t = last.get("time")
        return max(0.0, eta - max(0.0, now - t)) if isinstance(t, (int, float)) else eta


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
                    elif (
                        depth < max_depth
                        and entry.is_dir(follow_symlinks=False)
                        and not entry.name.startswith(".")
                        and entry.name not in SKIP_DIRS
                    ):
                        below.append(entry.path)
                except OSError:
                    continue
            if budget <= 0:
                return found
        level = sorted(below)
    return found

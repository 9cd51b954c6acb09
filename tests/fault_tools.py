"""What test_faults.py and campaign_tools.py share: a real `gptforge train` process read line by line as it runs
(Child), and what "equal to an uninterrupted run" means: the final checkpoint and metrics of a run against a
reference run's, exactly (docs/RELIABILITY.md, "Resume is exact")."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
CHILD_TIMEOUT = 180.0  # seconds any one process may take; a loaded 2-core machine needs ~5 s
# what must be equal between the reference's and the campaign's metrics records (not times or speeds)
RECORD_KEYS = ("step", "kind", "loss", "lr", "grad_norm", "train_loss", "val_loss", "reason")


class CampaignError(RuntimeError):
    """A test or campaign itself could not go on (a hang, a process that would not start): not a finding."""


def child_env() -> dict[str, str]:
    """The children import gptforge from this checkout, run on one thread (the same arithmetic whatever the
    machine's load) and write their console lines unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


class Child:
    """One `python -m gptforge train ARGS` process; its stdout lines arrive, in order, on a queue. `preamble`:
    Python run in the process before the command (a test's fault seam), which then runs as `gptforge train ARGS`."""

    def __init__(self, args: list[str], cwd: Path | None = None, preamble: str | None = None):
        self.args = args
        self.started = time.monotonic()
        command = [sys.executable, "-m", "gptforge", "train"]
        if preamble:
            runner = "\nfrom gptforge.cli.main import main\nmain(['train', *__import__('sys').argv[1:]])\n"
            command = [sys.executable, "-c", preamble + runner]
        self.proc = subprocess.Popen(
            [*command, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=cwd,
        )
        self.pid = self.proc.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[tuple[float, str]] = []  # (seconds since launch, line)
        self.stderr: list[str] = []
        self.eof = False
        self.last_line = ""
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream, is_stdout: bool) -> None:
        for line in stream:
            if is_stdout:
                self.stdout.append((time.monotonic() - self.started, line))
                self.lines.put(line)
            else:
                self.stderr.append(line)
        if is_stdout:
            self.lines.put(None)

    def wait_for(
        self,
        until: Callable[[str], bool],
        deadline: float,
        poll: Callable[[], bool] | None = None,
        hard_deadline: float | None = None,
    ) -> str | None:
        """Read lines until `until(line)` (returns the line) or `poll()` is true or `deadline` (monotonic)
        passes (both return ""), or the output ends (None). Past `hard_deadline` it raises."""
        hard = hard_deadline if hard_deadline is not None else self.started + CHILD_TIMEOUT
        while not self.eof:
            now = time.monotonic()
            if now >= hard:
                raise CampaignError(f"pid {self.pid} ran past {CHILD_TIMEOUT:.0f} s; last line {self.last_line!r}")
            if now >= deadline or (poll is not None and poll()):
                return ""
            try:
                line = self.lines.get(timeout=min(0.0005 if poll else 0.05, max(deadline - now, 0.0) + 1e-4))
            except queue.Empty:
                continue
            if line is None:
                self.eof = True
                return None
            self.last_line = line.rstrip("\n")
            if until(line):
                return line
        return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)

    def finish(self, timeout: float = CHILD_TIMEOUT) -> int:
        """Wait for the exit (killing the process if it takes longer than `timeout`); returns the exit code."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait(timeout=30)
            raise CampaignError(f"pid {self.pid} did not exit within {timeout:.0f} s; killed") from None
        for t in self._threads:
            t.join(timeout=10)
        while not self.eof:  # the rest of the output, so stdout_text() is complete
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                break
            if line is None:
                self.eof = True
            else:
                self.last_line = line.rstrip("\n")
        return rc

    def stdout_text(self) -> str:
        return "".join(line for _, line in self.stdout)

    def stderr_text(self) -> str:
        return "".join(self.stderr)


def records(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def stripped(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: r[k] for k in RECORD_KEYS if k in r} for r in rows]


def diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    """Append to `out` every place where a and b differ: tensors by torch.equal (and dtype), the rest by ==."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        if not same:
            out.append(f"{path}: tensors differ")
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            out.append(f"{path}: keys differ: {sorted(map(str, set(a) ^ set(b)))}")
        for key in a.keys() & b.keys():
            diff(a[key], b[key], f"{path}.{key}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: lengths {len(a)} != {len(b)}")
        else:
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                diff(x, y, f"{path}[{i}]", out)
    elif a != b and not (a != a and b != b):  # NaN equals NaN here
        out.append(f"{path}: {a!r} != {b!r}")


def compare_runs(reference: Path, other: Path, max_iters: int) -> list[str]:
    """Where `other`'s final checkpoint and metrics differ from `reference`'s; [] when they are equal.

    The checkpoint's config is left out: it records init_from, which differs by design."""
    from gptforge.weights.checkpoint import load_checkpoint

    mismatches: list[str] = []
    ref, got = load_checkpoint(str(reference / "ckpt.pt")), load_checkpoint(str(other / "ckpt.pt"))
    for key in ("model", "optimizer", "iter_num", "best_val_loss", "data_state", "model_args", "scaler"):
        diff(ref.get(key), got.get(key), key, mismatches)
    # torch's generator is the one training draws from. Python's and numpy's global generators are seeded
    # from OS entropy in every process and never drawn from, so they differ between any two runs.
    diff(ref["rng"]["torch"], got["rng"]["torch"], "rng.torch", mismatches)
    ref_rows, got_rows = stripped(records(reference)), stripped(records(other))
    train_steps = [r["step"] for r in got_rows if r["kind"] == "train"]
    if train_steps != list(range(max_iters)):
        repeated = sorted({s for s in train_steps if train_steps.count(s) > 1})
        missing = sorted(set(range(max_iters)) - set(train_steps))
        mismatches.append(f"metrics.jsonl: train steps not each once in order (repeated {repeated}, missing {missing})")
    if ref_rows != got_rows:
        first = next(
            (i for i, (x, y) in enumerate(zip(ref_rows, got_rows, strict=False)) if x != y),
            min(len(ref_rows), len(got_rows)),
        )
        mismatches.append(
            f"metrics.jsonl: {len(got_rows)} records vs the reference's {len(ref_rows)}; first "
            f"difference at record {first}: {got_rows[first : first + 1]} vs {ref_rows[first : first + 1]}"
        )
    if (reference / "log.txt").read_text() != (other / "log.txt").read_text():
        mismatches.append("log.txt differs")
    return mismatches


def ckpt_step(path: Path) -> int:
    """The step a checkpoint file holds; raises when it does not load (a torn checkpoint)."""
    from gptforge.weights.checkpoint import load_checkpoint

    return int(load_checkpoint(str(path))["iter_num"])

"""A run's records survive every way it can start again: what metrics.jsonl and log.txt hold for the steps the
resumed checkpoint covers is still there afterwards, with the same figures, after a resume, a --resume=auto, a
finished run started again (files byte for byte unchanged), a run killed at its last step before its `end` record,
and a run killed in the middle of an evaluation. Real CLI processes (a finished run that one of them starts again is
trained in this process); the kills are SIGKILLs the child sends itself at a chosen point (a fault seam in its
preamble), so they land at the same place on any machine."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import run_cli, tiny_train_args, train_in_process
from fault_tools import CHILD_TIMEOUT, RECORD_KEYS, Child

RUN = dict(max_iters=10, lr_decay_iters=20, warmup_iters=2, eval_interval=5)

KILL_AT_END = """
import os, signal
import gptforge.train.metrics as metrics
real_log = metrics.Metrics.log
def log(self, step, kind, **values):
    if kind == "end":  # the last step's evaluation and checkpoint are written; its `end` record is not
        os.kill(os.getpid(), signal.SIGKILL)
    return real_log(self, step, kind, **values)
metrics.Metrics.log = log
"""

KILL_IN_EVAL_10 = """
import os, signal
import gptforge.train.loop as loop
real_evaluate = loop.evaluate
def evaluate(run):
    if run.iter_num == 10:  # inside step 10's evaluation: its record and checkpoint never come
        os.kill(os.getpid(), signal.SIGKILL)
    return real_evaluate(run)
loop.evaluate = evaluate
"""


def table(out: Path) -> dict[tuple[int, str], dict]:
    """metrics.jsonl as {(step, kind): the record's figures} (times and speeds left out: they differ by run)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keyed = {(r["step"], r["kind"]): {k: r[k] for k in RECORD_KEYS if k in r} for r in rows}
    assert len(keyed) == len(rows), "a (step, kind) recorded twice"
    return keyed


def log_lines(out: Path) -> set[str]:
    return set((out / "log.txt").read_text().splitlines())


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def covered(records: dict, step: int, superseded=("end",)) -> dict:
    """The records a checkpoint of `step` covers: every one before it, and its own step's (but `end`, which a run
    that trains on makes untrue)."""
    return {k: v for k, v in records.items() if k[0] < step or (k[0] == step and k[1] not in superseded)}


def assert_kept(before: dict, after: dict, before_log: set[str], after_log: set[str], step: int) -> None:
    for key, figures in covered(before, step).items():
        assert after.get(key) == figures, f"record {key} lost or changed: {figures} -> {after.get(key)}"
    lost = {line for line in before_log if int(line.split()[0]) <= step} - after_log
    assert not lost, f"log.txt lines lost: {sorted(lost)}"


@pytest.mark.parametrize("how", ["init_from=resume", "resume=auto"])
def test_a_resumed_run_keeps_every_record_its_checkpoint_covers(char_data, tmp_path, how):
    out = tmp_path / "run"
    train_in_process(*tiny_train_args(char_data, out, **RUN))  # the run that the real command then resumes
    before, before_log = table(out), log_lines(out)
    assert (10, "eval") in before and (10, "end") in before
    r = run_cli("train", *tiny_train_args(char_data, out, **{**RUN, "max_iters": 20}), f"--{how}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    after = table(out)
    assert_kept(before, after, before_log, log_lines(out), 10)
    assert (10, "end") not in after and (20, "end") in after  # the run went on: only its new end holds


@pytest.mark.parametrize("how", ["init_from=resume", "resume=auto"])
def test_a_finished_run_started_again_is_left_byte_for_byte(char_data, tmp_path, how):
    out = tmp_path / "run"
    train_in_process(*tiny_train_args(char_data, out, **RUN))  # the run that the real command then starts again
    before = digests(out)
    r = run_cli("train", *tiny_train_args(char_data, out, **RUN), f"--{how}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "is finished (iter 10 of max_iters 10); nothing to do" in r.stdout and "resuming" not in r.stdout
    assert digests(out) == before


def child_run(args: list[str], preamble: str | None = None) -> tuple[int, str, str]:
    """A whole `gptforge train` process as fault_tools runs it (one thread: the same arithmetic in every run)."""
    child = Child(args, preamble=preamble)
    child.wait_for(lambda line: False, child.started + CHILD_TIMEOUT)  # to the end of its output
    return child.finish(timeout=60), child.stdout_text(), child.stderr_text()


def killed_run(char_data, tmp_path: Path, preamble: str) -> Path:
    out = tmp_path / "run"
    rc, _, stderr = child_run(tiny_train_args(char_data, out, **RUN), preamble)
    assert rc == -9, stderr
    return out


def test_a_run_killed_at_its_last_step_before_its_end_record(char_data, tmp_path):
    """The final evaluation and checkpoint were written, the `end` record not: the run is finished, and starting
    it again (a requeue) leaves what it recorded untouched."""
    out = killed_run(char_data, tmp_path, KILL_AT_END)
    before = digests(out)
    assert (10, "eval") in table(out) and (10, "end") not in table(out)
    r = run_cli("train", *tiny_train_args(char_data, out, **RUN), "--resume=auto", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "is finished" in r.stdout
    assert digests(out) == before


def test_a_run_killed_inside_an_evaluation_resumes_from_the_checkpoint_before_keeping_its_records(char_data, tmp_path):
    """Killed during step 10's evaluation: the newest checkpoint is step 5's. The resumed run keeps every record of
    steps before 5 and step 5's evaluation as they were, redoes steps 5-9 identically, and ends at 10."""
    out = killed_run(char_data, tmp_path, KILL_IN_EVAL_10)
    before, before_log = table(out), log_lines(out)
    assert (5, "eval") in before and (9, "train") in before and (10, "eval") not in before
    rc, stdout, stderr = child_run([*tiny_train_args(char_data, out, **RUN), "--resume=auto"])
    assert rc == 0, stderr
    assert "resuming" in stdout and "from iter 5" in stdout
    after = table(out)
    assert_kept(before, after, before_log, log_lines(out), 5)
    # the steps after the checkpoint were trained again, from the same state: the same figures
    assert {k: v for k, v in before.items() if k[0] > 5} == {k: after[k] for k in before if k[0] > 5}
    assert (10, "end") in after

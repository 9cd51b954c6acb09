"""`--init_from=resume` continues the run that was started: its config.json is the base, the command line changes
it where that makes sense, never the model's shape; through the real CLI (a run that is only there to be resumed is
trained in this process)."""

from __future__ import annotations

import hashlib

import torch

from conftest import run_cli, tiny_train_args, train_in_process
from fault_tools import CHILD_TIMEOUT, Child
from gptforge.weights.checkpoint import load_checkpoint

# settings far from the defaults (40 accumulation steps, 12 x 1024, warmup 2000...), so a resume that fell
# back to the defaults could not go unnoticed
RUN = dict(max_iters=10, lr_decay_iters=20, warmup_iters=5, eval_interval=5)


# Ctrl-C at step 5, sent by the run to itself: it stops at the next step's head with ckpt.pt (iter 6), as a user's
# Ctrl-C or a preemption leaves a run that has not reached its max_iters
INTERRUPT_AT_5 = """
import os, signal
import gptforge.train.metrics as metrics
real_log = metrics.Metrics.log
def log(self, step, kind, **values):
    real_log(self, step, kind, **values)
    if kind == "train" and step == 5:
        os.kill(os.getpid(), signal.SIGINT)
metrics.Metrics.log = log
"""


def stopped_run(char_data, out) -> None:
    child = Child(tiny_train_args(char_data, out, **RUN), preamble=INTERRUPT_AT_5)
    child.wait_for(lambda line: False, child.started + CHILD_TIMEOUT)
    assert child.finish(timeout=60) == 0, child.stderr_text()
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 6


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_bare_resume_continues_with_the_runs_own_settings(char_data, tmp_path):
    out = tmp_path / "run"
    stopped_run(char_data, out)
    r = run_cli("train", f"--out_dir={out}", "--init_from=resume", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first == f"resuming {out} from iter 6 ({out / 'ckpt.pt'})", r.stdout
    assert "step 10: done (max_iters reached)" in r.stdout  # the run's own max_iters
    assert "changed from the run's config.json" not in r.stdout
    assert "tokens per iteration: 256 = 1 accumulation x 1 processes x 8 batch x 32 block" in r.stdout
    assert "device cpu, dtype float32, compile False" in r.stdout


def test_an_allowed_change_is_named_and_continues_exactly(char_data, tmp_path):
    """A 10-step run continued to 20 by `--max_iters=20` alone equals a 20-step run, bit for bit."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    r = run_cli("train", *tiny_train_args(char_data, whole, **{**RUN, "max_iters": 20}), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli("train", *tiny_train_args(char_data, split, **RUN), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli("train", f"--out_dir={split}", "--init_from=resume", "--max_iters=20", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "changed from the run's config.json: max_iters 10 -> 20" in r.stdout
    a, b = load_checkpoint(str(whole / "ckpt.pt")), load_checkpoint(str(split / "ckpt.pt"))
    assert a["iter_num"] == b["iter_num"] == 20
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert (whole / "log.txt").read_text() == (split / "log.txt").read_text()


def test_the_same_full_command_again_changes_nothing(char_data, tmp_path):
    """nanoGPT's habit: the command that started the run, plus --init_from=resume."""
    out = tmp_path / "run"
    stopped_run(char_data, out)
    r = run_cli("train", *tiny_train_args(char_data, out, **RUN), "--init_from=resume", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"resuming {out} from iter 6")
    assert "changed from the run's config.json" not in r.stdout


def test_a_shape_change_is_refused_and_nothing_is_written(char_data, tmp_path):
    out = tmp_path / "run"
    train_in_process(*tiny_train_args(char_data, out, **RUN))  # the run to resume
    before = {p.name: digest(p) for p in out.iterdir()}
    r = run_cli("train", f"--out_dir={out}", "--init_from=resume", "--n_layer=6", "--max_iters=20", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--n_layer=6: the run in {out} has n_layer=2" in r.stderr and "another --out_dir" in r.stderr
    assert {p.name: digest(p) for p in out.iterdir()} == before


def test_a_damaged_config_json_is_named(char_data, tmp_path):
    out = tmp_path / "run"
    train_in_process(*tiny_train_args(char_data, out, **RUN))  # the run to resume
    (out / "config.json").write_text('{"n_layer": "two"}')
    r = run_cli("train", f"--out_dir={out}", "--init_from=resume", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{out / 'config.json'}: n_layer must be int" in r.stderr

"""The runner behind run_cli (warm_cli.py) against a new interpreter, `python -m gptforge` itself: the same exit
codes, output and files for a short training run, a user error and a timeout."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from conftest import cli_env, run_cli, tiny_train_args
from gptforge.weights.checkpoint import load_checkpoint


def fresh(*args, cwd):
    argv = [sys.executable, "-m", "gptforge", *map(str, args)]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=cli_env())


def steady(text: str) -> str:
    """Output without what changes from run to run: timings, rates, folder names."""
    text = re.sub(r"(time|eta|mfu) [^,\n]*", r"\1 _", text)
    text = re.sub(r"[\d,.]+ tok/s", "_ tok/s", text)
    return re.sub(r"/\S*/(warm|fresh)\b", "RUN", text)


def test_a_training_run_and_an_error_are_what_a_new_interpreter_gives(char_data, tmp_path):
    args = dict(max_iters=4, lr_decay_iters=4, eval_interval=2, dropout=0.1)
    warm = run_cli("train", *tiny_train_args(char_data, tmp_path / "warm", **args), cwd=tmp_path)
    new = fresh("train", *tiny_train_args(char_data, tmp_path / "fresh", **args), cwd=tmp_path)
    assert warm.returncode == new.returncode == 0, warm.stderr + new.stderr
    assert steady(warm.stdout) == steady(new.stdout)
    assert steady(warm.stderr) == steady(new.stderr)
    a, b = (load_checkpoint(str(tmp_path / name / "ckpt.pt")) for name in ("warm", "fresh"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    wrong = ("sample", f"--out_dir={tmp_path / 'missing'}")
    warm, new = run_cli(*wrong, cwd=tmp_path), fresh(*wrong, cwd=tmp_path)
    assert (warm.returncode, warm.stdout, warm.stderr) == (new.returncode, new.stdout, new.stderr)
    assert warm.returncode == 2 and "Traceback" not in warm.stderr


def test_a_run_past_its_timeout_is_killed(char_data, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("train", *tiny_train_args(char_data, tmp_path / "run", max_iters=100000), cwd=tmp_path, timeout=3)

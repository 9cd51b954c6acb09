"""`gptforge bench --target_loss`: the held-out set is the val split's first windows and its loss the per-token
mean (checked window by window against the model's own loss); the step it reports is the first check at or
under the target, with the weights an uninterrupted `gptforge train` run has at that step; --compare races a
second config; a target not reached and bad options are said clearly."""

from __future__ import annotations

import ast
import contextlib
import json
import math

import numpy as np
import pytest
import torch

from conftest import run_cli, tiny_train_args
from gptforge.bench.time_to_loss import SCREEN_EVERY, HeldOut
from gptforge.data.loader import read_meta
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.weights.load import load_checkpoint_model


def config_file(path, data_dir, **overrides):
    """tiny_train_args as a config file (what bench takes as CONFIG and as --compare=OTHER)."""
    lines = []
    for arg in tiny_train_args(data_dir, path.parent / "unused", **overrides):
        key, text = arg[2:].split("=", 1)
        try:
            value = ast.literal_eval(text)  # numbers and booleans
        except (ValueError, SyntaxError):
            value = text
        lines.append(f"{key} = {value!r}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_held_out_set_is_the_val_splits_first_windows_scored_window_by_window(char_data):
    folder = char_data / "tiny"
    meta = read_meta(str(folder))
    val = np.fromfile(folder / "val.bin", dtype=np.uint16).astype(np.int64)
    held = HeldOut(str(folder), meta, block_size=16, eval_tokens=200, device="cpu")
    assert held.x.shape == (12, 16) and held.tokens == 192  # 200 // 16 whole windows
    assert torch.equal(held.x.flatten(), torch.from_numpy(val[:192]))
    assert torch.equal(held.y.flatten(), torch.from_numpy(val[1:193]))

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(block_size=16, vocab_size=meta["vocab_size"], n_layer=2, n_head=2, n_embd=32, bias=True)
    ).eval()
    with torch.no_grad():
        each = torch.tensor(
            [model(x[None], y[None])[1].item() for x, y in zip(held.x, held.y, strict=True)], dtype=torch.float64
        )
    loss, se = held.loss(model, contextlib.nullcontext(), batch_size=5)
    assert loss == pytest.approx(each.mean().item(), abs=1e-6)
    assert se == pytest.approx(each.std().item() / math.sqrt(12), rel=1e-5)
    screen, _ = held.loss(model, contextlib.nullcontext(), batch_size=5, screen=True)
    assert screen == pytest.approx(each[::SCREEN_EVERY].mean().item(), abs=1e-6)
    with pytest.raises(Exception, match="fewer than one block_size"):
        HeldOut(str(folder), meta, block_size=16, eval_tokens=10, device="cpu")


def test_the_reported_step_is_the_first_check_under_the_target_with_an_uninterrupted_runs_weights(char_data, tmp_path):
    # the sharded loader: train's own evaluations then leave the training batches alone (the random loader draws
    # its evaluation batches from torch's generator, as nanoGPT does, and bench --target_loss makes none)
    run = dict(max_iters=40, lr_decay_iters=40, warmup_iters=2, learning_rate=1e-2, data_loader="sharded")
    fast = config_file(tmp_path / "fast.py", char_data, **run)
    slow = config_file(tmp_path / "slow.py", char_data, **{**run, "learning_rate": 1e-3})
    target, every = 2.6, 4
    r = run_cli(
        "bench", str(fast), f"--target_loss={target}", f"--compare={slow}", f"--eval_every={every}", "--json",
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "fast: step 0/40" in r.stderr  # the progress lines
    out = json.loads(r.stdout)
    first, second = out["runs"]
    assert (first["name"], second["name"]) == ("fast", "slow")
    assert first["reached"] and first["val_loss"] <= target and first["steps"] % every == 0
    assert first["tokens"] == first["steps"] * 8 * 32
    assert out["ratios"]["slow"] == pytest.approx(second["seconds"] / first["seconds"])

    # the same config trained by `gptforge train`, keeping the weights at every check
    r = run_cli("train", str(fast), f"--out_dir={tmp_path / 'whole'}", f"--ckpt_interval={every}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    meta = read_meta(str(char_data / "tiny"))
    held = HeldOut(str(char_data / "tiny"), meta, 32, 131072, "cpu")

    def loss_at(step: int) -> float:
        model, _, _ = load_checkpoint_model(str(tmp_path / "whole" / f"model_{step:05d}.pt"), "cpu")
        return held.loss(model, contextlib.nullcontext(), 8)[0]

    assert loss_at(first["steps"]) == pytest.approx(first["val_loss"], abs=1e-5)
    assert all(loss_at(step) > target for step in range(every, first["steps"], every))  # no step 0 file


def test_seeds_run_each_config_once_per_seed_and_report_the_median(char_data, tmp_path):
    """--seeds: every config once per seed, each run the one `--seed=S` gives alone (the same steps and loss), and
    per config the number that reached the target, the median and range of seconds and steps; the ratio between
    configs is of their medians."""
    run = dict(max_iters=24, lr_decay_iters=24, warmup_iters=2, learning_rate=1e-2, data_loader="sharded")
    fast = config_file(tmp_path / "fast.py", char_data, **run)
    slow = config_file(tmp_path / "slow.py", char_data, **{**run, "learning_rate": 3e-3})
    race = ["--target_loss=2.9", "--eval_every=2", "--json"]
    r = run_cli("bench", str(fast), f"--compare={slow}", "--seeds=3,11,7", *race, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["seeds"] == [3, 11, 7]
    assert [(x["config"], x["seed"], x["name"]) for x in out["runs"]] == [
        (name, seed, f"{name} seed {seed}") for name in ("fast", "slow") for seed in (3, 11, 7)
    ]
    assert "fast seed 11: step 0/24" in r.stderr
    for name in ("fast", "slow"):
        runs = [x for x in out["runs"] if x["config"] == name]
        summary = out["over_seeds"][name]
        seconds, steps = sorted(x["seconds"] for x in runs), sorted(x["steps"] for x in runs)
        assert summary["runs"] == 3 and summary["reached"] == sum(x["reached"] for x in runs)
        assert summary["seconds"] == seconds[1] and summary["seconds_range"] == [seconds[0], seconds[2]]
        assert summary["steps"] == steps[1] and summary["steps_range"] == [steps[0], steps[2]]
    fast_runs = [x for x in out["runs"] if x["config"] == "fast"]
    assert len({x["val_loss"] for x in fast_runs}) == 3  # three seeds, three runs
    assert out["ratios"]["slow"] == pytest.approx(
        out["over_seeds"]["slow"]["seconds"] / out["over_seeds"]["fast"]["seconds"]
    )
    alone = json.loads(run_cli("bench", str(fast), "--seed=11", *race, cwd=tmp_path).stdout)["runs"][0]
    eleven = fast_runs[1]
    assert (alone["steps"], alone["val_loss"], alone["seed"]) == (eleven["steps"], eleven["val_loss"], 11)
    r = run_cli("bench", str(fast), "--seeds=5,6", "--target_loss=2.9", "--eval_every=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "fast seed 5: " in r.stdout and "fast seed 6: " in r.stdout
    assert "fast over 2 seeds: reached in " in r.stdout and "(median; " in r.stdout


def test_a_target_not_reached_is_said_and_bad_options_exit_2(char_data, tmp_path):
    cfg = config_file(tmp_path / "c.py", char_data, max_iters=3, lr_decay_iters=3, warmup_iters=1)
    r = run_cli("bench", str(cfg), "--target_loss=0.01", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("c: NOT reached (max_iters; best ") and "3 steps" in r.stdout
    for args, message in [
        (["--target_loss=0"], "--target_loss must be a positive number"),
        (["--target_loss=2", "--compare"], "--compare names the config to race: --compare=CONFIG_FILE"),
        ([f"--compare={cfg}"], "needs --target_loss"),
        (["--target_loss=2", "--eval_every=0"], "must be positive"),
        (["--target_loss=2", "--compare=missing.py"], "missing.py"),
        (["--target_loss=2", "--seeds=1,x"], "--seeds takes whole numbers >= 0 separated by commas"),
        (["--target_loss=2", "--seeds="], "--seeds takes whole numbers"),
        (["--target_loss=2", "--seeds=-1"], "--seeds takes whole numbers"),
        (["--target_loss=2", "--seeds=4,4"], "--seeds=4,4 names a seed twice"),
        (["--seeds=1,2"], "it needs --target_loss or --target_bpb"),
    ]:
        r = run_cli("bench", str(cfg), *args, cwd=tmp_path)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_the_whole_set_is_scored_only_when_the_screen_may_have_reached_the_target():
    """The cheap screen decides: 3 of its standard errors above the target, no full check (issue: a README-size
    race spent most of its wall time checking); within them, the whole set decides."""
    from types import SimpleNamespace

    from gptforge.bench.time_to_loss import _check

    class Screened:
        def __init__(self, screen):
            self.screen, self.full = screen, 0

        def measure(self, model, ctx, batch, screen=False):
            if screen:
                return {"loss": self.screen, "bpb": (math.nan, math.inf)}
            self.full += 1
            return {"loss": (1.89, 0.005), "bpb": (math.nan, math.inf)}

    run = SimpleNamespace(cfg=SimpleNamespace(batch_size=4), accum=1, raw_model=None, ctx=None)
    far = Screened((2.0, 0.02))  # 2.0 - 3 x 0.02 = 1.94 > 1.90
    assert _check(far, run, "loss", 1.90, ending=False) == {"val_loss": 2.0, "val_bpb": math.nan, "se": None}
    near = Screened((1.95, 0.02))  # 1.89 <= 1.90: it may be there
    assert _check(near, run, "loss", 1.90, ending=False)["se"] == 0.005 and near.full == 1
    assert _check(far, run, "loss", 1.90, ending=True)["se"] == 0.005  # the last check is always whole

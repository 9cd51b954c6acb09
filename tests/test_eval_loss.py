"""`gptforge eval loss`: a checkpoint's mean loss and perplexity on a dataset, against a float64 reference."""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

from conftest import kept_rates, run_cli, tiny_train_args, train_in_process
from gptforge.data.loader import RandomBatches
from gptforge.data.prepare import prepare
from gptforge.weights.load import load_checkpoint_model


def reference_loss(ckpt_path, bin_path, batch, block, iters, seed) -> float:
    """The same batches (RandomBatches with the same seed), scored in float64 with a plain cross-entropy."""
    model, _, _ = load_checkpoint_model(str(ckpt_path), "cpu")
    model.double()
    batches = RandomBatches(str(bin_path), batch, block, model.config.vocab_size, "cpu", seed=seed)
    total = 0.0
    with torch.no_grad():
        for _ in range(iters):
            x, y = batches.next_batch()
            logits, _ = model(x, y)
            total += F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).item()
    return total / iters


def test_loss_and_perplexity_of_a_run_and_of_a_step_checkpoint(char_data, tmp_path):
    out = tmp_path / "run"
    train_in_process(*tiny_train_args(char_data, out, max_iters=10, ckpt_interval=5))  # the run to evaluate
    r = run_cli(
        "eval",
        "loss",
        f"--out_dir={out}",
        "--split=both",
        "--eval_iters=6",
        "--batch_size=4",
        "--device=cpu",
        "--seed=3",
    )
    assert r.returncode == 0, r.stderr
    lines = re.findall(r"^(val|train) loss ([\d.]+) \(ppl ([\d.]+)\), bpb ([\d.]+)$", r.stdout, re.M)
    figures = {split: (float(loss), float(ppl)) for split, loss, ppl, _ in lines}
    assert set(figures) == {"val", "train"} and len(r.stdout.splitlines()) == 2
    for split, (loss, ppl) in figures.items():
        ref = reference_loss(out / "ckpt.pt", char_data / "tiny" / f"{split}.bin", 4, 32, 6, 3)
        assert abs(loss - ref) < 1e-4, (split, loss, ref)
        assert abs(ppl - math.exp(ref)) < 0.01 * math.exp(ref)
    # a step checkpoint (--ckpt): the dataset and block size come from the run's config inside it
    r = run_cli(
        "eval",
        "loss",
        f"--ckpt={out / 'model_00005.pt'}",
        "--eval_iters=6",
        "--batch_size=4",
        "--device=cpu",
        "--seed=3",
    )
    assert r.returncode == 0, r.stderr
    ref = reference_loss(out / "model_00005.pt", char_data / "tiny" / "val.bin", 4, 32, 6, 3)
    assert abs(float(r.stdout.split()[2]) - ref) < 1e-4


def test_eval_loss_errors_name_the_flag(char_data, tmp_path):
    out = tmp_path / "run"
    train_in_process(*tiny_train_args(char_data, out, max_iters=2))  # the run to evaluate
    other = tmp_path / "other.txt"
    other.write_text("a completely different alphabet: XYZ 0123456789 " * 50, encoding="utf-8")
    prepare("text", data_dir=str(char_data), files=[str(other)], name="other", tokenizer="char")
    cases = [
        (["--dataset=other", f"--data_dir={char_data}"], "tokenized differently"),
        (["--dataset=missing", f"--data_dir={char_data}"], "dataset folder"),
        (["--eval_iters=0"], "--eval_iters must be a positive integer"),
        ([f"--ckpt={tmp_path}"], "--ckpt="),
    ]
    for extra, message in cases:
        r = run_cli("eval", "loss", f"--out_dir={out}", "--device=cpu", *extra)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr)


def test_eval_picks_the_dtype_by_trains_rule_for_the_model(char_data, tmp_path, monkeypatch, capsys):
    """On a CPU whose bfloat16 products are faster, train keeps float32 below 256 wide: eval does the same for such
    a model."""
    from gptforge.core import device
    from gptforge.evaluate.loss import eval_loss

    out = tmp_path / "run"
    train_in_process(*tiny_train_args(char_data, out, max_iters=2))
    capsys.readouterr()  # the run's own output: what follows is eval's
    kept_rates(monkeypatch, tmp_path / "cache", float32=1.6e11, bfloat16=6e11)
    eval_loss(str(out), None, "resume", None, None, "val", 2, None, None, 1337, "cpu", "auto")
    assert "on cpu (float32)" in capsys.readouterr().err  # 32 wide: float32, as train_shakespeare_char_cpu runs
    assert device.resolve_dtype("auto", "cpu", 384) == "bfloat16"  # and a wide model would get bfloat16

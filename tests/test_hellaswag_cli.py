"""HellaSwag through the CLI (one process and two torchrun ranks, --ckpt, user errors, --help) and during
training (hellaswag_interval in train: logged on BPE data, skipped with a note on char data)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from gptforge.evaluate import hellaswag as hs
from gptforge.weights.checkpoint import save_checkpoint
from hellaswag_tools import tiny_gpt

RESULT_LINE = re.compile(
    r"^hellaswag: (\d+) examples, acc ([\d.]+) \((\d+)/(\d+)\), "
    r"acc_norm ([\d.]+) \((\d+)/(\d+)\)$"
)


def save_run(out_dir: Path, tokenizer_spec: dict, vocab_size: int = 50304) -> Path:
    """A run folder as `gptforge train` leaves it, without training: a random tiny GPT in ckpt.pt."""
    model = tiny_gpt(vocab_size=vocab_size)
    args = {k: getattr(model.config, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(
        str(out_dir / "ckpt.pt"),
        {
            "model": model.state_dict(),
            "model_args": args,
            "iter_num": 0,
            "best_val_loss": 1e9,
            "config": {},
            "tokenizer": tokenizer_spec,
        },
    )
    return out_dir


def parse_result(stdout: str) -> tuple[int, int, int]:
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout  # the result line and nothing else on stdout
    m = RESULT_LINE.match(lines[0])
    assert m, lines[0]
    n, correct, correct_norm = int(m[1]), int(m[3]), int(m[6])
    assert int(m[4]) == int(m[7]) == n and float(m[2]) == pytest.approx(correct / n, abs=5e-5)
    return n, correct, correct_norm


def test_cli_one_process_and_two_torchrun_ranks_agree(tmp_path, tiktoken_cache, hellaswag_path):
    """Sharded over 2 gloo ranks, the summed counts equal one process's and the library's own."""
    out = save_run(tmp_path / "run", {"tokenizer": "gpt2"})
    args = ["eval", "hellaswag", f"--out_dir={out}", f"--hellaswag_path={hellaswag_path}", "--limit=30", "--device=cpu"]
    single = run_cli(*args, cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    n, correct, correct_norm = parse_result(single.stdout)
    assert n == 30  # --limit
    assert "hellaswag: scoring 30 examples" in single.stderr

    torchrun = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "gptforge",
            *args,
            "--batch_size=3",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert torchrun.returncode == 0, torchrun.stderr
    assert parse_result(torchrun.stdout) == (n, correct, correct_norm)
    assert "2 process(es)" in torchrun.stderr

    from gptforge.weights.load import load_checkpoint_model

    model, tok, _ = load_checkpoint_model(str(out / "ckpt.pt"), "cpu")
    result = hs.evaluate_hellaswag(model, tok, hs.load_examples(str(hellaswag_path), 30), "cpu", progress=False)
    assert (result["n"], result["correct"], result["correct_norm"]) == (n, correct, correct_norm)


def test_cli_scores_a_checkpoint_file_given_by_ckpt(tmp_path, tiktoken_cache, hellaswag_path):
    """--ckpt PATH: any checkpoint file (a step checkpoint, a copy elsewhere) instead of <out_dir>/ckpt.pt."""
    import shutil

    run = save_run(tmp_path / "run", {"tokenizer": "gpt2"})
    moved = tmp_path / "elsewhere" / "model_00000.pt"
    moved.parent.mkdir()
    shutil.move(run / "ckpt.pt", moved)
    r = run_cli(
        "eval",
        "hellaswag",
        f"--ckpt={moved}",
        f"--hellaswag_path={hellaswag_path}",
        "--limit=8",
        "--device=cpu",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    from gptforge.weights.load import load_checkpoint_model

    model, tok, _ = load_checkpoint_model(str(moved), "cpu")
    result = hs.evaluate_hellaswag(model, tok, hs.load_examples(str(hellaswag_path), 8), "cpu", progress=False)
    assert parse_result(r.stdout) == (result["n"], result["correct"], result["correct_norm"]) and result["n"] == 8


def test_cli_user_errors_exit_2(tmp_path, tiktoken_cache, hellaswag_path):
    char_run = save_run(tmp_path / "char", {"tokenizer": "char", "itos": list("abc")}, vocab_size=3)
    gpt2_run = save_run(tmp_path / "gpt2", {"tokenizer": "gpt2"})
    cases = [
        ([f"--out_dir={char_run}", f"--hellaswag_path={hellaswag_path}"], "needs a model trained with GPT-2's BPE"),
        ([f"--out_dir={gpt2_run}", "--hellaswag_path=missing.jsonl"], "--hellaswag_path=missing.jsonl: no such file"),
        ([f"--out_dir={gpt2_run}", "--limit=0"], "--limit must be a positive integer"),
    ]
    for args, message in cases:
        r = run_cli("eval", "hellaswag", "--device=cpu", *args, cwd=tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and r.stderr.startswith("gptforge: error:") and "Traceback" not in r.stderr
        assert r.stdout == ""


def test_eval_help_lists_the_options():
    r = run_cli("eval", "hellaswag", "--help")
    assert r.returncode == 0 and r.stderr == ""
    flat = " ".join(r.stdout.split())
    for text in (
        "--hellaswag_path",
        "--limit",
        "--batch_size",
        "(default: 4)",
        "--out_dir",
        "(default: out)",
        "--ckpt PATH",
    ):
        assert text in flat, text
    r = run_cli("eval")
    assert r.returncode == 2 and "hellaswag" in r.stderr  # the task is required


def test_hellaswag_during_training_logs_acc_norm(tmp_path, hellaswag_path, tiktoken_cache):
    """hellaswag_interval in train: counts at every interval and the last step, in log.txt and metrics.jsonl."""
    import json

    from conftest import tiny_train_args
    from gptforge.core.config import load_config
    from gptforge.data.prepare import prepare
    from gptforge.train.loop import train

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    prepare("text", data_dir=str(tmp_path / "data"), files=[str(text)], name="bpe", tokenizer="gpt2")
    args = tiny_train_args(
        tmp_path / "data",
        tmp_path / "r",
        dataset="bpe",
        max_iters=6,
        eval_interval=6,
        hellaswag_interval=4,
        hellaswag_limit=8,
        hellaswag_path=hellaswag_path,
    )
    train(load_config(args))
    rows = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    hs = [r for r in rows if r["kind"] == "hellaswag"]
    assert [r["step"] for r in hs] == [0, 4, 6] and all(r["n"] == 8 for r in hs)
    assert all(0 <= r["acc_norm"] <= 1 and r["acc_norm"] * 8 == round(r["acc_norm"] * 8) for r in hs)
    lines = [x for x in (tmp_path / "r/log.txt").read_text().splitlines() if " hellaswag " in x]
    assert lines == [f"{r['step']} hellaswag {r['acc_norm']:.4f}" for r in hs]


def test_hellaswag_during_training_is_skipped_with_a_note_on_char_data(char_data, tmp_path, hellaswag_path, capsys):
    """A character vocabulary cannot encode HellaSwag (build-nanogpt's --eval_freq asks for it on any dataset):
    the run trains and says why no HellaSwag figures come."""
    from conftest import tiny_train_args
    from gptforge.core.config import load_config
    from gptforge.train.loop import train

    train(
        load_config(
            tiny_train_args(char_data, tmp_path / "r", max_iters=4, hellaswag_interval=2, hellaswag_path=hellaswag_path)
        )
    )
    assert "hellaswag_interval=2 ignored: HellaSwag needs GPT-2 BPE tokens and dataset 'tiny' is char-level" in (
        capsys.readouterr().out
    )
    kinds = {json.loads(line)["kind"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()}
    assert "hellaswag" not in kinds and "train" in kinds
    assert json.loads((tmp_path / "r" / "config.json").read_text())["hellaswag_interval"] == 0

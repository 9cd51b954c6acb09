"""End to end through the real CLI in subprocesses: prepare -> train -> sample, help, errors, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_cli, tiny_train_args


def test_prepare_train_sample_end_to_end(tmp_path, shakespeare_path):
    """The newcomer's path on real Tiny Shakespeare: the loss falls and sample prints Shakespeare's characters."""
    r = run_cli("prepare", "shakespeare_char", "--input", shakespeare_path, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "train 1,003,854 tokens, val 111,540" in r.stderr
    r = run_cli(
        "train",
        ROOT / "config/train_shakespeare_char_cpu.py",
        "--max_iters=50",
        "--lr_decay_iters=50",
        "--eval_interval=25",
        "--eval_iters=5",
        "--warmup_iters=10",
        "--log_interval=10",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out-shakespeare-char"
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [e["val_loss"] for e in evals if e["kind"] == "eval"]
    assert len(val) == 3 and val[-1] < val[0] - 0.8, val  # ln(65) = 4.17 -> below ~3.3 in 50 steps
    assert "iter 40: loss" in r.stdout and "tok/s" in r.stdout

    sample = ["sample", "--out_dir", out, "--start=ROMEO:", "--max_new_tokens=60", "--device=cpu"]
    r = run_cli(*sample, "--num_samples=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    parts = r.stdout.split("---------------\n")
    assert len(parts) == 3 and parts[-1] == ""  # two samples, each followed by the separator, nothing else
    for text in parts[:2]:
        assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 60 + 1
        assert set(text) <= set(shakespeare_path.read_text())
    assert "generating 2 sample(s)" in r.stderr and "generating" not in r.stdout
    again = run_cli(*sample, "--num_samples=2", cwd=tmp_path)
    assert again.stdout == r.stdout  # same seed, same samples
    uncached = run_cli(*sample, "--num_samples=2", "--no_cache", cwd=tmp_path)
    assert uncached.stdout == r.stdout  # the KV cache changes the speed, not the text
    one = run_cli(*sample, "--num_samples=1", cwd=tmp_path)
    assert r.stdout.startswith(one.stdout)  # sample i does not depend on how many are drawn


def test_sample_start_from_file_and_gpt2_bpe_run(tmp_path, shakespeare_path, tiktoken_cache):
    assert run_cli("prepare", "shakespeare", "--input", shakespeare_path, cwd=tmp_path).returncode == 0
    r = run_cli(
        "train", *tiny_train_args("data", "out", dataset="shakespeare", max_iters=3, eval_interval=3), cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("To be, or not to be")
    r = run_cli(
        "sample",
        "--out_dir=out",
        f"--start=FILE:{prompt}",
        "--num_samples=1",
        "--max_new_tokens=5",
        "--temperature=0",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("To be, or not to be") and r.stdout.endswith("---------------\n")
    from gptforge.weights.checkpoint import load_checkpoint

    assert load_checkpoint(str(tmp_path / "out/ckpt.pt"))["model_args"]["vocab_size"] == 50304  # 50257 padded


@pytest.mark.parametrize(
    "command", ["prepare", "train", "sample", "export", "bench", "dashboard", "eval loss", "eval lm-eval"]
)
def test_help_lists_options_with_defaults(command):
    r = run_cli(*command.split(), "--help")
    assert r.returncode == 0 and r.stderr == ""
    expected = {
        "prepare": ["--data_dir", "(default: data)", "--input"],
        "train": [
            "--batch_size=12",
            "--dropout=0.0",
            "--init_from='scratch'",
            "--total_batch_size=0",
            "--lr_schedule='cosine'",
            "aliases -> key",
            "--mini_batch_size -> batch_size",
            "--max_lr -> learning_rate",
            "--steps_per_epoch, --num_epochs -> max_iters",
        ],
        "sample": ["--num_samples", "(default: 10)", "--temperature", "(default: 0.8)", "--init_from", "--ckpt PATH"]
        + ["a local Hugging Face folder (GPT-2 or NanoChat, e.g. one `gptforge export` wrote)"]
        + ["--top_p", "--stop_token", "--window {slide,half,stream}", "(default: slide)", "faster on long samples"]
        + ["a file (default: a newline) --num_samples", "instead of using the KV cache (default: the cache is on)"],
        "export": ["--out_dir", "--to", "--ckpt PATH"],
        "bench": ["--compare", "--json", "(default: 5)", "--target_loss=X", "=FILE with --target_loss"],
        "dashboard": ["--port", "(default: 8765)", "(default: 127.0.0.1)"],
        "eval loss": ["--ckpt PATH", "--split {val,train,both}", "(default: val)", "--eval_iters", "perplexity"]
        + ["under --data_dir (default: the run's) --data_dir", "per split (default: the run's, or 200) --batch_size"],
        "eval lm-eval": ["--tasks TASKS", "--num_fewshot", "--limit", "--include_path DIR", "--output_path FILE"]
        + ["--log_samples", "--batch_size", "(default: 1)", "pip install 'gptforge[eval]'", "--init_from"],
    }[command]
    flat = " ".join(r.stdout.split())  # help is wrapped to the terminal width
    for text in expected:
        assert text in flat, text
    # each default is shown once and only where it informs: never None, never a flag's True / False
    assert not any(f"(default: {v})" in flat for v in ("None", "True", "False")), flat
    twice = [text for text in flat.split("(default:")[1:-1] if " -" not in text]  # no option before the next one
    assert not twice, twice


def test_console_script_and_module_agree():
    exe = os.path.join(os.path.dirname(sys.executable), "gptforge")
    r = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("gptforge ")
    assert run_cli("--version").stdout == r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--batchsize=3"], "unknown config key 'batchsize'; did you mean batch_size"),
        (["train", "--dataset=missing", "--device=cpu"], "gptforge prepare missing"),
        (["train", "--n_layer=two"], "n_layer must be int, got 'two'"),
        (["train", "--num_layers=2", "--n_layer=3"], "--num_layers=2 and --n_layer=3 disagree"),
        (["train", "--lr_schedule=cosine_restarts"], "lr_schedule must be one of cosine, linear, constant, wsd"),
        (["sample", "--out_dir=nowhere"], "checkpoint nowhere/ckpt.pt not found"),
        (["prepare", "text", "--name=x"], "needs one or more FILEs"),
        (["prepare", "shakespeare_char", "--input=missing.txt"], "input file 'missing.txt' not found"),
    ],
)
def test_user_errors_exit_2_without_traceback(tmp_path, args, message):
    r = run_cli(*args, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.startswith("gptforge: error:") or "usage:" in r.stderr


def test_argparse_errors_also_exit_2(tmp_path):
    r = run_cli("sample", "--num_samples=many", cwd=tmp_path)
    assert r.returncode == 2 and "invalid int value" in r.stderr


def test_sigint_finishes_the_step_checkpoints_and_resumes(char_data, tmp_path):
    """Ctrl-C mid-run: exit 0 with a checkpoint at the step reached; resume continues from that step."""
    out = tmp_path / "run"
    args = tiny_train_args(char_data, out, max_iters=100000, lr_decay_iters=100000, eval_interval=100000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptforge", "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    for line in proc.stdout:
        if line.startswith("iter 5:") or time.time() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "SIGINT: finishing this step" in stdout
    assert f"continue with: gptforge train --out_dir={out} --init_from=resume" in stdout
    from gptforge.weights.checkpoint import load_checkpoint

    stopped_at = load_checkpoint(str(out / "ckpt.pt"))["iter_num"]
    assert stopped_at >= 6
    steps = [
        json.loads(line)["step"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert steps == list(range(stopped_at))  # every finished step logged, none lost
    r = run_cli(
        "train",
        *tiny_train_args(
            char_data, out, max_iters=stopped_at + 3, lr_decay_iters=100000, eval_interval=100000, init_from="resume"
        ),
    )
    assert r.returncode == 0, r.stderr
    assert f"iter {stopped_at}: loss" in r.stdout and f"iter {stopped_at - 1}:" not in r.stdout


def test_sample_from_a_nanogpt_run_uses_its_meta_pkl(tmp_path):
    """nanoGPT's checkpoint has no tokenizer: sample finds data/<dataset>/meta.pkl as nanoGPT's sample.py does."""
    import pickle

    from test_train import nanogpt_checkpoint

    chars = sorted(set("abcdefgh \n"))
    (tmp_path / "data/tiny").mkdir(parents=True)
    (tmp_path / "data/tiny/meta.pkl").write_bytes(
        pickle.dumps(
            {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
        )
    )
    (tmp_path / "out").mkdir()
    nanogpt_checkpoint(
        tmp_path / "out/ckpt.pt",
        dict(n_layer=1, n_head=2, n_embd=16, block_size=16, bias=False, vocab_size=len(chars), dropout=0.0),
    )
    r = run_cli("sample", "--out_dir=out", "--start=abc", "--num_samples=1", "--max_new_tokens=20", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = r.stdout.removesuffix("---------------\n").removesuffix("\n")
    assert text.startswith("abc") and len(text) == 23 and set(text) <= set(chars)


def test_build_nanogpt_flags_train_a_wsd_run_whose_evaluations_state_perplexity(char_data, tmp_path):
    """build-nanogpt's flag names drive a real run; each step's lr is get_lr's wsd value; evals carry val_ppl."""
    import math

    from gptforge.train.loop import get_lr

    ours = tiny_train_args(
        char_data,
        None,
        batch_size=None,
        n_layer=None,
        max_iters=None,
        lr_decay_iters=None,
        warmup_iters=None,
        learning_rate=None,
        eval_interval=None,
    )
    theirs = [
        "--logdir",
        "log",
        "--mini_batch_size=8",
        "--num_layers",
        "2",
        "--steps_per_epoch=6",
        "--num_epochs=2",
        "--max_lr=3e-3",
        "--warmup_steps=2",
        "--eval_freq=6",
        "--sample_tokens=4",
    ]
    r = run_cli(
        "train", *ours, *theirs, "--hellaswag_interval=0", "--lr_schedule=wsd", "--decay_frac=0.5", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    run = tmp_path / "log"
    config = json.loads((run / "config.json").read_text())
    assert {
        k: config[k]
        for k in (
            "batch_size",
            "n_layer",
            "max_iters",
            "lr_decay_iters",
            "learning_rate",
            "warmup_iters",
            "eval_interval",
            "sample_interval",
            "hellaswag_interval",
        )
    } == {
        "batch_size": 8,
        "n_layer": 2,
        "max_iters": 12,
        "lr_decay_iters": 12,
        "learning_rate": 3e-3,
        "warmup_iters": 2,
        "eval_interval": 6,
        "sample_interval": 6,
        "hellaswag_interval": 0,
    }
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = [(x["step"], x["lr"]) for x in rows if x["kind"] == "train"]
    assert lrs == [(s, get_lr(s, 3e-3, 2, 12, 3e-4, schedule="wsd", decay_frac=0.5)) for s in range(12)]
    assert [x[1] for x in lrs[2:7]] == [3e-3] * 5 and lrs[-1][1] < 1e-3  # stable, then the decay
    evals = [x for x in rows if x["kind"] == "eval"]
    assert [x["step"] for x in evals] == [0, 6, 12]
    for x in evals:
        assert x["val_ppl"] == pytest.approx(math.exp(x["val_loss"])) and x["train_ppl"] > 1
        assert f"val loss {x['val_loss']:.4f} (ppl {x['val_ppl']:.2f})" in r.stdout
    assert [json.loads(x)["step"] for x in (run / "samples.jsonl").read_text().splitlines()] == [6, 12]


def test_sample_and_export_read_a_checkpoint_file_given_by_ckpt(char_data, tmp_path):
    """--ckpt: a finished run's ckpt.pt, renamed into another folder, samples and exports like the run itself;
    the tokenizer comes from the checkpoint (the run folder and the dataset are deleted first)."""
    import shutil

    run = tmp_path / "run"
    r = run_cli("train", *tiny_train_args(char_data, run, max_iters=9, lr_decay_iters=9, eval_interval=9))
    assert r.returncode == 0, r.stderr
    options = ["--start=All:", "--num_samples=2", "--max_new_tokens=20", "--device=cpu"]
    from_run = run_cli("sample", f"--out_dir={run}", *options, cwd=tmp_path)
    assert from_run.returncode == 0, from_run.stderr
    kept = tmp_path / "kept" / "model_00010.pt"
    kept.parent.mkdir()
    shutil.copy(run / "ckpt.pt", kept)
    shutil.rmtree(run)
    shutil.rmtree(char_data)

    r = run_cli("sample", f"--ckpt={kept}", *options, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == from_run.stdout and r.stdout.startswith("All:")
    r = run_cli("export", "--ckpt", str(kept), "--to=hf", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"of {kept}, step 9" in r.stdout
    exported = json.loads((tmp_path / "hf/config.json").read_text())
    assert exported["n_layer"] == 2 and exported["n_embd"] == 32

    for args, message in [
        (["sample", "--ckpt=missing.pt"], "--ckpt=missing.pt: no such checkpoint file"),
        (["sample", f"--ckpt={kept.parent}"], f"--ckpt={kept.parent} is a folder"),
        (["sample", f"--ckpt={kept}", "--init_from=gpt2"], "each name the model to load; give one of them"),
        (["export", "--ckpt=missing.pt", "--to=hf2"], "--ckpt=missing.pt: no such checkpoint file"),
        (["eval", "hellaswag", "--ckpt=missing.pt"], "--ckpt=missing.pt: no such checkpoint file"),
    ]:
        r = run_cli(*args, cwd=tmp_path)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert not (tmp_path / "hf2").exists()


def test_build_nanogpt_command_from_the_issue(char_data, tmp_path):
    """build-nanogpt's flags as its users type them: 10 steps (2 epochs of 5), accumulation 2 (256 tokens per
    step / (4 x 32)), log.txt in its format and the step checkpoint of the last step, model_00010.pt (--logdir
    brings build-nanogpt's layout: ckpt_interval 5000), which sample reads with --ckpt."""
    base = tiny_train_args(
        char_data,
        None,
        batch_size=None,
        block_size=None,
        n_layer=None,
        n_head=None,
        n_embd=None,
        max_iters=None,
        lr_decay_iters=None,
        eval_interval=None,
        gradient_accumulation_steps=None,
    )
    r = run_cli(
        "train",
        *base,
        "--mini_batch_size",
        "4",
        "--context_length",
        "32",
        "--num_layers",
        "2",
        "--num_heads",
        "2",
        "--embd_size",
        "32",
        "--total_batch_size",
        "256",
        "--steps_per_epoch",
        "5",
        "--num_epochs",
        "2",
        "--eval_freq",
        "5",
        "--logdir",
        "L",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "tokens per iteration: 256 = 2 accumulation x 1 processes x 4 batch x 32 block" in r.stdout
    log = (tmp_path / "L" / "log.txt").read_text().splitlines()
    assert [int(line.split()[0]) for line in log if " train " in line] == list(range(10))
    assert [line.split()[0] for line in log if " val " in line] == ["0", "5", "10"]
    ckpt = tmp_path / "L" / "model_00010.pt"
    from gptforge.weights.checkpoint import load_checkpoint

    assert load_checkpoint(str(ckpt))["iter_num"] == 10
    assert sorted(p.name for p in (tmp_path / "L").glob("model_*.pt")) == ["model_00010.pt"]  # --logdir: every 5000
    s = run_cli("sample", f"--ckpt={ckpt}", "--num_samples=1", "--max_new_tokens=8", "--device=cpu", cwd=tmp_path)
    assert s.returncode == 0 and s.stdout.count("---------------") == 1, s.stderr

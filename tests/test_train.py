"""The training loop, run for real on CPU with a tiny model: learning, files, determinism, exact resume."""

from __future__ import annotations

import json
import os
import platform
import re

import pytest
import torch

from conftest import ListBatches, kept_rates, tiny_train_args
from gptforge.core.config import load_config
from gptforge.core.device import autocast_context
from gptforge.core.errors import UserError
from gptforge.train.loop import train
from gptforge.weights.checkpoint import load_checkpoint


def run(data_dir, out_dir, **overrides):
    return train(load_config(tiny_train_args(data_dir, out_dir, **overrides)))


def records(out_dir, kind=None):
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return [r for r in rows if kind is None or r["kind"] == kind]


def test_run_learns_and_writes_its_files(char_data, tmp_path):
    out = tmp_path / "run"
    result = run(char_data, out, max_iters=30, lr_decay_iters=30)
    evals = records(out, "eval")
    assert [r["step"] for r in evals] == [0, 10, 20, 30]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5, evals  # from ~ln(vocab) to well below
    assert result["iter_num"] == 30 and result["losses"]["val"] == evals[-1]["val_loss"]
    train_rows = records(out, "train")
    assert [r["step"] for r in train_rows] == list(range(30))
    for key in ("loss", "lr", "grad_norm", "ms_per_iter", "tokens_per_s", "eta_s"):
        assert all(isinstance(r[key], float) for r in train_rows), key
    assert train_rows[-1]["mfu"] > 0 and train_rows[0]["mfu"] is None  # running MFU starts after 5 steps
    lines = (out / "log.txt").read_text().splitlines()
    assert lines[0] == f"0 val {evals[0]['val_loss']:.4f}" and lines[1] == f"0 train {train_rows[0]['loss']:.6f}"
    assert all(re.fullmatch(r"\d+ (train \d+\.\d{6}|val \d+\.\d{4})", line) for line in lines)
    config = json.loads((out / "config.json").read_text())
    assert config["device"] == "cpu" and config["dtype"] == "float32" and config["compile"] is False
    ckpt = load_checkpoint(str(out / "ckpt.pt"))
    assert ckpt["iter_num"] == 30 and ckpt["best_val_loss"] == min(r["val_loss"] for r in evals)
    assert set(ckpt) >= {
        "model",
        "optimizer",
        "model_args",
        "iter_num",
        "best_val_loss",
        "config",
        "scaler",
        "rng",
        "data_state",
        "tokenizer",
        "format_version",
    }
    assert ckpt["model_args"]["vocab_size"] == ckpt["tokenizer"]["itos"].__len__()
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])


def test_same_command_twice_gives_same_losses(char_data, tmp_path):
    run(char_data, tmp_path / "a", max_iters=8, dropout=0.1)
    run(char_data, tmp_path / "b", max_iters=8, dropout=0.1)
    a, b = records(tmp_path / "a", "train"), records(tmp_path / "b", "train")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    c = run(char_data, tmp_path / "c", max_iters=8, dropout=0.1, seed=7)
    assert c["losses"] != run(char_data, tmp_path / "d", max_iters=8, dropout=0.1)["losses"]


def test_resume_continues_at_the_right_iteration_with_identical_state(char_data, tmp_path):
    """A run stopped at step 10 and resumed to 20 equals an uninterrupted 20-step run, bit for bit (CPU fp32)."""
    common = dict(max_iters=20, lr_decay_iters=20, dropout=0.1)
    run(char_data, tmp_path / "whole", **common)
    run(char_data, tmp_path / "split", **{**common, "max_iters": 10})
    first = load_checkpoint(str(tmp_path / "split" / "ckpt.pt"))
    assert first["iter_num"] == 10
    result = run(char_data, tmp_path / "split", **common, init_from="resume")
    assert result["iter_num"] == 20

    whole, split = load_checkpoint(str(tmp_path / "whole/ckpt.pt")), load_checkpoint(str(tmp_path / "split/ckpt.pt"))
    assert split["iter_num"] == whole["iter_num"] == 20
    for key, tensor in whole["model"].items():
        assert torch.equal(tensor, split["model"][key]), key
    for pid, state in whole["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, split["optimizer"]["state"][pid][name]), (pid, name)
    assert whole["optimizer"]["param_groups"] == split["optimizer"]["param_groups"]
    # the metrics of the resumed run read like the uninterrupted run's: same steps, same losses, no repeats
    strip = [
        {k: v for k, v in r.items() if k in ("step", "kind", "loss", "val_loss", "train_loss", "lr")}
        for r in records(tmp_path / "whole")
    ]
    assert strip == [
        {k: v for k, v in r.items() if k in ("step", "kind", "loss", "val_loss", "train_loss", "lr")}
        for r in records(tmp_path / "split")
    ]
    assert (tmp_path / "whole/log.txt").read_text() == (tmp_path / "split/log.txt").read_text()


def test_gradient_accumulation_equals_one_big_batch():
    """4 micro-batches of 2 give the gradient and loss of one batch of 8 (the loss is divided by accum)."""
    from gptforge.model.gpt import GPT, GPTConfig
    from gptforge.model.optim import accumulate_gradients

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, bias=True)).double()
    x, y = torch.randint(0, 50, (8, 16)), torch.randint(0, 50, (8, 16))
    micro = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    nullctx = autocast_context("cpu", "float32")

    loss, (nx, _), state = accumulate_gradients(model, micro[0], ListBatches(micro[1:] + [(x, y)]), 4, nullctx, scaler)
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert torch.equal(nx, x) and state == {"left": 1}  # the batch after the last micro-batch is prefetched
    model.zero_grad(set_to_none=True)
    big_loss, *_ = accumulate_gradients(model, (x, y), ListBatches([(x, y)]), 1, nullctx, scaler)
    assert loss.dtype == torch.float32  # the step's loss is summed in float32 (for the log line), whatever the model's
    assert loss.item() == pytest.approx(big_loss.item(), rel=1e-6)  # so equal to a float32 rounding, not 1e-12
    for name, p in model.named_parameters():
        torch.testing.assert_close(accumulated[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_total_batch_size_sets_accumulation(char_data, tmp_path, capsys):
    run(
        char_data,
        tmp_path / "r",
        max_iters=2,
        batch_size=4,
        block_size=32,
        total_batch_size=512,
        gradient_accumulation_steps=None,
    )
    assert "tokens per iteration: 512 = 4 accumulation x 1 processes x 4 batch x 32 block" in capsys.readouterr().out
    assert json.loads((tmp_path / "r/config.json").read_text())["gradient_accumulation_steps"] == 4


def test_best_val_loss_never_gets_worse_and_always_save(char_data, tmp_path):
    out = tmp_path / "r"
    run(char_data, out, max_iters=10)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    ckpt["best_val_loss"] = 0.01  # pretend an earlier evaluation was far better
    torch.save(ckpt, out / "ckpt.pt")
    # always_save_checkpoint=False: no improvement, so ckpt.pt (the best model) is left alone
    run(char_data, out, max_iters=20, init_from="resume", always_save_checkpoint=False)
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 10
    # always_save_checkpoint=True: saved anyway, but the best stays the best
    run(char_data, out, max_iters=20, init_from="resume", always_save_checkpoint=True)
    saved = load_checkpoint(str(out / "ckpt.pt"))
    assert saved["iter_num"] == 20 and saved["best_val_loss"] == 0.01


def test_eval_only_evaluates_once_and_writes_no_checkpoint(char_data, tmp_path):
    out = tmp_path / "r"
    run(char_data, out, max_iters=10)
    before = (out / "ckpt.pt").read_bytes()
    result = run(char_data, out, init_from="resume", eval_only=True)
    assert result["iter_num"] == 10
    assert [r["step"] for r in records(out) if r["kind"] == "eval"][-1] == 10
    assert not [r for r in records(out, "train") if r["step"] >= 10]
    assert (out / "ckpt.pt").read_bytes() == before


def test_default_fast_path_tracks_float32_over_50_steps(char_data, tmp_path):
    """dtype='auto' (bf16 on AMX CPUs for wide models, float32 elsewhere) and explicit bf16 follow the float32
    loss curve over 50 steps: the fast path changes speed, not what is learned."""
    common = dict(max_iters=50, lr_decay_iters=50, eval_interval=50, n_embd=64, n_head=2)
    ref = run(char_data, tmp_path / "fp32", dtype="float32", **common)
    ref_losses = [r["loss"] for r in records(tmp_path / "fp32", "train")]
    for dtype in ("auto", "bfloat16"):
        got = run(char_data, tmp_path / dtype, dtype=dtype, **common)
        losses = [r["loss"] for r in records(tmp_path / dtype, "train")]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 0.05, dtype
        assert got["losses"]["val"] == pytest.approx(ref["losses"]["val"], abs=0.02), dtype
        assert ref_losses[-1] < ref_losses[0] - 0.5  # and the curve being tracked does fall


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_on_cpu(char_data, tmp_path, dtype):
    result = run(char_data, tmp_path / dtype, dtype=dtype, max_iters=10)
    reference = run(char_data, tmp_path / "fp32", dtype="float32", max_iters=10)
    assert result["losses"]["val"] == pytest.approx(reference["losses"]["val"], abs=0.05)
    assert result["losses"]["val"] != reference["losses"]["val"]  # autocast really ran in lower precision
    ckpt = load_checkpoint(str(tmp_path / dtype / "ckpt.pt"))
    assert ckpt["config"]["dtype"] == dtype
    assert bool(ckpt["scaler"]) == (dtype == "float16")  # a GradScaler only for float16
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values())  # weights stay float32


def test_autocast_context_casts_matmuls():
    lin = torch.nn.Linear(4, 4)
    with autocast_context("cpu", "bfloat16"):
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
    with autocast_context("cpu", "float32"):
        assert lin(torch.randn(2, 4)).dtype == torch.float32


def test_user_errors_before_any_training(char_data, tmp_path):
    with pytest.raises(UserError, match="holds .* tokens, not more than block_size=4096"):
        run(char_data, tmp_path / "r", block_size=4096)
    with pytest.raises(UserError, match="dataset folder .*nope.* not found"):
        run(char_data, tmp_path / "r", dataset="nope")
    with pytest.raises(UserError, match="checkpoint .*ckpt.pt not found"):
        run(char_data, tmp_path / "empty", init_from="resume")
    with pytest.raises(UserError, match="--device=cuda: no CUDA device"):
        run(char_data, tmp_path / "r", device="cuda")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="--out_dir=.*cannot write there"):
        run(char_data, blocker / "sub")


def test_measuring_peak_flops_leaves_the_global_rng_alone():
    from gptforge.core.cpu import measure_matmul_flops

    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    assert measure_matmul_flops("cpu", "float32", n=64, reps=1) > 0
    assert torch.equal(torch.rand(4), expected)


def nanogpt_checkpoint(path, model_args, iter_num=5):
    """A checkpoint laid out as nanoGPT writes it: compiled-model prefixes, tensor best_val_loss, no extras."""
    from gptforge.model.gpt import GPT, GPTConfig
    from gptforge.model.optim import configure_optimizer

    torch.manual_seed(0)
    model = GPT(GPTConfig(**model_args))
    opt = configure_optimizer(model, 0.1, 1e-3, (0.9, 0.99), "cpu")
    torch.save(
        {
            "model": {"_orig_mod." + k: v for k, v in model.state_dict().items()},
            "optimizer": opt.state_dict(),
            "model_args": model_args,
            "iter_num": iter_num,
            "best_val_loss": torch.tensor(3.5),
            "config": {"dataset": "tiny", "batch_size": 8},
        },
        path,
    )
    return model


def test_resume_from_a_nanogpt_checkpoint(char_data, tmp_path):
    vocab = json.loads((char_data / "tiny/meta.json").read_text())["vocab_size"]
    out = tmp_path / "r"
    out.mkdir()
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, bias=False, vocab_size=vocab, dropout=0.0)
    nanogpt_checkpoint(out / "ckpt.pt", args)
    result = run(char_data, out, init_from="resume", max_iters=8)
    assert result["iter_num"] == 8
    assert [r["step"] for r in records(out, "train")] == [5, 6, 7]
    assert load_checkpoint(str(out / "ckpt.pt"))["best_val_loss"] < 3.5


@pytest.mark.slow
def test_compiled_training_matches_eager_and_saves_plain_names(char_data, tmp_path):
    """torch.compile on CPU (inductor, needs a C++ compiler): same losses as eager, no `_orig_mod.` saved."""
    eager = run(char_data, tmp_path / "eager", max_iters=3, eval_interval=3, eval_iters=2, n_layer=1)
    compiled = run(
        char_data, tmp_path / "compiled", max_iters=3, eval_interval=3, eval_iters=2, n_layer=1, compile=True
    )
    assert compiled["losses"]["val"] == pytest.approx(eager["losses"]["val"], abs=1e-4)
    ckpt = load_checkpoint(str(tmp_path / "compiled/ckpt.pt"))
    raw = torch.load(tmp_path / "compiled/ckpt.pt", weights_only=True)["model"]
    assert not any("_orig_mod" in k for k in raw) and ckpt["config"]["compile"] is True


def test_auto_resolution_on_this_machine():
    from gptforge.core.device import resolve_compile, resolve_device, resolve_dtype

    expected_device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto") == expected_device
    assert resolve_device("cpu") == "cpu"
    assert resolve_dtype("bfloat16", "cpu", 128) == "bfloat16" and resolve_dtype("auto", "cpu", n_embd=128) == "float32"
    assert resolve_compile("auto", "cpu") is False and resolve_compile("auto", "cuda") is True
    assert resolve_compile(True, "cpu") is True and resolve_compile(False, "cuda") is False
    with pytest.raises(UserError, match="--device must be"):
        resolve_device("tpu")


@pytest.mark.gpu
def test_cuda_training_with_autocast_compile_and_pinned_batches(char_data, tmp_path):
    """On a GPU: bf16/fp16 autocast, torch.compile, fused AdamW and pinned, non-blocking batches."""
    result = run(char_data, tmp_path / "gpu", device="cuda", dtype="auto", compile=True, max_iters=10)
    reference = run(char_data, tmp_path / "cpu", max_iters=10)
    assert result["losses"]["val"] == pytest.approx(reference["losses"]["val"], abs=0.1)
    ckpt = load_checkpoint(str(tmp_path / "gpu/ckpt.pt"))
    assert ckpt["config"]["dtype"] in ("bfloat16", "float16") and ckpt["config"]["compile"] is True


@pytest.mark.parametrize(
    "bf16, n_embd, min_width, expected",
    [
        (6e11, 384, 256, "bfloat16"),
        (6e11, 128, 256, "float32"),
        (6e11, 128, 128, "bfloat16"),
        (6e11, 64, 128, "float32"),
        (2.1e11, 384, 256, "bfloat16"),  # 1.31x float32's: pays
        (1.9e11, 384, 256, "float32"),  # 1.19x: the conversions would eat it
        (0.8e11, 4096, 256, "float32"),  # half float32's rate, whatever the flags say
        (3e9, 384, 256, "float32"),  # emulated
        (3e9, 128, 128, "float32"),
    ],
)
def test_auto_dtype_on_cpu_follows_the_measured_rates(monkeypatch, tmp_path, bf16, n_embd, min_width, expected):
    """bfloat16 only where its products measured at least 1.25x float32's (1.6e11 here) and the model is at least
    cpu_bf16_min_width wide (256 unless a config says otherwise)."""
    from gptforge.core import device

    kept_rates(monkeypatch, tmp_path, float32=1.6e11, bfloat16=bf16)
    assert device.resolve_dtype("auto", "cpu", n_embd, min_width) == expected
    if min_width == 256:
        assert device.resolve_dtype("auto", "cpu", n_embd) == expected
    assert device.resolve_dtype("float32", "cpu", n_embd, min_width) == "float32"


def test_the_eta_forgets_the_compiling_first_step():
    """A first step of 18 s (torch.compile), then 15 ms steps (every 50th 0.5 s) logged every 50: the ETA is
    the later steps' mean times the steps left (it was 7 s a step after 250 steps, from the first's 18 s)."""
    from gptforge.train.metrics import StepTimer

    timer = StepTimer(max_iters=500, tokens_per_iter=1024, mfu=lambda dt: 0.1)
    timer.add(18.0)
    assert timer.report(0)["eta_s"] == pytest.approx(18.0 * 499)  # all it knows yet
    for step in range(1, 251):
        timer.add(0.015 if step % 50 else 0.5)  # every 50th step also evaluates
        if step % 50 == 0:
            eta = timer.report(step)["eta_s"]
    assert eta == pytest.approx((49 * 0.015 + 0.5) / 50 * 249, rel=1e-6), eta


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="ONEDNN_MAX_CPU_ISA=AVX2: x86-64")
def test_a_run_in_emulated_bf16_says_so_and_names_the_flag(char_data, tmp_path):
    """oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA) has no bf16 kernels on any x86-64 CPU, so --dtype=bfloat16
    multiplies through torch's fallback, tens of times slower than float32: the run's header says so with both
    rates and names --dtype=float32, and still trains; sampling and evaluating the run say it too. With the CPU's
    own oneDNN and bf16 hardware, no such line."""
    from conftest import run_cli
    from gptforge.core.cpu import half_pays

    args = tiny_train_args(char_data, tmp_path / "held", dtype="bfloat16", max_iters=2, eval_interval=2)
    held = run_cli("train", *args, env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert held.returncode == 0, held.stderr
    warning = re.search(
        r"warning: bfloat16 matrix products run at ([\d.,]+) GFLOP/s a core on this CPU against float32's ([\d.,]+):",
        held.stdout,
    )
    assert warning and "--dtype=float32 trains faster" in held.stdout, held.stdout
    half, single = (float(rate.replace(",", "")) for rate in warning.groups())
    assert 0 < half < 0.5 * single
    assert (tmp_path / "held" / "ckpt.pt").exists()
    held_env = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    for command in (
        ("sample", "--num_samples=1", "--max_new_tokens=4", "--start=a"),
        ("eval", "loss", "--eval_iters=1"),
    ):  # sample, chat, serve and eval say it too, once, on stderr
        used = run_cli(*command, f"--out_dir={tmp_path / 'held'}", "--device=cpu", "--dtype=bfloat16", env=held_env)
        assert used.returncode == 0, used.stderr
        assert used.stderr.count("warning: bfloat16 matrix products run at") == 1, used.stderr
        assert "--dtype=float32 runs faster" in used.stderr, used.stderr
    if half_pays():
        own = run_cli("train", *tiny_train_args(char_data, tmp_path / "own", dtype="bfloat16", max_iters=2))
        assert own.returncode == 0, own.stderr
        assert "matrix products run at" not in own.stdout, own.stdout

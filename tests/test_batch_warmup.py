"""batch_warmup_iters / batch_warmup_size: the first steps train on the first rows of each micro-batch. Their
gradient against a hand computation, the data stream and a resume against a run without them / an uninterrupted
run, the tokens bench and the log count, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ListBatches, run_cli, tiny_train_args, train_in_process, whole_and_resumed
from gptforge.weights.checkpoint import load_checkpoint


def test_a_warm_up_step_is_the_mean_loss_of_each_micro_batchs_first_rows():
    from gptforge.core.device import autocast_context
    from gptforge.model.gpt import GPT, GPTConfig
    from gptforge.model.optim import accumulate_gradients

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32)).double()
    micro = [(torch.randint(0, 50, (6, 16)), torch.randint(0, 50, (6, 16))) for _ in range(3)]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss, following, _ = accumulate_gradients(
        model, micro[0], ListBatches(micro[1:]), 2, autocast_context("cpu", "float32"), scaler, rows=2
    )
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert following is micro[2]  # whole batches drawn: the next step's batch is the loader's next, uncut
    model.zero_grad(set_to_none=True)
    reference = sum(model(x[:2], y[:2])[1] for x, y in micro[:2]) / 2
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_the_warm_up_leaves_the_data_stream_and_a_resume_inside_it_continues_exactly(char_data, tmp_path):
    """Resumed at step 3 of a 5-step warm-up, the run equals the uninterrupted one bit for bit; at its end the
    random stream (the loader's draws) is where a run without the warm-up leaves it, and the weights are not."""
    warm = dict(max_iters=6, lr_decay_iters=6, eval_interval=6, batch_warmup_iters=5, batch_warmup_size=3)
    a, _ = whole_and_resumed(char_data, tmp_path, warm)
    plain = tmp_path / "plain"
    train_in_process(*tiny_train_args(char_data, plain, max_iters=6, lr_decay_iters=6, eval_interval=6))
    b = load_checkpoint(str(plain / "ckpt.pt"))
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    assert not torch.equal(a["model"]["lm_head.weight"], b["model"]["lm_head.weight"])
    r = run_cli("train", *tiny_train_args(char_data, tmp_path / "said", max_iters=1, batch_warmup_iters=5,
                                          batch_warmup_size=3), cwd=tmp_path)  # fmt: skip
    said = "tokens per iteration: 256 = 1 accumulation x 1 processes x 8 batch x 32 block (96, 3 of the batch, in "
    assert r.returncode == 0 and said + "the first 5 steps)" in " ".join(r.stdout.split()), r.stdout


def test_bench_counts_the_warm_up_steps_tokens_as_trained(char_data, tmp_path):
    from test_time_to_loss import config_file

    config = config_file(tmp_path / "c.py", char_data, max_iters=6, lr_decay_iters=6)
    r = run_cli("bench", str(config), "--target_loss=0.01", "--eval_every=3", "--json", "--batch_warmup_iters=4",
                "--batch_warmup_size=2", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    (run,) = json.loads(r.stdout)["runs"]
    assert run["steps"] == 6 and run["tokens"] == 4 * 2 * 32 + 2 * 8 * 32


def test_the_log_counts_a_warm_up_steps_share_of_the_tokens():
    from gptforge.train.metrics import StepTimer

    timer = StepTimer(max_iters=100, tokens_per_iter=1000, mfu=lambda dt: 1.0 / dt)
    for _ in range(10):  # ten steps of a quarter of the batch, 0.1 s each: 2,500 tokens a second
        timer.add(0.1, share=0.25)
    report = timer.report(10)
    assert report["tokens_per_s"] == pytest.approx(2500.0) and report["ms_per_iter"] == pytest.approx(100.0)
    assert report["mfu"] == pytest.approx(1.0 / 0.4)  # the MFU of a whole step taking 0.4 s


@pytest.mark.parametrize(
    "options,words",
    [
        (["--batch_warmup_iters=10"], "--batch_warmup_iters=10 needs --batch_warmup_size from 1 to batch_size (8)"),
        (["--batch_warmup_iters=10", "--batch_warmup_size=9"], "from 1 to batch_size (8), got 9"),
    ],
)
def test_a_warm_up_without_a_fitting_size_is_refused(char_data, tmp_path, options, words):
    r = run_cli("train", *tiny_train_args(char_data, tmp_path / "out"), *options, cwd=tmp_path)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()

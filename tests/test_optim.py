"""AdamW parameter groups and the learning-rate schedule, against values computed by hand."""

from __future__ import annotations

import pytest
import torch

from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.optim import configure_optimizer
from gptforge.train.loop import get_lr

SCHED = dict(learning_rate=1e-3, warmup_iters=100, lr_decay_iters=2000, min_lr=1e-4)


@pytest.mark.parametrize(
    "it, expected",
    [
        (0, 1e-3 * 1 / 101),  # warmup starts above zero
        (49, 1e-3 * 50 / 101),
        (99, 1e-3 * 100 / 101),  # last warmup step
        (100, 1e-3),  # cosine starts at the peak
        (575, 1e-4 + 0.5 * (1 + 0.7071067811865476) * 9e-4),  # a quarter of the way: cos(pi / 4)
        (1050, 5.5e-4),  # half way: the mean of peak and floor
        (2000, 1e-4),
        (2001, 1e-4),
        (10**6, 1e-4),
    ],
)
def test_schedule_hand_computed(it, expected):
    assert get_lr(it, **SCHED) == pytest.approx(expected, rel=1e-12)


def test_schedule_is_monotonic_and_constant_without_decay():
    lrs = [get_lr(i, **SCHED) for i in range(2100)]
    assert all(a < b for a, b in zip(lrs[:100], lrs[1:101], strict=True))
    assert all(a >= b for a, b in zip(lrs[100:], lrs[101:], strict=False))
    assert all(get_lr(i, **SCHED, decay_lr=False) == 1e-3 for i in (0, 50, 100, 5000))
    # warmup longer than the decay horizon must not divide by zero
    assert get_lr(10, 1e-3, 20, 20, 1e-4) == pytest.approx(1e-3 * 11 / 21)
    assert get_lr(20, 1e-3, 20, 20, 1e-4) == 1e-4


# peak 1e-3, floor 1e-4, 100 warmup steps, decay ends at step 2000; wsd decays over the last 20% (1600 -> 2000)
@pytest.mark.parametrize(
    "schedule, it, expected",
    [
        *[(s, 0, 1e-3 / 101) for s in ("cosine", "linear", "constant", "wsd")],  # every schedule warms up alike
        *[(s, 99, 1e-3 * 100 / 101) for s in ("cosine", "linear", "constant", "wsd")],  # end of warmup
        *[(s, 100, 1e-3) for s in ("cosine", "linear", "constant", "wsd")],  # the peak, where a decay starts
        ("linear", 575, 1e-3 - 0.25 * 9e-4),  # a quarter of the way down: 7.75e-4
        ("linear", 1050, 5.5e-4),  # half way
        ("linear", 1999, 1e-4 + 9e-4 / 1900),  # one step before the end
        ("constant", 1999, 1e-3),
        ("wsd", 1599, 1e-3),  # still stable
        ("wsd", 1600, 1e-3),  # the decay starts at the peak
        ("wsd", 1700, 1e-3 - 0.25 * 9e-4),
        ("wsd", 1800, 5.5e-4),
        ("wsd", 1999, 1e-4 + 9e-4 / 400),
        *[(s, 2000, 1e-4) for s in ("cosine", "linear", "wsd")],  # the end of the decay: min_lr
        *[(s, 5000, 1e-4) for s in ("cosine", "linear", "wsd")],  # and beyond it
        ("constant", 2000, 1e-3),
        ("constant", 5000, 1e-3),  # constant never uses min_lr
    ],
)
def test_schedules_hand_computed(schedule, it, expected):
    assert get_lr(it, **SCHED, schedule=schedule) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "it, frac0, frac1",
    [
        (100, 1e-3, 1e-3),  # decay_frac 1: wsd is linear from the end of warmup
        (1050, 1e-3, 5.5e-4),
        (1999, 1e-3, 1e-4 + 9e-4 / 1900),  # decay_frac 0: stable up to the last step before lr_decay_iters...
        (2000, 1e-4, 1e-4),  # ...then min_lr
    ],
)
def test_wsd_decay_frac_zero_and_one(it, frac0, frac1):
    assert get_lr(it, **SCHED, schedule="wsd", decay_frac=0.0) == pytest.approx(frac0, rel=1e-12)
    assert get_lr(it, **SCHED, schedule="wsd", decay_frac=1.0) == pytest.approx(frac1, rel=1e-12)
    assert get_lr(it, **SCHED, schedule="wsd", decay_frac=1.0) == get_lr(it, **SCHED, schedule="linear")


def test_wsd_decay_never_starts_inside_warmup_and_decay_lr_false_is_constant():
    # 90% of 200 steps would start the decay at step 20, inside the 100 warmup steps: it starts after them
    short = dict(learning_rate=1e-3, warmup_iters=100, lr_decay_iters=200, min_lr=0.0)
    assert get_lr(100, **short, schedule="wsd", decay_frac=0.9) == 1e-3
    assert get_lr(150, **short, schedule="wsd", decay_frac=0.9) == pytest.approx(5e-4, rel=1e-12)
    for schedule in ("cosine", "linear", "constant", "wsd"):  # nanoGPT's decay_lr=False: no warmup, no decay
        assert {get_lr(i, **SCHED, decay_lr=False, schedule=schedule) for i in (0, 99, 1800, 5000)} == {1e-3}
    for schedule in ("cosine", "linear", "wsd"):  # monotonic: up through warmup, never up after it
        lrs = [get_lr(i, **SCHED, schedule=schedule) for i in range(2100)]
        assert all(a < b for a, b in zip(lrs[:100], lrs[1:101], strict=True))
        assert all(a >= b for a, b in zip(lrs[100:], lrs[101:], strict=False))
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        get_lr(0, **SCHED, schedule="step")
    with pytest.raises(ValueError, match="decay_frac must be in"):
        get_lr(0, **SCHED, schedule="wsd", decay_frac=1.5)


def test_weight_decay_only_on_matrices_and_embeddings():
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=2, n_head=2, n_embd=8, bias=True))
    opt = configure_optimizer(model, weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95), device_type="cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    # every parameter exactly once (the tied wte / lm_head matrix included once)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert decay["betas"] == (0.9, 0.95) and not decay["fused"]


def test_no_decay_parameters_are_untouched_by_decay():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=4, bias=True))
    opt = configure_optimizer(model, weight_decay=0.5, learning_rate=0.1, betas=(0.9, 0.95), device_type="cpu")
    ln_before = model.transformer.ln_f.weight.detach().clone()
    w_before = model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradients: only weight decay can move a parameter
    opt.step()
    torch.testing.assert_close(model.transformer.ln_f.weight.detach(), ln_before)
    torch.testing.assert_close(model.transformer.h[0].mlp.c_fc.weight.detach(), w_before * (1 - 0.1 * 0.5))

"""A block's residual connections with dropout on their branch (x + dropout(attn(ln(x))), x + dropout(mlp(...))):
with fast dropout in CPU training one pass each way by cpu_kernels.c (kernels.ResidualDropout), the same masks and
the same bits, loss and gradients, as the sum of the Dropout module's output."""

from __future__ import annotations

import pytest
import torch

from conftest import loss_and_grads
from gptforge.kernels import dropout as kernels
from gptforge.kernels.reference import SPECIAL, same_bits
from gptforge.model import modules
from gptforge.model.gpt import GPT, GPTConfig


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_dropout_gives_the_bits_of_the_sum_it_replaces(dtype, monkeypatch):
    calls, real = [], kernels.ResidualDropout.apply
    monkeypatch.setattr(kernels.ResidualDropout, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(kernels, "layer_norm_to_bf16", lambda *a: False)  # under bf16: AddNorm (test_add_norm.py)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=2, n_embd=64, dropout=0.2, bias=True))
    model.use_fast_dropout(True)
    idx = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(1))

    fused = loss_and_grads(model, idx, seed=2, bf16=dtype == torch.bfloat16)  # seed: the same masks each time
    assert len(calls) == 4  # two blocks, two connections each
    monkeypatch.setattr(modules.Dropout, "add_to", lambda self, x, y: x + self(y))  # the sum, as before
    summed = loss_and_grads(model, idx, seed=2, bf16=dtype == torch.bfloat16)
    assert len(calls) == 4
    assert torch.equal(fused[0], summed[0])
    for a, b in zip(fused[1].values(), summed[1].values(), strict=True):
        assert torch.equal(a, b)
    model.eval()  # evaluation: no dropout, the plain sum
    with torch.no_grad():
        model(idx, idx)
    assert len(calls) == 4


def test_without_dropout_a_bf16_branch_is_added_in_one_pass_with_torchs_bits(monkeypatch):
    """p 0, or evaluation: a float32 stream plus a bf16 branch (autocast's output) by cpu_kernels.c's sum (ResidualAdd),
    torch's bits forward and backward (the branch's gradient rounded to bf16 as autograd rounds it); a float32
    branch, and float64, stay torch's sum."""
    calls, real = [], kernels.ResidualAdd.apply
    monkeypatch.setattr(kernels.ResidualAdd, "apply", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(70001, generator=gen), torch.randn(70001, generator=gen)
    x[:10], y[-10:] = torch.tensor(SPECIAL), torch.tensor(SPECIAL)
    y = y.bfloat16()
    g = torch.randn(70001, generator=gen)
    for dropout in (modules.Dropout(0.0), modules.Dropout(0.2).eval()):
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        out = dropout.add_to(xs, ys)
        out.backward(g)
        xt, yt = x.clone().requires_grad_(), y.clone().requires_grad_()
        (xt + yt).backward(g)
        assert same_bits(out, xt + yt) and same_bits(xs.grad, xt.grad) and same_bits(ys.grad, yt.grad)
    assert len(calls) == 2
    modules.Dropout(0.0).add_to(x, y.float())
    modules.Dropout(0.0).add_to(x.double(), y.double())
    assert len(calls) == 2


def test_a_model_without_dropout_under_bf16_autocast_keeps_its_loss_and_gradients(monkeypatch):
    calls, real = [], kernels.ResidualAdd.apply
    monkeypatch.setattr(kernels.ResidualAdd, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    config = dict(rotary=True, rmsnorm=True, qk_norm=True, relu2=True, untie_head=True, bias=False, dropout=0.0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=2, n_embd=64, **config))
    idx = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(1))

    mine = loss_and_grads(model, idx)
    assert len(calls) == 4  # two blocks, two connections each
    monkeypatch.setattr(kernels, "_add_kernel", lambda x, y: None)
    theirs = loss_and_grads(model, idx)
    assert len(calls) == 4
    assert torch.equal(mine[0], theirs[0])
    for name, grad in mine[1].items():
        assert torch.equal(grad, theirs[1][name]), name

"""The bf16 weight gradient of a narrow-output layer from a transposed copy (NarrowGradLinear, under bf16 CPU autocast
on AMX CPUs): the same output and input gradient as torch's F.linear bit for bit, the weight's and the bias's
gradients within bf16 rounding of float64's and no further from it than torch's, and the layer takes it only
where its conditions hold."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from conftest import loss_and_grads
from gptforge.kernels import linear, native
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.modules import Linear


@pytest.fixture
def counted(monkeypatch):
    calls, real = [], linear.NarrowGradLinear.apply
    monkeypatch.setattr(linear.NarrowGradLinear, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(linear, "cpu_has_amx", lambda: True)  # the function is right anywhere; AMX is for speed
    kernels = native.native_kernels()
    assert kernels is not None  # CI has a C compiler
    return calls


def forward_backward(layer, x, g, through_layer: bool):
    x = x.detach().requires_grad_()
    layer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x) if through_layer else F.linear(x, layer.weight, layer.bias)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_narrow_gradient_against_torch_and_float64(counted, x_dtype, monkeypatch):
    if not native.native_kernels().fast_rows:
        monkeypatch.setattr(linear, "native_kernels", lambda: native.native_kernels()._replace(fast_rows=True))
    gen = torch.Generator().manual_seed(0)
    # the baby GPT's MLP projection is 1536 -> 384; a third of each keeps the shape's rules (4 tiles of 32 out) at a
    # ninth of the products, which without bf16 hardware (emulated) took ~30 s each at full size
    layer = Linear(512, 128, bias=True)
    x = torch.randn(4, 1100, 512, generator=gen).to(x_dtype)  # 4,400 tokens: a ragged last tile of rows
    g = torch.randn(4, 1100, 128, generator=gen).to(torch.bfloat16)
    mine = forward_backward(layer, x, g, through_layer=True)
    assert counted == [1]
    theirs = forward_backward(layer, x, g, through_layer=False)
    for name, a, b in zip(("y", "dx"), mine[:2], theirs[:2], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    g64, x64 = g.double().reshape(-1, 128), x.bfloat16().double().reshape(-1, 512)
    sums = (
        ("dw", mine[2], theirs[2], g64.t() @ x64, g64.abs().t() @ x64.abs()),
        ("db", mine[3], theirs[3], g64.sum(0), g64.abs().sum(0)),
    )
    for name, a, b, want, size in sums:
        assert a.dtype == b.dtype == torch.float32, name
        # one bf16 rounding of the result, after float32 sums of 4,400 terms (a bound on their rounding: size 2^-16)
        assert ((a.double() - want).abs() <= want.abs() * 2**-8 + size * 2**-16).all(), name
        mine_error, torch_error = (a.double() - want).abs(), (b.double() - want).abs()
        assert mine_error.max() <= torch_error.max() * 1.01 and mine_error.mean() <= torch_error.mean() * 1.05, name


def test_the_layer_takes_it_only_where_it_pays(counted):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 1024, 1536, generator=gen)
    g = torch.randn(8, 1024, 384, generator=gen).to(torch.bfloat16)
    wide = Linear(1536, 384, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wide(x).backward(g)  # training under bf16 autocast: taken where the kernels have their AVX-512 paths
    assert len(counted) == int(native.native_kernels().fast_rows)
    counted.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        wide(x)  # no gradient
    wide(x)  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Linear(384, 1536)(x[..., :384])  # a wide output: torch's transposed operand is fast enough
        Linear(1536, 65)(x)  # not whole tiles (a character head)
        wide(x[:1, :100])  # too few tokens
    assert counted == []


def test_a_model_trains_through_it_with_torchs_loss(counted, monkeypatch):
    if not native.native_kernels().fast_rows:
        monkeypatch.setattr(linear, "native_kernels", lambda: native.native_kernels()._replace(fast_rows=True))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, vocab_size=65, n_layer=2, n_head=2, n_embd=64, dropout=0.0, bias=False))
    idx = torch.randint(0, 65, (16, 256), generator=torch.Generator().manual_seed(2))

    mine = loss_and_grads(model, idx)
    assert len(counted) == 2  # each block's MLP projection
    monkeypatch.setattr(linear, "cpu_has_amx", lambda: False)
    theirs = loss_and_grads(model, idx)
    assert torch.equal(mine[0], theirs[0])  # the forward is torch's
    for name, grad in mine[1].items():
        if name.endswith("mlp.c_proj.weight"):  # one bf16 rounding apart: a unit in the last place is 2^-8 to 2^-7 of
            # the value (2^-7 just above a power of two: an element of 2.0e-3 differed by 2^-16 on a Zen 1 EPYC)
            torch.testing.assert_close(grad, theirs[1][name], rtol=2**-7, atol=2**-12 * grad.abs().max().item())
        else:  # the gradients below it see the same input gradient
            assert torch.equal(grad, theirs[1][name]), name

"""LayerNorm before a linear layer: on a CPU under bf16 autocast written in bf16 by cpu_kernels.c's one pass a row
(kernels.norms.LayerNormToBf16), against a float64 reference and torch's own path (float32 LayerNorm, then the layer's
rounding to bf16); elsewhere torch's nn.LayerNorm itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import loss_and_grads
from gptforge.core.cpu import cpu_bf16_autocast
from gptforge.kernels import native, norms
from gptforge.kernels.reference import layer_norm_reference
from gptforge.model import modules
from gptforge.model.gpt import GPT, GPTConfig


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_under_bf16_autocast_matches_float64_and_torchs_path(bias, monkeypatch):
    """Output in bf16 within one bf16 rounding of float64's and of torch's path (float32 LayerNorm rounded to bf16);
    x's, the weight's and the bias's gradients from the same bf16 upstream gradient within float32 rounding of
    float64's and as close as torch's path (which rounds the same gradient to float32 first)."""
    assert native.native_kernels() is not None  # CI has a C compiler
    calls, real = [], norms.LayerNormToBf16.apply
    monkeypatch.setattr(norms.LayerNormToBf16, "apply", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    norm = modules.LayerNorm(384, bias=bias)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(384, generator=gen))
        if bias:
            norm.bias.copy_(torch.randn(384, generator=gen))
    x0 = torch.randn(8, 300, 384, generator=gen) * 2 + 0.5
    g = torch.randn(8, 300, 384, generator=gen).to(torch.bfloat16)

    def run(module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = x0.clone().requires_grad_()
        module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x).to(torch.bfloat16)  # what the linear layer after it does with torch's float32 output
        y.backward(g)
        return y, [x.grad] + [p.grad for p in module.parameters()]

    mine, mine_grads = run(norm)
    assert len(calls) == 1 and mine.dtype == torch.bfloat16
    torch_norm = nn.LayerNorm(384, bias=bias)
    torch_norm.load_state_dict(norm.state_dict())
    theirs, their_grads = run(torch_norm)
    assert len(calls) == 1
    x64 = x0.double().requires_grad_()
    params64 = [p.detach().double().requires_grad_() for p in norm.parameters()]
    want = layer_norm_reference(x64, params64[0], params64[1] if bias else None, norm.eps)
    want.backward(g.double())
    for y in (mine, theirs):
        torch.testing.assert_close(y.double(), want, rtol=2**-8, atol=2**-8 * 4)
    assert (mine.double() - want).abs().max() <= (theirs.double() - want).abs().max() * 1.01
    for got, torch_got, exact in zip(mine_grads, their_grads, [x64.grad] + [p.grad for p in params64], strict=True):
        error, torch_error = (got.double() - exact).abs().max(), (torch_got.double() - exact).abs().max()
        assert error <= 1e-4 * exact.abs().max() and error <= 2 * torch_error + 1e-6 * exact.abs().max()


def test_layer_norm_elsewhere_is_torchs():
    """Without autocast, and in float32 under no kernel's conditions (a bf16 input), it is nn.LayerNorm bit for bit;
    its state_dict is nn.LayerNorm's."""
    gen = torch.Generator().manual_seed(1)
    norm, torch_norm = modules.LayerNorm(64), nn.LayerNorm(64)
    assert norm.state_dict().keys() == torch_norm.state_dict().keys()
    torch_norm.load_state_dict(norm.state_dict())
    x = torch.randn(4, 64, generator=gen)
    assert torch.equal(norm(x), torch_norm(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(norm(x.bfloat16()), torch_norm(x.bfloat16()))


def test_the_condition_is_bf16_cpu_autocast_only():
    """core.cpu.cpu_bf16_autocast, the condition LayerNorm and NarrowGradLinear share: CPU tensors under CPU autocast
    in bf16; not float16 autocast (where LayerNorm stays torch's), not outside autocast, not another device."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    norm, torch_norm = modules.LayerNorm(64), nn.LayerNorm(64)
    assert not cpu_bf16_autocast(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_bf16_autocast(x) and not cpu_bf16_autocast(x.to("meta"))
    with torch.autocast("cpu", dtype=torch.float16):
        assert not cpu_bf16_autocast(x)
        assert torch.equal(norm(x), torch_norm(x))


def test_the_model_under_bf16_autocast_takes_it_with_torchs_loss():
    """nanoGPT's model (LayerNorm blocks) under bf16 CPU autocast: the kernel for its 2 x 2 + 1 norms, and the loss
    and gradients of torch's path within bf16 rounding."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=2, n_embd=64, dropout=0.0, bias=True))
    idx = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(2))

    calls, real = [], norms.LayerNormToBf16.apply
    norms.LayerNormToBf16.apply = lambda *a: calls.append(1) or real(*a)
    try:
        mine = loss_and_grads(model, idx)
    finally:
        norms.LayerNormToBf16.apply = real
    assert len(calls) == 5
    forward = modules.LayerNorm.forward
    modules.LayerNorm.forward = nn.LayerNorm.forward
    try:
        theirs = loss_and_grads(model, idx)
    finally:
        modules.LayerNorm.forward = forward
    torch.testing.assert_close(mine[0], theirs[0], rtol=1e-2, atol=0)
    for a, b in zip(mine[1].values(), theirs[1].values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.02 * b.abs().max().item())

"""A block's residual connections with dropout on their branch (x + dropout(attn(ln(x))), x + dropout(mlp(...))):
with fast dropout in CPU training one pass each way by keep_mask.c (layers.ResidualDropout), the same masks and
the same bits, loss and gradients, as the sum of the Dropout module's output."""

from __future__ import annotations

import pytest
import torch

from conftest import loss_and_grads
from gptforge.model import layers
from gptforge.model.gpt import GPT, GPTConfig


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_dropout_gives_the_bits_of_the_sum_it_replaces(dtype, monkeypatch):
    calls, real = [], layers.ResidualDropout.apply
    monkeypatch.setattr(layers.ResidualDropout, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=2, n_embd=64, dropout=0.2, bias=True))
    model.use_fast_dropout(True)
    idx = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(1))

    fused = loss_and_grads(model, idx, seed=2, bf16=dtype == torch.bfloat16)  # seed: the same masks each time
    assert len(calls) == 4  # two blocks, two connections each
    monkeypatch.setattr(layers.Dropout, "add_to", lambda self, x, y: x + self(y))  # the sum, as before
    summed = loss_and_grads(model, idx, seed=2, bf16=dtype == torch.bfloat16)
    assert len(calls) == 4
    assert torch.equal(fused[0], summed[0])
    for a, b in zip(fused[1].values(), summed[1].values(), strict=True):
        assert torch.equal(a, b)
    model.eval()  # evaluation: no dropout, the plain sum
    with torch.no_grad():
        model(idx, idx)
    assert len(calls) == 4

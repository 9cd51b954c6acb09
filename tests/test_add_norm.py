"""A residual connection with dropout and the LayerNorm after it in one pass each way (kernels.dropout.AddNorm: each
residual sum taken with the norm that follows it, modules.Dropout.norm_after): nanoGPT's model under bf16 CPU
autocast with fast dropout trains with the bits of the two kernels it joins (ResidualDropout, LayerNormToBf16) and of
autograd's sum between them; elsewhere the same steps as each apart."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import loss_and_grads
from gptforge.kernels import checks as native_checks
from gptforge.kernels import dropout, native, norms
from gptforge.model.gpt import GPT, GPTConfig


def nanogpt_model(bias: bool, dropout: float = 0.2) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=3, n_head=2, n_embd=64, dropout=dropout, bias=bias))
    model.use_fast_dropout(True)
    return model


@pytest.fixture
def counted(monkeypatch):
    calls, real = [], dropout.AddNorm.apply
    monkeypatch.setattr(dropout.AddNorm, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpts_model_trains_through_it_with_the_bits_of_the_steps_it_joins(bias, counted, monkeypatch):
    assert native.native_kernels() is not None  # CI has a C compiler: the compiled path must be what runs there
    model = nanogpt_model(bias)
    idx = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(1))

    joined = loss_and_grads(model, idx, seed=2)  # seed: the same masks each time
    assert len(counted) == 6  # three blocks, two residual connections each (the last one's norm is ln_f)
    monkeypatch.setattr(dropout, "layer_norm_to_bf16", lambda *a: False)  # each sum, then its norm, apart
    apart = loss_and_grads(model, idx, seed=2)
    assert len(counted) == 6
    assert torch.equal(joined[0], apart[0])
    for name, grad in joined[1].items():
        assert torch.equal(grad, apart[1][name]), name


@pytest.mark.parametrize("bf16", [True, False])
def test_the_chain_without_the_kernel_is_the_blocks_forward(bf16, counted, monkeypatch):
    """float32 (no kernel for the pair), or bf16 without the compiled kernels: the same steps as each apart."""
    if bf16:
        monkeypatch.setattr(dropout, "native_kernels", lambda: None)
        monkeypatch.setattr(norms, "native_kernels", lambda: None)
    model = nanogpt_model(bias=True)
    idx = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(1))
    chained = loss_and_grads(model, idx, seed=2, bf16=bf16)
    monkeypatch.setattr(dropout, "layer_norm_to_bf16", lambda *a: False)
    apart = loss_and_grads(model, idx, seed=2, bf16=bf16)
    assert counted == []
    assert torch.equal(chained[0], apart[0])
    for name, grad in chained[1].items():
        assert torch.equal(grad, apart[1][name]), name


def test_only_in_training_with_dropout(counted):
    """Evaluation, and a model without dropout, take the blocks' forward."""
    idx = torch.randint(0, 65, (2, 64), generator=torch.Generator().manual_seed(1))
    for model in (nanogpt_model(bias=True).eval(), nanogpt_model(bias=True, dropout=0.0)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, idx)
    assert counted == []


def test_the_load_check_refuses_a_wrong_kernel():
    """native's check compares the joined kernel with the two it joins: a forward one bit off in the first row's
    first normalised value fails it."""
    real = native.native_kernels()
    assert real is not None and native_checks.add_norm_agrees(real)
    forward, backward = real.add_norm

    def off_by_a_bit(*args):  # noqa: ANN002
        forward(*args)
        ctypes.c_uint16.from_address(args[6]).value ^= 1  # h, the normalised rows

    assert not native_checks.add_norm_agrees(real._replace(add_norm=(off_by_a_bit, backward)))

"""The memory estimate that stops configs too big for the machine: a lower bound of what training really holds."""

from __future__ import annotations

import pytest
import torch

from gptforge.core.errors import UserError
from gptforge.core.memory import GB, check_fits, estimate_training_memory
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.optim import configure_optimizer

SHAPES = [
    dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=65, bias=False),
    dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65, bias=True),
    dict(n_layer=3, n_head=4, n_embd=64, block_size=128, vocab_size=512, bias=True),
    dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=512, bias=False, untie_head=True),
    dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=65, rotary=True, rmsnorm=True, untie_head=True),
]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("args", SHAPES)
def test_parameters_and_states_are_the_real_ones(args, optimizer):
    """Against a real model after one optimizer step: its parameters (an untied head counted), gradients and the
    optimizer's moments, in bytes."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**args))
    muon = {"lr": 0.02, "momentum": 0.95, "warmup": 10} if optimizer == "muon" else None
    opt = configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon)
    x = torch.randint(args["vocab_size"], (2, args["block_size"]))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    real = model.get_num_params(non_embedding=False)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    held += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    est = estimate_training_memory({**GPTConfig().__dict__, **args}, 2, "float32", optimizer)
    assert est.parameters == real
    assert est.states == held


def test_activations_grow_with_the_micro_batch_and_shrink_in_16_bits():
    args = {**GPTConfig().__dict__, **SHAPES[1]}
    one, two = (estimate_training_memory(args, b, "float32").activations for b in (1, 2))
    assert two == 2 * one
    assert estimate_training_memory(args, 1, "bfloat16").activations < one
    fsdp = estimate_training_memory(args, 1, "float32", shards=4)
    assert fsdp.states == estimate_training_memory(args, 1, "float32").states / 4


def test_a_config_that_does_not_fit_names_the_keys_to_lower():
    big = dict(n_layer=2, n_head=16, n_embd=65536, block_size=32, vocab_size=65, bias=False)
    est = estimate_training_memory({**GPTConfig().__dict__, **big}, 8, "float32")
    assert est.total > 100 * GB
    with pytest.raises(UserError, match=r"needs ~\d.* GB .* this machine has 24.00 GB available: lower --n_embd"):
        check_fits(est, 24 * GB, "this machine")
    check_fits(est, None, "an MPS device")  # unknown memory: no refusal
    check_fits(est, est.total, "a big machine")

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


def test_with_head_loss_the_logits_are_one_copy_and_still_a_lower_bound():
    """head_loss keeps one (tokens, V) buffer in the compute dtype instead of three float32 copies, and the
    estimate stays below what a real bf16 training forward saves for backward (its tensors' storages, the
    parameters left out), which the step's peak holds at least."""
    args = {**GPTConfig().__dict__, **dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=4096)}
    plain = estimate_training_memory(args, 4, "bfloat16")
    fused = estimate_training_memory(args, 4, "bfloat16", head_loss=True)
    assert plain.activations - fused.activations == 4 * 64 * (3 * 4096 * 4 - 4096 * 2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{k: args[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}))
    x = torch.randint(4096, (4, 64))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(x, x, need_logits=False)
    assert logits is None  # head_loss took it
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert sum(n for ptr, n in storages.items() if ptr not in parameters) >= fused.activations


def test_a_config_that_does_not_fit_names_the_keys_to_lower():
    big = dict(n_layer=2, n_head=16, n_embd=65536, block_size=32, vocab_size=65, bias=False)
    est = estimate_training_memory({**GPTConfig().__dict__, **big}, 8, "float32")
    assert est.total > 100 * GB
    with pytest.raises(UserError, match=r"needs ~\d.* GB .* this machine has 24.00 GB available: lower --n_embd"):
        check_fits(est, 24 * GB, "this machine")
    check_fits(est, None, "an MPS device")  # unknown memory: no refusal
    check_fits(est, est.total, "a big machine")

"""The memory estimate that stops configs too big for the machine: a lower bound of what training really holds."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gptforge.core.errors import UserError
from gptforge.core.memory import GB, check_fits, estimate_training_memory
from gptforge.kernels.attention import saved_score_bytes
from gptforge.kernels.head_loss import head_loss_used
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.optim import MuonSettings, configure_optimizer

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
    muon = MuonSettings(lr=0.02, momentum=0.95, warmup=10) if optimizer == "muon" else None
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


def saved_storages(model: GPT, x: torch.Tensor, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Every tensor one training forward keeps for backward, by storage (the parameters left out)."""
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    ctx = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        model(x, x)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return {ptr: t for ptr, t in saved.items() if ptr not in parameters}


@pytest.mark.parametrize(
    "block_size, dropout, dtype",
    [(128, 0.1, torch.bfloat16), (128, 0.1, torch.float32), (96, 0.2, torch.float32), (128, 0.0, torch.bfloat16),
     (128, 0.0, torch.float32)],
)  # fmt: skip
def test_attention_scores_are_counted_as_the_real_model_keeps_them(block_size, dropout, dtype):
    """The (B, nh, T, S) tensors a real CPU training forward keeps (probabilities, dropped probabilities, masks; with
    query blocks at T 128, one block at T 96; none where SDPA's fused kernel runs: float32 at dropout 0) add up to
    exactly saved_score_bytes per sequence and layer."""
    n_layer, n_head, B = 2, 2, 3  # every other saved tensor has a last dimension under 48: 4C 32, vocab 32
    args = {**GPTConfig().__dict__, **dict(n_layer=n_layer, n_head=n_head, n_embd=8, block_size=block_size)}
    args.update(vocab_size=32, dropout=dropout, bias=False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{k: args[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")},
                          dropout=dropout)).train()  # fmt: skip
    model.use_fast_dropout(True)
    saved = saved_storages(model, torch.randint(32, (B, block_size)), dtype)
    # the scores' rows and keys are T or T / 2 >= 48 (autograd may keep them as (B * nh, rows, keys) views)
    scores = [t for t in saved.values() if t.dim() >= 3 and min(t.shape[-2:]) >= 48]
    kept = sum(t.untyped_storage().nbytes() for t in scores)
    bf16 = dtype == torch.bfloat16
    per_layer = saved_score_bytes(block_size, n_head, dropout, True, "cpu", bf16, compiled=False)
    assert kept == B * n_layer * per_layer
    assert (per_layer == 0) == (dropout == 0.0 and not bf16)
    assert saved_score_bytes(block_size, n_head, dropout, True, "cpu", bf16, compiled=True) == 0


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_with_the_scores_the_estimate_stays_below_what_a_bf16_forward_keeps(dropout):
    """A baby-shaped layer in bf16 on a CPU (attention's scores a large share of what is saved): the estimate, the
    scores included, is still at most what the forward keeps for backward (in float32 it counts the logits' float32
    copies of the step's backward, which this forward does not hold)."""
    args = {**GPTConfig().__dict__, **dict(n_layer=2, n_head=4, n_embd=32, block_size=128, vocab_size=65)}
    args.update(dropout=dropout, bias=False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=128, vocab_size=65, dropout=dropout)).train()
    model.use_fast_dropout(True)
    saved = saved_storages(model, torch.randint(65, (3, 128)), torch.bfloat16)
    scores = saved_score_bytes(128, 4, dropout, True, "cpu", True, compiled=False)
    head = head_loss_used("cpu", 65, True, 0.0)
    estimate = estimate_training_memory(args, 3, "bfloat16", head_loss=head, score_bytes=scores)
    assert 0 < 3 * 2 * scores < estimate.activations <= sum(t.untyped_storage().nbytes() for t in saved.values())

"""head_loss (the LM head's loss in row chunks, its gradient made in forward) against a float64 computation of
cross_entropy(softcap(x W^T)): loss and gradients, every reduction, unscored targets, chunks of any size; and the
model takes it only where it should, with the plain expression's loss. compiled_loss (the loss under torch.compile)
against the same float64 computation, and a compiled training forward against the plain one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gptforge.kernels import head_loss as head_loss_module
from gptforge.kernels.head_loss import compiled_loss, head_loss, head_loss_pays
from gptforge.model.gpt import GPT, GPTConfig


def reference(x, weight, targets, cap, reduction):
    """float64, written out."""
    logits = x.double() @ weight.double().t()
    if cap:
        logits = cap * torch.tanh(logits / cap)
    return F.cross_entropy(logits, targets, ignore_index=-1, reduction=reduction)


def inputs(N=37, C=16, V=1100, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, C, generator=gen, dtype=torch.float64) * 0.8
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::5] = -1  # not scored
    return x, weight, targets


@pytest.mark.parametrize("cap", [0.0, 15.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1 << 18, 3 * 1100, 1])  # one chunk; 3 rows (a partial last one); a row each
def test_head_loss_equals_float64_cross_entropy_with_its_gradients(cap, reduction, chunk, monkeypatch):
    monkeypatch.setattr(head_loss_module, "CHUNK_ELEMENTS", chunk)
    x64, w64, targets = inputs()
    x, weight = x64.float().requires_grad_(), w64.float().requires_grad_()
    loss = head_loss(x, weight, targets, cap, reduction)
    x64.requires_grad_(), w64.requires_grad_()
    expected = reference(x64, w64, targets, cap, reduction)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)
    (loss * 3.0).backward()
    (expected * 3.0).backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


def test_head_loss_in_bf16_is_within_bf16_rounding_of_float64():
    """Under autocast the product runs in bf16 (as the plain expression's does) and the rest in float32."""
    x64, w64, targets = inputs(N=64, C=32)
    x, weight = x64.float().requires_grad_(), w64.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head_loss(x, weight, targets, 30.0, "mean")
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    x64.requires_grad_(), w64.requires_grad_()
    expected = reference(x64, w64, targets, 30.0, "mean")
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-2, atol=0)
    for mine, theirs in ((x.grad, x64.grad), (weight.grad, w64.grad)):
        assert ((mine.double() - theirs).norm() / theirs.norm()).item() < 2e-2


def test_no_scored_target_gives_what_cross_entropy_gives():
    x64, w64, _ = inputs()
    none = torch.full((x64.size(0),), -1)
    x = x64.float().requires_grad_()
    total = head_loss(x, w64.float(), none, 15.0, "sum")
    assert total.item() == 0.0
    total.backward()
    assert torch.count_nonzero(x.grad) == 0
    assert math.isnan(head_loss(x64.float(), w64.float(), none, 15.0, "mean").item())
    assert math.isnan(F.cross_entropy(torch.zeros(3, 5), torch.full((3,), -1), ignore_index=-1).item())


def bpe_model(**kw) -> GPT:
    torch.manual_seed(0)
    shape = dict(block_size=16, vocab_size=1088, n_layer=2, n_head=2, n_embd=32, bias=False)
    return GPT(GPTConfig(**{**shape, **kw}))


@pytest.mark.parametrize(
    "switches, bf16, taken",
    [
        (dict(logit_softcap=15.0, rmsnorm=True, untie_head=True), False, True),  # the chat recipe, float32
        (dict(logit_softcap=15.0, rmsnorm=True, untie_head=True), True, True),
        ({}, True, True),  # GPT-2's shape in bf16, tied head
        ({}, False, False),  # nanoGPT's arithmetic: float32, no soft-cap
    ],
)
def test_training_takes_head_loss_only_where_it_pays_with_the_plain_loss(switches, bf16, taken, monkeypatch):
    model = bpe_model(**switches)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 1088, (3, 16), generator=gen)
    targets = idx.masked_fill(torch.rand(3, 16, generator=gen) < 0.2, -1)

    def run(need_logits: bool) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits, loss = model(idx, targets, need_logits=need_logits)
        loss.backward()
        return logits, loss.detach(), [p.grad.clone() for p in model.parameters()]

    logits, loss, grads = run(need_logits=False)
    assert (logits is None) == taken
    plain_logits, plain_loss, plain_grads = run(need_logits=True)
    assert plain_logits is not None and plain_logits.shape == (3, 16, 1088)
    tolerance = dict(rtol=2e-2, atol=1e-3) if bf16 else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, plain_loss, **tolerance)
    for mine, theirs in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(mine, theirs, **{**tolerance, "atol": tolerance["atol"] * 5})
    with torch.no_grad():  # evaluation: the plain expression
        assert model(idx, targets, need_logits=False)[0] is not None
    assert not head_loss_pays(torch.zeros(2, 4), 65, 15.0)  # a character vocabulary


def logits_inputs(N=41, V=1100, seed=3):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=gen, dtype=torch.float64) * 6.0
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::4] = -1  # not scored
    return logits, targets


def capped_reference(logits, targets, cap, reduction):
    """float64, written out: cross_entropy(cap * tanh(logits / cap)), targets of -1 not scored."""
    z = cap * torch.tanh(logits / cap) if cap else logits
    return F.cross_entropy(z, targets, ignore_index=-1, reduction=reduction)


@pytest.mark.parametrize("cap", [0.0, 15.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_compiled_loss_equals_float64_cross_entropy_with_its_gradient(cap, reduction):
    """CompiledLoss's own forward and backward (run eagerly here) against autograd through float64."""
    l64, targets = logits_inputs()
    logits = l64.float().requires_grad_()
    loss = compiled_loss(logits, targets, cap, reduction)
    l64.requires_grad_()
    expected = capped_reference(l64, targets, cap, reduction)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    (loss * 3.0).backward()
    (expected * 3.0).backward()
    torch.testing.assert_close(logits.grad.double(), l64.grad, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(logits.grad[::4]) == 0  # unscored rows get no gradient
    none = torch.full((l64.size(0),), -1)
    assert compiled_loss(l64.float(), none, cap, "sum").item() == 0.0
    assert math.isnan(compiled_loss(l64.float(), none, cap, "mean").item())  # as F.cross_entropy


# 15: the speedruns'; ONE_PASS_CAP, the largest whose log-sum-exp is summed with no max taken first; 89: e^89 is past
# float32, so a one-pass sum there is infinite
@pytest.mark.parametrize("cap", [15.0, head_loss_module.ONE_PASS_CAP, 89.0])
def test_the_compiled_loss_of_saturated_logits_is_finite_and_exact(cap):
    """Logits far past the soft-cap (every capped logit near +-cap, some rows' exp past float32): the loss and its
    gradient stay finite and equal float64, on both sides of the one-pass log-sum-exp's bound."""
    l64, targets = logits_inputs(V=4000)
    l64 = l64 * 1000.0
    logits = l64.float().requires_grad_()
    loss = compiled_loss(logits, targets, cap, "sum")
    assert torch.isfinite(loss)
    l64.requires_grad_()
    expected = capped_reference(l64, targets, cap, "sum")
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    loss.backward()
    expected.backward()
    assert torch.isfinite(logits.grad).all()
    torch.testing.assert_close(logits.grad.double(), l64.grad, rtol=1e-5, atol=1e-7)


def test_compiled_training_takes_the_compiled_loss_with_the_plain_loss_and_gradients():
    """Under torch.compile a training forward (need_logits=False) gives no logits (inductor does not write the
    capped (tokens, V) logits) and the loss and gradients of the plain expression; evaluation keeps the logits."""
    model = bpe_model(logit_softcap=15.0, rmsnorm=True, untie_head=True, rotary=True)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 1088, (3, 16), generator=gen)
    targets = idx.masked_fill(torch.rand(3, 16, generator=gen) < 0.2, -1)
    torch._dynamo.reset()  # no shapes remembered from an earlier test's compile: they would make T dynamic here
    compiled = torch.compile(model, fullgraph=True)

    def run(net, need_logits):
        model.zero_grad()
        logits, loss = net(idx, targets, need_logits=need_logits)
        loss.backward()
        return logits, loss.detach(), [p.grad.clone() for p in model.parameters()]

    logits, loss, grads = run(compiled, need_logits=False)
    assert logits is None
    plain_logits, plain_loss, plain_grads = run(model, need_logits=True)
    assert plain_logits is not None
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)

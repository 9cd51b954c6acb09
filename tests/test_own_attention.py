"""gptforge's own softmax attention (kernels/attention.py) against a float64 reference: with fast dropout's masks
(in query blocks, on q / k / v as the model makes them, with bool masks), without dropout in float32 and bf16, and
the compiled causal softmax with dropout against float64 and the torch operations' path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import loss_and_grads
from gptforge.kernels import attention as attn
from gptforge.kernels import dropout, masks, native
from gptforge.kernels.attention import attention
from gptforge.model.gpt import document_mask


def reference_attention(q, k, v, keep, p, allowed=None):
    """float64, written out: softmax(q k^T / sqrt(d)) over the allowed keys (default: causal), dropout by `keep`,
    times v."""
    q, k, v = q.double(), k.double(), v.double()
    T = q.size(-2)
    allowed = torch.ones(T, T, dtype=torch.bool).tril() if allowed is None else allowed
    att = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    att = att.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return (att * keep / (1 - p)) @ v


def assert_equals_reference(out, inputs, reference, gen, rtol=1e-5, atol=1e-5):
    """out (from inputs q, k, v) against reference(q64, k64, v64) in float64: values, and the gradients of a
    random output gradient."""
    doubles = [t.detach().double().requires_grad_() for t in inputs]
    ref = reference(*doubles)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    for mine, theirs in zip(inputs, doubles, strict=True):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=rtol, atol=atol)


def recorded_masks(monkeypatch) -> list[torch.Tensor]:
    """Every mask drawn from now on, in order: by keep_mask, or inside attention's compiled causal softmax."""
    drawn: list[torch.Tensor] = []
    real = masks.keep_mask
    for module in (attn, dropout):  # attention's masks and Dropout's
        monkeypatch.setattr(module, "keep_mask", lambda like, p: drawn.append(real(like, p)) or drawn[-1])
    softmax = attn._causal_softmax

    def recording(*args):  # noqa: ANN002, ANN202
        probs, att, keep = softmax(*args)
        if keep is not None:
            drawn.append(keep)
        return probs, att, keep

    monkeypatch.setattr(attn, "_causal_softmax", recording)
    return drawn


def whole_mask(drawn: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The query blocks' masks as one (B, nh, T, T) mask: each block's rows over the keys it was scored against
    (the keys after those are the future: probability 0 whatever the mask says)."""
    keep = torch.ones(shape, dtype=torch.bool)
    row = 0
    for mask in drawn:
        t, s = mask.shape[-2:]
        keep[..., row : row + t, :s] = mask
        row += t
    assert row == shape[-2]
    return keep


@pytest.mark.parametrize("T, blocks", [(17, 1), (128, attn.QUERY_BLOCKS), (128, 4)])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "heads-transposed"])
def test_attention_with_fast_dropout_matches_a_float64_reference(T, blocks, strided, monkeypatch):
    """Also in query blocks (T >= 128): each block scored against the keys up to its end only; q, k, v as the
    model makes them too ((B, T, nh, hs) transposed: not contiguous)."""
    monkeypatch.setattr(attn, "QUERY_BLOCKS", blocks if blocks > 1 else attn.QUERY_BLOCKS)
    p = 0.2
    gen = torch.Generator().manual_seed(0)
    if strided:
        q, k, v = (torch.randn(2, T, 3, 8, generator=gen).requires_grad_().transpose(1, 2) for _ in range(3))
        for x in (q, k, v):
            x.retain_grad()
    else:
        q, k, v = (torch.randn(2, 3, T, 8, generator=gen).requires_grad_() for _ in range(3))
    drawn = recorded_masks(monkeypatch)
    out = attention(q, k, v, p)
    assert len(drawn) == blocks
    keep = whole_mask(drawn, torch.Size([2, 3, T, T]))
    assert_equals_reference(out, (q, k, v), lambda *qkv: reference_attention(*qkv, keep, p), gen)


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_causal_softmax_matches_float64_and_the_torch_path(dtype, p, monkeypatch):
    """Attention's query blocks with dropout take cpu_kernels.c's causal softmax where it compiled (one pass over each
    row forward, one backward; its split across threads: test_native_threads.py): from the same
    generator state the same masks as the torch operations' path, and values and gradients as close to float64's
    as that path's (float32: 1e-5; bf16: its rounding). Without dropout torch's softmax stays."""
    assert native.native_kernels() is not None  # CI has a C compiler: the compiled path must be what runs there
    gen = torch.Generator().manual_seed(7)
    T = 256  # two query blocks: 128 rows over 128 keys, 128 over 256
    base = [torch.randn(2, 3, T, 16, generator=gen) for _ in range(3)]
    grad = torch.randn(2, 3, T, 16, generator=gen, dtype=torch.float64)
    kernel_calls: list[int] = []
    real = attn._causal_softmax
    results = {}
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setattr(attn, "_softmax_kernels", lambda q, p: None)
        monkeypatch.setattr(attn, "_causal_softmax", lambda *a: kernel_calls.append(1) or real(*a))
        drawn = recorded_masks(monkeypatch)
        q, k, v = (x.to(dtype).clone().requires_grad_() for x in base)  # leaves of their own: their own grads
        before = len(kernel_calls)
        torch.manual_seed(11)
        out = attention(q, k, v, p)
        out.backward(grad.to(dtype))
        results[path] = (out, [x.grad for x in (q, k, v)], drawn)
        assert len(kernel_calls) - before == (2 if path != "torch" and p else 0)  # one a query block, with dropout
    monkeypatch.undo()
    assert len(results["kernel"][2]) == len(results["torch"][2]) == (2 if p else 0)
    for mine, theirs in zip(results["kernel"][2], results["torch"][2], strict=True):
        assert torch.equal(mine, theirs)
    keep = whole_mask(results["torch"][2], torch.Size([2, 3, T, T])) if p else torch.ones(T, T, dtype=torch.bool)
    doubles = [x.to(dtype).double().requires_grad_() for x in base]  # the inputs both paths saw
    want = reference_attention(*doubles, keep, p)
    want.backward(grad)
    want_grads = [x.grad for x in doubles]
    errors = {
        path: [(out.double() - want).abs().max().item()]
        + [(g.double() - w).abs().max().item() for g, w in zip(grads, want_grads, strict=True)]
        for path, (out, grads, _) in results.items()
    }
    bound = 1e-5 if dtype == torch.float32 else 3e-2
    for mine, theirs in zip(errors["kernel"], errors["torch"], strict=True):
        assert mine <= bound and mine <= 1.5 * theirs + (1e-6 if dtype == torch.float32 else 2**-8), errors


def rule(kind: str, B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """A bool attention mask: packed documents' (causal, positions restarting at random starts) or keys'
    (padding: each row's first keys hidden from every query, future keys visible)."""
    if kind == "documents":
        starts = torch.rand(B, T, generator=gen) < 0.05
        last_start = torch.cummax(torch.where(starts, torch.arange(T), 0), dim=1)[0]
        return document_mask(torch.arange(T) - last_start)  # (B, 1, T, T)
    pads = torch.randint(0, T // 2, (B,), generator=gen)
    return (torch.arange(T) >= pads[:, None])[:, None, None, :]  # (B, 1, 1, T)


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("kind, blocks", [("documents", 2), ("keys", 1)])
def test_attention_with_a_mask_matches_a_float64_reference(kind, blocks, p, monkeypatch):
    """A causal mask (packed documents) goes in query blocks, any other in one; values and gradients."""
    gen = torch.Generator().manual_seed(4)
    T = 128
    q, k, v = (torch.randn(2, 3, T, 8, generator=gen).requires_grad_() for _ in range(3))
    allowed = rule(kind, 2, T, gen)
    drawn = recorded_masks(monkeypatch)
    out = attention(q, k, v, p, allowed)
    assert len(drawn) == (blocks if p else 0)
    keep = whole_mask(drawn, torch.Size([2, 3, T, T])) if p else torch.ones(T, T, dtype=torch.bool)
    allowed = allowed.expand(2, 1, T, T)
    assert_equals_reference(out, (q, k, v), lambda *qkv: reference_attention(*qkv, keep, p, allowed), gen)


@pytest.mark.parametrize("T", [16, 128])
def test_attention_keeping_everything_is_sdpa(T):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, T, 8, generator=gen) for _ in range(3))
    out = attention(q, k, v, 1e-9)  # rounds to a threshold of 0 in 65536: nothing dropped
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [17, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_without_dropout_matches_a_float64_reference(T, dtype, monkeypatch):
    """p = 0 (in one block below T 128, in QUERY_BLOCKS from there): no masks drawn, values and gradients equal
    the float64 causal softmax attention, to float32 precision and, under bf16 autocast (the training case that
    takes this path), to bf16's (SDPA's own bf16 kernel is ~1e-2 off the float64 values here too)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, T, 16, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    drawn = recorded_masks(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = attention(q, k, v, 0.0)
    assert not drawn and out.dtype == dtype
    keep = torch.ones(T, T, dtype=torch.bool)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-6, atol=3e-2)
    assert_equals_reference(out, (q, k, v), lambda *qkv: reference_attention(*qkv, keep, 0.0), gen, **tolerance)


def test_split_heads_gives_the_projections_head_views_and_their_gradient():
    """split_heads: q, k, v equal to split + view + transpose of the projection (B, T, 3 C), contiguous, and the
    projection's gradient equal to autograd's through those views (copies only: bit for bit)."""
    gen = torch.Generator().manual_seed(0)
    B, T, nh, hs = 2, 6, 3, 4
    qkv = torch.randn(B, T, 3 * nh * hs, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    views = [t.view(B, T, nh, hs).transpose(1, 2) for t in qkv.split(nh * hs, dim=2)]
    heads = attn.split_heads(qkv, nh)
    grads = [torch.randn(B, nh, T, hs, generator=gen, dtype=torch.bfloat16) for _ in range(3)]
    for mine, theirs in zip(heads, views, strict=True):
        assert mine.is_contiguous() and torch.equal(mine, theirs)
    (want,) = torch.autograd.grad(views, qkv, grads)
    (got,) = torch.autograd.grad(heads, qkv, grads)
    assert torch.equal(got, want)
    (v_only,) = torch.autograd.grad(attn.split_heads(qkv, nh)[2], qkv, grads[2])  # q and k without a gradient
    assert torch.equal(v_only[..., : 2 * nh * hs], torch.zeros(B, T, 2 * nh * hs, dtype=torch.bfloat16))
    assert torch.equal(v_only[..., 2 * nh * hs :], grads[2].transpose(1, 2).reshape(B, T, nh * hs))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_model_splits_heads_once_for_the_own_attention_with_the_same_result(dropout, monkeypatch):
    """In bf16 CPU training on the own attention's query blocks (no rotary, no QK-norm), the model splits the
    projection into heads with split_heads: loss and every gradient equal, bit for bit, to the head views it took
    before (attention copied them), with dropout's masks from the same seed."""
    from gptforge.model import gpt as gpt_module

    calls, real = [], attn.split_heads
    monkeypatch.setattr(attn, "split_heads", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    config = gpt_module.GPTConfig(block_size=128, vocab_size=37, n_layer=2, n_head=4, n_embd=32, dropout=dropout)
    model = gpt_module.GPT(config)
    model.use_fast_dropout(True)
    idx = torch.randint(0, 37, (2, 128), generator=torch.Generator().manual_seed(1))

    split_loss, split_grads = loss_and_grads(model, idx, seed=2)
    assert len(calls) == 2  # both layers
    views = lambda qkv, nh: [t.view(*t.shape[:2], nh, -1).transpose(1, 2) for t in qkv.chunk(3, -1)]  # noqa: E731
    monkeypatch.setattr(attn, "split_heads", views)
    view_loss, view_grads = loss_and_grads(model, idx, seed=2)
    assert torch.equal(split_loss, view_loss)
    for mine, theirs in zip(split_grads.values(), view_grads.values(), strict=True):
        assert torch.equal(mine, theirs)

"""fast_dropout: keep_mask's draws are Bernoulli(1 - p) at every position, the fast dropout equals a float64
reference on the same mask (outputs and gradients; attention's: test_own_attention.py), bf16 CPU training at
dropout 0 takes the own attention, and switched off the model is torch's dropout, draw for draw."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from conftest import loss_and_grads
from gptforge.kernels import attention as attn
from gptforge.kernels import masks, native
from gptforge.kernels import reference as mask_reference
from gptforge.kernels.masks import keep_mask
from gptforge.model.cache import evaluating
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.modules import Dropout


@pytest.fixture(params=["kernel", "reference"])
def mask_path(request, monkeypatch):
    """keep_mask by the compiled kernel, and as it runs where no C compiler is found (the torch reference)."""
    if request.param == "reference":
        monkeypatch.setattr(native, "_kernel", [None])
    elif native.native_kernel() is None:
        pytest.skip("no compiled kernel here")


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_keep_mask_keeps_one_minus_p_at_every_position(p, mask_path):
    torch.manual_seed(0)
    n = 1 << 22
    mask = keep_mask(torch.empty(n // 64, 64), p)
    assert mask.dtype == torch.bool and mask.shape == (n // 64, 64)
    tolerance = 5 * math.sqrt(p * (1 - p) / (n / 4))  # five binomial standard deviations of a quarter of it
    # each 64-bit draw gives four 16-bit values: all four lanes must be unbiased (a draw with its top bit
    # always clear would bias the fourth)
    lanes = mask.reshape(-1, 4).float().mean(dim=0)
    assert (lanes - (1 - p)).abs().max() < tolerance, lanes
    # neighbours independent: P(both kept) = (1 - p)^2
    pairs = (mask[:, :-1] & mask[:, 1:]).float().mean()
    assert abs(pairs - (1 - p) ** 2) < 2 * tolerance


@pytest.mark.parametrize("shape", [torch.Size([8, 1000]), torch.Size([4, 6, 128, 128])], ids=["small", "large"])
def test_keep_mask_follows_torchs_seed(shape, mask_path):
    """A mask's seed comes from torch's generator: torch's seed and saved state decide the mask, and the next mask
    is another one."""
    torch.manual_seed(3)
    a = keep_mask(torch.empty(shape), 0.2)
    torch.manual_seed(3)
    b = keep_mask(torch.empty(shape), 0.2)
    state = torch.get_rng_state()
    c = keep_mask(torch.empty(shape), 0.2)
    torch.set_rng_state(state)  # what a resumed run does
    d = keep_mask(torch.empty(shape), 0.2)
    assert torch.equal(a, b) and not torch.equal(b, c) and torch.equal(c, d)
    # successive masks are independent: P(kept in both) = (1 - p)^2
    both = (b & c).float().mean().item()
    assert abs(both - 0.8**2) < 5 * math.sqrt(0.64 * 0.36 / b.numel())


def test_mask_words_are_splitmix64():
    """The torch arithmetic (wrapping int64 products, logical shifts) gives SplitMix64's published outputs for
    seed 0: 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f."""
    published = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    words = mask_reference.splitmix_words(0, 0, 3).tolist()
    assert [w & ((1 << 64) - 1) for w in words] == published
    assert (
        mask_reference.splitmix_words(0, 1, 2).tolist() == words[1:]
    )  # word j does not depend on where a slice starts


def test_the_compiled_kernel_is_built_where_a_compiler_is():
    """On a machine with a C compiler (CI's) the masks come from cpu_kernels.c, never silently from the fallback."""
    if not native.c_compiler():
        pytest.skip("no C compiler here")
    assert native.native_kernel() is not None


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 1031, 4096, (1 << 18) + 7])
@pytest.mark.parametrize("p", [0.0, 1 / 65536, 0.05, 0.5, 0.99])
def test_compiled_kernel_equals_the_torch_reference(n, p):
    kernel = native.native_kernel()
    if kernel is None:
        pytest.skip("no compiled kernel here: the reference draws every mask")
    threshold = round(p * 65536) - 32768
    for seed in (0, 12345, 2**63 - 2):
        ours, reference = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.bool)
        kernel(ours.data_ptr(), n, seed, threshold)
        mask_reference.reference_keep(reference, seed, threshold)
        assert torch.equal(ours, reference), (n, p, seed)
    if p == 0.0:
        assert bool(ours.all())


def test_the_fallback_draws_the_kernels_masks(monkeypatch):
    """Where the kernel is missing, the same seeds give the same masks (resumes agree across the two paths), in
    chunks of REFERENCE_WORDS words."""
    monkeypatch.setattr(mask_reference, "REFERENCE_WORDS", 1000)  # a mask over several chunks, one of them ragged
    shape = torch.Size([3, 2050])
    torch.manual_seed(5)
    first = keep_mask(torch.empty(shape), 0.3)
    monkeypatch.setattr(native, "_kernel", [None])
    torch.manual_seed(5)
    assert torch.equal(keep_mask(torch.empty(shape), 0.3), first)


def test_a_compiler_that_fails_says_so_and_falls_back(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_kernel", [])
    assert native.native_kernel() is None
    said = capsys.readouterr().err
    assert "compiled CPU kernels: the compiled kernel could not be built or loaded" in said
    assert "dropout masks drawn and RMSNorm computed by torch operations" in said
    torch.manual_seed(1)
    mask = keep_mask(torch.empty(4000), 0.5)
    assert 0.4 < mask.float().mean().item() < 0.6
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind


def test_switched_off_the_kernel_is_not_built(monkeypatch, capsys):
    monkeypatch.setenv(native.SWITCH, "0")
    monkeypatch.setattr(native, "_kernel", [])
    assert native.native_kernel() is None
    assert "compiled CPU kernels" not in capsys.readouterr().err  # asked for: nothing to warn about


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_as_ones_is_the_masks_conversion(dtype):
    keep = torch.rand(3, 1001, generator=torch.Generator().manual_seed(0)) < 0.6
    ones = mask_reference.as_ones(keep, dtype)
    assert ones.dtype == dtype and torch.equal(ones, keep.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 1 / 0.8, 1 / 0.95])
def test_apply_mask_is_torchs_products_bit_for_bit(dtype, scale, mask_path):
    """x times the mask, then the scale rounded once: the kernel's one pass (bf16, float32) gives the bits of
    torch's products (the reference: float64 arithmetic rounded once to the dtype), signed zeros and a dropped
    infinity's NaN included; in place too; a strided x takes torch's products."""
    values = torch.cat(
        [torch.tensor(mask_reference.SPECIAL * 3), torch.randn(5003, generator=torch.Generator().manual_seed(4))]
    )
    x = values.to(dtype)
    keep = torch.rand(values.shape, generator=torch.Generator().manual_seed(5)) < 0.7
    special = 3 * len(mask_reference.SPECIAL)
    keep[:special] = torch.arange(special) % 3 != 1  # every special value kept and dropped
    expected = (x.double() * keep.double() * torch.tensor(scale, dtype=torch.float32).double()).to(dtype)
    assert mask_reference.same_bits(masks.apply_mask(x, keep, scale), expected)
    inplace = x.clone()
    assert masks.apply_mask(inplace, keep, scale, out=inplace) is inplace and mask_reference.same_bits(
        inplace, expected
    )
    wide = torch.stack([x, x], dim=1)[:, 0]  # every other element: not contiguous
    assert not wide.is_contiguous() and mask_reference.same_bits(masks.apply_mask(wide, keep, scale), expected)


def test_fast_dropout_in_bf16_rounds_like_torchs_dropout():
    """The same rule in bfloat16: x kept or 0, times 1 / (1 - p) computed in float and rounded once."""
    p = 0.05
    layer = Dropout(p)
    layer.fast_dropout = True
    x = torch.randn(16, 4096, generator=torch.Generator().manual_seed(2)).bfloat16().requires_grad_()
    torch.manual_seed(1)
    y = layer(x)
    torch.manual_seed(1)
    keep = keep_mask(x, p)
    assert torch.equal(y, (x.detach().float() * keep / (1 - p)).bfloat16())
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    y.backward(grad)
    assert torch.equal(x.grad, (grad.float() * keep / (1 - p)).bfloat16())


def test_fast_dropout_is_the_dropout_rule_on_its_mask_with_gradients():
    p = 0.3
    layer = Dropout(p)
    layer.fast_dropout = True
    x = torch.randn(64, 33, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(1)
    y = layer(x)
    torch.manual_seed(1)
    keep = keep_mask(x, p)
    expected = torch.where(keep, x.detach() / (1 - p), 0.0)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=0)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, keep.double() / (1 - p), rtol=1e-12, atol=0)
    layer.eval()
    assert torch.equal(layer(x), x)


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed documents"])
def test_bf16_cpu_training_at_dropout_0_takes_the_own_attention(monkeypatch, packed):
    """Only there (bf16, T <= OWN_ATTENTION_MAX_T), causal or with packed documents' mask (SFT's batches): the
    model's loss and gradients then equal the SDPA path's within bf16 rounding, and so does an evaluation's loss
    (no gradients), which takes it too except on a CPU with AMX; float32 and longer sequences keep SDPA."""
    monkeypatch.setattr(attn, "cpu_has_amx", lambda: False)  # a CPU without AMX; with it below
    calls = []
    real = attn.attention
    monkeypatch.setattr(attn, "attention", lambda *a: calls.append(1) or real(*a))
    pays = attn.own_attention_pays
    model = tiny_model(dropout=0.0)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 37, (3, 16), generator=gen)
    positions = torch.tensor([list(range(16)), list(range(5)) + list(range(11)), list(range(9)) + list(range(7))])

    def attended(own: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        monkeypatch.setattr(attn, "own_attention_pays", pays if own else lambda q: False)
        return loss_and_grads(model, idx, positions=positions if packed else None)

    own_loss, own_grads = attended(own=True)
    assert len(calls) == 2  # both layers
    sdpa_loss, sdpa_grads = attended(own=False)
    assert len(calls) == 2
    torch.testing.assert_close(own_loss, sdpa_loss, rtol=1e-2, atol=0)
    for mine, theirs in zip(own_grads.values(), sdpa_grads.values(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0.05, atol=2e-3)
    evaluations = []
    for own in (True, False):
        monkeypatch.setattr(attn, "own_attention_pays", pays if own else lambda q: False)
        with torch.no_grad(), evaluating(model), torch.autocast("cpu", dtype=torch.bfloat16):
            evaluations.append(model(idx, idx, positions=positions if packed else None)[1])
    assert len(calls) == 4  # the evaluation took it too
    monkeypatch.setattr(attn, "own_attention_pays", pays)
    torch.testing.assert_close(evaluations[0], evaluations[1], rtol=1e-2, atol=0)
    torch.testing.assert_close(evaluations[0], own_loss, rtol=1e-2, atol=0)  # no dropout: training's loss
    q = torch.zeros(1, 1, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    assert attn.own_attention_pays(q) and attn.own_attention_pays(q.detach())
    assert not attn.own_attention_pays(q.float())
    assert not attn.own_attention_pays(torch.zeros(1, 1, attn.OWN_ATTENTION_MAX_T + 1, 8, dtype=torch.bfloat16))
    monkeypatch.setattr(attn, "cpu_has_amx", lambda: True)  # with AMX: SDPA's fused forward without gradients
    assert attn.own_attention_pays(q) and not attn.own_attention_pays(q.detach())
    with torch.no_grad(), evaluating(model), torch.autocast("cpu", dtype=torch.bfloat16):
        amx_evaluation = model(idx, idx, positions=positions if packed else None)[1]
    assert len(calls) == 4  # SDPA's
    torch.testing.assert_close(amx_evaluation, evaluations[0], rtol=1e-2, atol=0)
    attended(own=True)
    assert len(calls) == 6  # training still takes the own attention


def tiny_model(dropout: float) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=2, n_head=4, n_embd=32, dropout=dropout, bias=False))


def test_switched_off_the_model_draws_torchs_dropout_exactly():
    """fast_dropout=False: every mask from torch's own dropout (nn.Dropout and SDPA's dropout_p), so nanoGPT's
    losses with dropout > 0 stay reachable; on, other draws with the same train-mode expectation."""
    idx = torch.randint(0, 37, (4, 16), generator=torch.Generator().manual_seed(2))
    ours = tiny_model(0.2)
    reference = tiny_model(0.2)
    for name, module in list(reference.named_modules()):
        if isinstance(module, Dropout):  # plain torch modules, as nanoGPT builds them
            parent = reference.get_submodule(name.rsplit(".", 1)[0]) if "." in name else reference
            setattr(parent, name.rsplit(".", 1)[-1], torch.nn.Dropout(module.p))
    losses = []
    for model in (ours, reference):
        torch.manual_seed(9)
        loss = model(idx, idx)[1]
        loss.backward()
        losses.append((loss.item(), model.lm_head.weight.grad.clone()))
    assert losses[0][0] == losses[1][0] and torch.equal(losses[0][1], losses[1][1])
    ours.use_fast_dropout(True)
    torch.manual_seed(9)
    assert ours(idx, idx)[1].item() != losses[0][0]  # other random numbers
    ours.eval()
    reference.eval()
    assert torch.equal(ours(idx, idx)[0], reference(idx, idx)[0])  # and no dropout at all in eval mode


def test_training_with_fast_dropout_learns_like_torchs_dropout():
    """Same data, same initial weights: 150 steps with either mask reach the same eval loss within noise."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 37, (37,), generator=gen)  # a learnable rule: next token = table[token]
    x = torch.randint(0, 37, (256, 16), generator=gen)
    y = table[x]
    final = []
    for fast in (False, True):
        model = tiny_model(0.2)
        model.use_fast_dropout(fast)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        torch.manual_seed(4)
        for step in range(150):
            rows = slice(step % 16 * 16, step % 16 * 16 + 16)
            model(x[rows], y[rows])[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            final.append(model(x, y)[1].item())
    assert final[0] < 1.0 and abs(final[0] - final[1]) < 0.1, final


def test_compiled_model_draws_every_mask_as_eager_does(monkeypatch):
    """Under torch.compile each dropout is its own gptforge::keep_mask call (the compiler merges identical calls
    of an operation it takes for pure: masks of one shape were one mask before they took their tensor), drawn
    from torch's generator as in eager mode: the same seed gives eager's loss and gradients."""
    drawn = []
    real = masks.mask_seed
    monkeypatch.setattr(masks, "mask_seed", lambda: drawn.append(1) or real())
    model = tiny_model(0.5)
    model.use_fast_dropout(True)
    idx = torch.randint(0, 37, (4, 16), generator=torch.Generator().manual_seed(2))
    results = []
    for step in (model, torch.compile(model)):
        drawn.clear()
        torch.manual_seed(7)
        loss = step(idx, idx)[1]
        loss.backward()
        results.append((loss.item(), model.lm_head.weight.grad.clone(), len(drawn)))
        model.zero_grad(set_to_none=True)
    (eager_loss, eager_grad, eager_draws), (compiled_loss, compiled_grad, compiled_draws) = results
    assert eager_draws == compiled_draws == 1 + 2 * 3  # the embeddings; in each of 2 blocks attention, its output, MLP
    assert compiled_loss == pytest.approx(eager_loss, abs=1e-5)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-5)


def test_compiling_the_model_with_fast_dropout_breaks_no_graph():
    """Under torch.compile the masks are the gptforge::keep_mask operation and their application torch's products
    (the compiled kernel's ctypes call cannot be traced: it split the graph in three)."""
    import torch._dynamo

    model = tiny_model(0.3)
    model.use_fast_dropout(True)
    idx = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
    explained = torch._dynamo.explain(model)(idx, idx)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons

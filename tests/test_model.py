"""The GPT model: shapes, causality, initial loss, init, parameter counts, and a float64 reference forward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gptforge.infer.engine import generate
from gptforge.model.cache import evaluating
from gptforge.model.gpt import GPT, GPTConfig


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(block_size=16, vocab_size=37, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg))


def test_forward_shapes_with_and_without_targets():
    model = tiny()
    idx = torch.randint(0, 37, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 37)
    assert loss.shape == () and torch.isfinite(loss)
    logits, loss = model(idx)
    assert logits.shape == (3, 1, 37) and loss is None
    # the last-position shortcut equals the full projection's last row
    full, _ = model(idx, idx)
    torch.testing.assert_close(logits[:, 0], full[:, -1])


def test_sequence_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        tiny()(torch.zeros(1, 17, dtype=torch.long))


def test_causality_changing_token_t_leaves_earlier_logits_unchanged():
    model = tiny().eval()
    idx = torch.randint(0, 37, (2, 16))
    before, _ = model(idx, idx)
    for t in (0, 7, 15):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 37
        after, _ = model(changed, changed)
        torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(after[:, t], before[:, t]), "token t must affect its own position"


def test_initial_loss_is_close_to_ln_vocab():
    torch.manual_seed(1)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, bias=False))
    idx = torch.randint(0, 65, (32, 64))
    _, loss = model(idx, torch.randint(0, 65, (32, 64)))
    # Logits at init have std ~0.02 * sqrt(n_embd) = 0.23, which adds ~0.23**2 / 2 = 0.03 to ln(65) = 4.17.
    assert abs(loss.item() - math.log(65)) < 0.1, loss.item()


def test_init_statistics_and_weight_tying():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=512, n_layer=8, n_head=4, n_embd=256, bias=True))
    assert model.lm_head.weight is model.transformer.wte.weight
    h0 = model.transformer.h[0]
    assert abs(h0.mlp.c_fc.weight.std().item() - 0.02) < 0.001
    expected = 0.02 / math.sqrt(2 * 8)
    assert abs(h0.attn.c_proj.weight.std().item() - expected) < 0.0005
    assert abs(h0.mlp.c_proj.weight.std().item() - expected) < 0.0005
    assert torch.count_nonzero(h0.attn.c_attn.bias) == 0 and torch.count_nonzero(h0.mlp.c_fc.bias) == 0
    assert torch.all(h0.ln_1.weight == 1)


def test_parameter_count_matches_formula():
    V, T, L, C = 37, 16, 2, 32
    model = tiny()
    per_block = (2 * 2 * C) + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    total = V * C + T * C + L * per_block + 2 * C  # wte (tied with lm_head) + wpe + blocks + ln_f
    assert model.get_num_params(non_embedding=False) == total
    assert model.get_num_params() == total - T * C
    assert tiny(bias=False).get_num_params(non_embedding=False) < total


def test_names_follow_gpt2():
    names = set(tiny().state_dict())
    for key in [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.ln_1.weight",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_proj.bias",
        "transformer.h.1.mlp.c_fc.weight",
        "transformer.h.1.mlp.c_proj.weight",
        "transformer.ln_f.bias",
        "lm_head.weight",
    ]:
        assert key in names


def reference_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """GPT-2's forward written out in float64 with an explicit masked softmax: the independent reference."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    cfg = model.config
    B, T = idx.shape
    C, nh = cfg.n_embd, cfg.n_head

    def ln(x, p):
        return F.layer_norm(x, (C,), sd[p + ".weight"], sd.get(p + ".bias"), eps=1e-5)

    def lin(x, p):
        return x @ sd[p + ".weight"].T + sd.get(p + ".bias", 0)

    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}"
        q, k, v = lin(ln(x, p + ".ln_1"), p + ".attn.c_attn").split(C, dim=2)
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // nh)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + lin(y, p + ".attn.c_proj")
        h = lin(ln(x, p + ".ln_2"), p + ".mlp.c_fc")
        if cfg.gelu == "tanh":  # GPT-2's GELU
            h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        else:  # the exact GELU (nanoGPT's)
            h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        x = x + lin(h, p + ".mlp.c_proj")
    return ln(x, "transformer.ln_f") @ sd["lm_head.weight"].T


@pytest.mark.parametrize("bias,gelu", [(True, "erf"), (False, "erf"), (True, "tanh")])
def test_forward_matches_float64_reference(bias, gelu):
    model = tiny(bias=bias, gelu=gelu).eval()
    with torch.no_grad():  # give LayerNorms and biases non-trivial values so every term is checked
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    idx = torch.randint(0, 37, (2, 16))
    logits, _ = model(idx, idx)
    ref = reference_forward(model, idx)
    torch.testing.assert_close(logits.double(), ref, rtol=0, atol=1e-4)
    loss_ref = F.cross_entropy(ref.view(-1, 37), idx.view(-1))
    assert abs(model(idx, idx)[1].item() - loss_ref.item()) < 1e-5


def test_dropout_is_active_in_train_mode_only():
    model = tiny(dropout=0.5)
    idx = torch.randint(0, 37, (2, 16))
    model.train()
    a, _ = model(idx, idx)
    b, _ = model(idx, idx)
    assert not torch.allclose(a, b)
    model.eval()
    c, _ = model(idx, idx)
    d, _ = model(idx, idx)
    torch.testing.assert_close(c, d)


def test_crop_block_size():
    model = tiny()
    wpe = model.transformer.wpe.weight[:8].detach().clone()
    model.crop_block_size(8)
    assert model.config.block_size == 8 and model.transformer.wpe.weight.shape == (8, 32)
    torch.testing.assert_close(model.transformer.wpe.weight.detach(), wpe)
    logits, _ = model(torch.zeros(1, 8, dtype=torch.long))
    assert logits.shape == (1, 1, 37)


def test_generate_shapes_context_crop_and_seeded_determinism():
    model = tiny().eval()
    idx = torch.randint(0, 37, (2, 5))
    out = generate(model, idx, 30, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
    assert out.shape == (2, 35) and torch.equal(out[:, :5], idx)  # 35 > block_size 16: context was cropped
    again = generate(model, idx, 30, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(out, again)


def test_generate_greedy_and_top_k_1_agree_with_argmax():
    model = tiny().eval()
    idx = torch.randint(0, 37, (1, 4))
    greedy = generate(model, idx, 6, temperature=0)
    top1 = generate(model, idx, 6, temperature=1.0, top_k=1)
    assert torch.equal(greedy, top1)
    logits, _ = model(idx)
    assert greedy[0, 4].item() == logits[0, -1].argmax().item()


def test_estimate_mfu_matches_flop_formula():
    model = tiny()
    N = model.get_num_params()
    per_token = 6 * N + 12 * 2 * 4 * 8 * 16
    assert model.flops_per_token() == per_token
    # 10 sequences of 16 tokens in 0.5 s against a 1 GFLOP/s peak
    assert model.estimate_mfu(10, 0.5, 1e9) == pytest.approx(per_token * 16 * 10 / 0.5 / 1e9)


@pytest.mark.parametrize("window", ["slide", "half"])
@pytest.mark.parametrize("prompt_len, new", [(3, 10), (5, 30), (16, 5), (20, 4)])  # 30 > block_size 16
def test_cached_and_uncached_generation_give_identical_tokens(prompt_len, new, window):
    model = tiny().eval()
    idx = torch.randint(0, 37, (3, prompt_len))
    greedy = [generate(model, idx, new, temperature=0, use_cache=c, window=window) for c in (True, False)]
    assert torch.equal(greedy[0], greedy[1])
    seeded = [
        generate(model, idx, new, 1.0, 10, generator=torch.Generator().manual_seed(5), use_cache=c, window=window)
        for c in (True, False)
    ]
    assert torch.equal(seeded[0], seeded[1])
    assert seeded[0].shape == (3, prompt_len + new)


def test_kv_cache_steps_match_the_full_forward():
    from gptforge.model.gpt import KVCache

    model = tiny().eval()
    idx = torch.randint(0, 37, (2, 12))
    full, _ = model(idx, idx)  # (B, T, V) for every position
    cache = KVCache(model.config.n_layer, model.config.block_size)
    logits, _ = model(idx[:, :7], cache=cache)  # prefill 7 tokens
    torch.testing.assert_close(logits[:, -1], full[:, 6], rtol=0, atol=1e-5)
    for t in range(7, 12):  # then one token at a time
        logits, _ = model(idx[:, t : t + 1], cache=cache)
        torch.testing.assert_close(logits[:, -1], full[:, t], rtol=0, atol=1e-5)
    assert cache.length == 12


def test_top_p_and_stop_token():
    from gptforge.infer.engine import sample_next

    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])  # probabilities ~0.72, 0.26, 0.013, 0.005
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, top_p=0.5, generator=g).item() for _ in range(200)}
    assert draws == {0}  # the likeliest token alone holds more than p
    draws = {sample_next(logits, 1.0, top_p=0.95, generator=g).item() for _ in range(500)}
    assert draws == {0, 1}  # 0.72 + 0.26 > 0.95: the tail is cut
    draws = {sample_next(logits, 1.0, generator=g).item() for _ in range(3000)}
    assert draws == {0, 1, 2, 3}

    model = tiny().eval()
    idx = torch.randint(0, 37, (2, 3))
    first = generate(model, idx, 1, temperature=0)[:, -1]  # each row's greedy next token
    out = generate(model, idx, 20, temperature=0, stop_token=int(first[0]))
    assert out[0, 3].item() == first[0].item()  # row 0 stops at once ...
    assert (out[0, 3:] == first[0]).all()  # ... and is padded with the stop token
    alone = generate(model, idx[:1], 20, temperature=0, stop_token=int(first[0]))
    assert alone.shape == (1, 4)  # every row has stopped: generation ends early


def test_generation_leaves_the_global_rng_alone():
    model = tiny().eval()
    torch.manual_seed(9)
    expected = torch.rand(3)
    torch.manual_seed(9)
    generate(model, torch.zeros(1, 2, dtype=torch.long), 5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.rand(3), expected)


def test_model_vocab_size_pads_gpt2_bpe_only():
    from gptforge.core.shape import model_vocab_size

    assert model_vocab_size({"vocab_size": 50257, "tokenizer": "gpt2"}) == 50304
    assert model_vocab_size({"vocab_size": 50304, "tokenizer": "gpt2"}) == 50304
    assert model_vocab_size({"vocab_size": 65, "tokenizer": "char"}) == 65


@pytest.mark.parametrize("training", [True, False])
def test_evaluating_gives_eval_mode_and_restores_the_mode_even_on_an_error(training):
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=8, dropout=0.5)).train(training)
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert all(m.training == training for m in model.modules())
    with pytest.raises(RuntimeError), evaluating(model):
        raise RuntimeError("an evaluation failing half-way")
    assert all(m.training == training for m in model.modules())


def test_a_whole_graph_compile_with_symbolic_lengths_gives_eagers_logits():
    """torch.compile(fullgraph=True, dynamic=True) traces T as a symbol: the attention's causal switch must still
    reach SDPA as a Python bool (it refused `causal and T > 1` as a SymBool). Dynamo's tracing with the eager
    backend (no code generation): the logits of the model run eagerly (to float32 rounding), for several lengths,
    one of them 1."""
    model = tiny(rotary=True, rmsnorm=True, qk_norm=True).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", dynamic=True, fullgraph=True)
    for T in (8, 12, 1):
        x = torch.randint(0, 37, (2, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x)[0], model(x)[0], rtol=1e-5, atol=1e-6)

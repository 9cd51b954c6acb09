"""The modern recipe's model switches: rotary against a float64 reference and invariant to a shift of both
positions, each switch off giving exactly GPT-2's model, each on doing what it says, KV-cache generation
equal to full recomputation with all of them on, the 'stream' window equal to sliding-window attention in
float64, and a run with all of them trained, resumed, sampled and exported through the real CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import gptforge.model.gpt as model_module
from conftest import run_cli, whole_and_resumed
from gptforge.core.errors import UserError
from gptforge.core.shape import SWITCHES
from gptforge.infer.engine import generate
from gptforge.kernels import activations, native, norms, rotary
from gptforge.kernels.norms import rms_norm
from gptforge.kernels.rotary import apply_rotary, rotary_angles
from gptforge.model.cache import KVCache
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.modules import ReLU2, RMSNorm
from gptforge.weights.export import export_hf

ALL_ON = dict(rotary=True, rmsnorm=True, qk_norm=True, relu2=True, untie_head=True, zero_init=True, logit_softcap=15.0)


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(block_size=32, vocab_size=37, n_layer=2, n_head=2, n_embd=32, bias=False), **kw}))


def traced_graphs(model: GPT, *args, **kw) -> list:
    """The FX graphs torch.compile's tracer makes of model(*args, **kw) (no_grad, one whole graph), with their nodes'
    example values (shapes, strides); no compiler runs."""
    graphs = []

    def capture(gm, example_inputs):  # noqa: ANN001, ANN202 - dynamo's backend signature
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture, fullgraph=True)(*args, **kw)
    torch._dynamo.reset()
    return graphs


def test_rotary_matches_a_float64_rotation():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 8, generator=gen)
    positions = torch.arange(5, 12)
    cos, sin = rotary_angles(positions, 8, 10000.0)
    ours = apply_rotary(x, cos, sin)
    expected = torch.empty(2, 3, 7, 8, dtype=torch.float64)
    for t, pos in enumerate(positions.tolist()):
        for i in range(4):  # pair (i, i + 4) turned by pos * base^(-2i/8), nanochat's direction
            theta = pos * 10000.0 ** (-2 * i / 8)
            a, b = x[..., t, i].double(), x[..., t, i + 4].double()
            expected[..., t, i] = a * math.cos(theta) + b * math.sin(theta)
            expected[..., t, i + 4] = b * math.cos(theta) - a * math.sin(theta)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [False, True], ids=["positions (T,)", "positions (B, T)"])
def test_rotary_gradient_is_the_rotations(rows):
    """Rotary's own backward (the rotation by the opposite angles) against autograd's numerical gradient, in
    float64; and a float32 forward equals the plain expression's."""
    gen = torch.Generator().manual_seed(2)
    positions = torch.randint(0, 50, (2, 6), generator=gen) if rows else torch.arange(3, 9)
    cos, sin = rotary_angles(positions, 8, 10000.0)
    x = torch.randn(2, 3, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos.double(), sin.double()), (x,))
    a, b = x.detach().float().chunk(2, dim=-1)
    plain = torch.cat((a * cos + b * sin, b * cos - a * sin), dim=-1)
    torch.testing.assert_close(apply_rotary(x.detach().float(), cos, sin), plain, rtol=1e-6, atol=1e-6)


def test_rotary_scores_depend_on_the_distance_only():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16, generator=gen, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        qc, qs = rotary_angles(torch.tensor([m]), 16, 500.0)
        kc, ks = rotary_angles(torch.tensor([n]), 16, 500.0)
        return (apply_rotary(q, qc.double(), qs.double()) * apply_rotary(k, kc.double(), ks.double())).sum().item()

    for m, n in ((3, 1), (10, 4), (20, 20)):
        for shift in (1, 7, 100):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)  # float32 angles
    assert score(3, 1) != pytest.approx(score(4, 1), rel=1e-3)


def test_the_rotary_table_is_rotary_angles_computed_once():
    """A rotary GPT keeps cos and sin of positions 0 .. block_size - 1 as buffers (moved with the model, out of its
    state_dict): rotary_angles' own values, so the default positions give what explicit ones give, bit for bit, with
    and without a KV cache. A compiled forward reads them: computed inside the graph, torch.compile fused pow, cos
    and sin into every q and k kernel (docs/PERFORMANCE.md, "On a GPU")."""
    model = tiny(**ALL_ON, rope_base=500.0).eval()
    for start, T in ((0, 32), (5, 9), (31, 1)):
        cos, sin = rotary_angles(torch.arange(start, start + T), 16, 500.0)
        assert torch.equal(model.rope_cos[start : start + T], cos) and torch.equal(
            model.rope_sin[start : start + T], sin
        )
    assert {n for n, _ in model.named_buffers()} == {"rope_cos", "rope_sin"}
    assert not [k for k in model.state_dict() if "rope" in k]
    assert "rope_cos" not in dict(tiny().named_buffers())  # learned positions: no table
    idx = torch.randint(0, 37, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(idx, idx)[0], model(idx, idx, positions=torch.arange(32))[0])
        caches = KVCache(2, 32), KVCache(2, 32)
        for cache in caches:
            model.hidden_states(idx[:, :20], cache)
        after = model.hidden_states(idx[:, 20:], caches[0])
        assert torch.equal(after, model.hidden_states(idx[:, 20:], caches[1], positions=torch.arange(20, 32)))

    def trig_ops(**kw) -> set[str]:
        graphs = traced_graphs(model, idx, idx, **kw)
        return {str(n.target) for g in graphs for n in g.graph.nodes if str(n.target) in ("cos", "sin")}

    assert trig_ops() == set()
    assert trig_ops(positions=torch.arange(32)) == {"cos", "sin"}  # given positions: computed in the graph


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_each_switch_at_its_off_value_is_gpt2s_model(switch):
    idx = torch.randint(0, 37, (2, 32), generator=torch.Generator().manual_seed(2))
    plain, explicit = tiny(), tiny(**{switch: SWITCHES[switch]})
    assert list(plain.state_dict()) == list(explicit.state_dict())
    pairs = zip(plain.state_dict().values(), explicit.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert torch.equal(plain(idx, idx)[0], explicit(idx, idx)[0])


def test_each_switch_on_does_what_it_says():
    assert "transformer.wpe.weight" not in tiny(rotary=True).state_dict()
    assert not any("ln_" in n for n, _ in tiny(rmsnorm=True).named_parameters())  # parameter-free norms
    untied = tiny(untie_head=True)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    zero = tiny(zero_init=True)
    assert all(p.abs().sum() == 0 for n, p in zero.named_parameters() if n.endswith("c_proj.weight"))
    capped = tiny(logit_softcap=2.0)
    with torch.no_grad():
        capped.lm_head.weight.mul_(1000)
        logits = capped(torch.randint(0, 37, (1, 32)), torch.randint(0, 37, (1, 32)))[0]
    assert logits.abs().max() <= 2.0 and logits.abs().max() > 1.9
    for switch in ("qk_norm", "relu2"):  # change the function, not the parameters
        idx = torch.randint(0, 37, (2, 32), generator=torch.Generator().manual_seed(3))
        assert not torch.allclose(tiny(**{switch: True})(idx, idx)[0], tiny()(idx, idx)[0])


def test_generation_with_the_cache_equals_recomputation_with_every_switch_on():
    model = tiny(**{**ALL_ON, "zero_init": False}).eval()  # zero projections would make every layer an identity
    prompt = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(4))
    cached = generate(model, prompt, 40, temperature=0, use_cache=True)
    plain = generate(model, prompt, 40, temperature=0, use_cache=False)
    assert torch.equal(cached, plain)


def banded_attention(window: int):
    """SDPA whose causal mask also hides keys `window` or more tokens back: sliding-window attention."""

    def attend(q, k, v, dropout_p=0.0, is_causal=False):
        assert is_causal and dropout_p == 0.0
        i = torch.arange(q.size(-2))[:, None]
        j = torch.arange(k.size(-2))[None, :]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        return scores.masked_fill((j > i) | (j <= i - window), -math.inf).softmax(-1) @ v

    return attend


def test_the_stream_window_is_sliding_window_attention_over_the_whole_text(monkeypatch):
    model = tiny(**{**ALL_ON, "zero_init": False}).double().eval()  # block_size 32
    prompt = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        text = generate(model, prompt, 70, temperature=0, window="stream")  # 76 tokens: the ring wraps twice
        cache, steps = KVCache(model.config.n_layer, 32, ring=True), []
        steps.append(model(text[:, :6], cache=cache)[0])
        steps += [model(text[:, t : t + 1], cache=cache)[0] for t in range(6, 75)]
        assert cache.length == 32 and cache.position == 75
        monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", banded_attention(32))
        model.config = dataclasses.replace(model.config, block_size=76)  # rotary: block_size is only a check
        reference = model.logits(model.hidden_states(text[:, :-1]))  # (2, 75, V), absolute positions
    torch.testing.assert_close(torch.cat(steps, 1), reference[:, 5:], rtol=0, atol=1e-10)
    assert torch.equal(text[:, 6:], reference[:, 5:].argmax(-1))
    with pytest.raises(ValueError, match="needs a rotary model"):
        generate(tiny(), prompt, 40, window="stream")


def test_a_run_with_every_switch_trains_resumes_exactly_and_exports_as_nanochat(char_data, tmp_path):
    run = dict(max_iters=10, lr_decay_iters=10, warmup_iters=2, eval_interval=5, **ALL_ON, optimizer="muon")
    whole, split = tmp_path / "whole", tmp_path / "split"
    a, _ = whole_and_resumed(char_data, tmp_path, run)
    assert a["model_args"]["rotary"] is True and a["model_args"]["logit_softcap"] == 15.0
    r = run_cli("train", f"--out_dir={split}", "--init_from=resume", "--rotary=False", cwd=tmp_path)
    assert r.returncode == 2 and "rotary" in r.stderr
    r = run_cli("sample", f"--out_dir={whole}", "--max_new_tokens=20", "--num_samples=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli("sample", f"--out_dir={whole}", "--max_new_tokens=80", "--window=stream", "--seed=3", cwd=tmp_path)
    assert r.returncode == 0 and "stream window" in r.stderr, r.stderr  # past block_size 32 on the ring cache
    r = run_cli("sample", f"--out_dir={whole}", "--window=stream", "--no_cache", cwd=tmp_path)
    assert r.returncode == 2 and "--window=stream is the KV cache's own window" in r.stderr
    r = run_cli("export", f"--out_dir={whole}", f"--to={tmp_path / 'hf'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "nanochat"


def test_nanochat_shaped_models_export_to_transformers_nanochat_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny(**{**ALL_ON, "zero_init": False, "rope_base": 500.0}).eval()
    export_hf(model, str(tmp_path / "hf"), None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(theirs).__name__ == "NanoChatForCausalLM"
    idx = torch.randint(0, 37, (3, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, model(idx, idx)[0], rtol=0, atol=1e-5)
        prompt = idx[:1, :4]
        hf_text = theirs.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(hf_text, generate(model, prompt, 20, temperature=0))


@pytest.mark.parametrize("switches", [dict(rotary=True), dict(rmsnorm=True, relu2=True), {**ALL_ON, "bias": True}])
def test_a_model_no_format_holds_is_refused_naming_what_is_missing(tmp_path, switches):
    with pytest.raises(UserError, match="no Hugging Face format holds this model") as e:
        export_hf(tiny(**switches), str(tmp_path / "hf"), None)
    assert "NanoChat format also needs" in str(e.value)
    assert not (tmp_path / "hf").exists()


def test_zero_init_alone_still_exports_as_gpt2(tmp_path):
    export_hf(tiny(zero_init=True), str(tmp_path / "hf"), None)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gpt2"


def test_squared_relu_is_relu_squared_with_its_gradient():
    """relu2's activation as one autograd step: its value and gradient against relu(x)^2 in float64 (gradcheck),
    and under bf16 autocast it stays bf16 (no float32 copy of the MLP's widest activation)."""
    x = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    assert torch.autograd.gradcheck(activations.SquaredReLU.apply, (x,))
    y = ReLU2()(x)
    torch.testing.assert_close(y, torch.relu(x) ** 2, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, 2 * torch.relu(x), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ReLU2()(x.detach().bfloat16()).dtype == torch.bfloat16


def test_rms_norm_is_x_over_its_root_mean_square_with_its_gradient():
    """The own RMSNorm step against autograd's numerical gradient in float64 (gradcheck), equal to F.rms_norm in
    float32, and in bf16 (qk-norm's case) and from float32 into bf16 (a block's norm under autocast) within one
    bf16 rounding of the float64 values and gradients."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 5, 16, dtype=torch.float64, generator=gen) * 3).requires_grad_()
    assert torch.autograd.gradcheck(rms_norm, (x,))
    x32 = torch.randn(4, 7, 384, generator=gen) * 3
    torch.testing.assert_close(rms_norm(x32), torch.nn.functional.rms_norm(x32, (384,), eps=1e-6))
    wide = (torch.randn(2, 3, 9, 64, dtype=torch.float64, generator=gen) * 2).requires_grad_()
    grad = torch.randn(2, 3, 9, 64, dtype=torch.float64, generator=gen)
    expected = wide / (wide.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    (expected_dx,) = torch.autograd.grad(expected, wide, grad)
    for source, written in ((torch.bfloat16, None), (torch.float32, torch.bfloat16)):
        x_low = wide.detach().to(source).requires_grad_()
        y = rms_norm(x_low, written)
        assert y.dtype == torch.bfloat16 and x_low.dtype == source
        (dx,) = torch.autograd.grad(y, x_low, grad.bfloat16())
        assert dx.dtype == source
        torch.testing.assert_close(y.double(), expected, rtol=2**-7, atol=1e-2)
        torch.testing.assert_close(dx.double(), expected_dx, rtol=2**-6, atol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert RMSNorm()(x32).dtype == torch.bfloat16  # straight into the next layer's dtype
        assert rms_norm(x32).dtype == torch.float32  # the embedding's norm feeds the float32 residual stream
    assert RMSNorm()(x32).dtype == torch.float32


def _rms_reference(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's value and gradient for x, computed in float64 by autograd."""
    x64 = x.detach().double().requires_grad_()
    y = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    (dx,) = torch.autograd.grad(y, x64, grad.double())
    return y.detach(), dx


@pytest.mark.parametrize("width", [1, 64, 383, 384])
@pytest.mark.parametrize(
    "source, written",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
)
def test_the_compiled_rms_norm_matches_float64_and_torchs_own_steps(monkeypatch, source, written, width):
    """Where a C compiler is (CI's), RMSNorm on contiguous CPU float32 / bf16 tensors runs in cpu_kernels.c (one read
    of each row each way): its values and gradients lie within float32 rounding (float32 out) or one bf16 rounding
    (bf16 out) of float64's, and as close to them as the torch operations it replaces; a transposed x takes the torch
    path and gives the same values."""
    if not native.c_compiler():
        pytest.skip("no C compiler here")
    assert native.native_kernels() is not None
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(3, 7, width, generator=gen) * 3).to(source).requires_grad_()
    grad = torch.randn(3, 7, width, generator=gen).to(written)
    assert norms._rms_kernel(x.detach(), written) is not None  # the compiled path, not torch's
    y = rms_norm(x, written)
    (dx,) = torch.autograd.grad(y, x, grad)
    assert y.dtype == written and dx.dtype == source
    want_y, want_dx = _rms_reference(x, grad)
    tol = {torch.float32: 2e-6, torch.bfloat16: 2**-8}
    torch.testing.assert_close(y.double(), want_y, rtol=tol[written], atol=tol[written])
    # the gradient's two terms g r and x r^3 mean(g x) cancel (all but exactly at width 1): errors relative to g r
    r = (x.detach().double().pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    scale = (grad.double().abs() * r).max().item()
    torch.testing.assert_close(dx.double(), want_dx, rtol=0, atol=4 * tol[source] * scale)
    monkeypatch.setattr(native, "_kernel", [None])  # torch's own operations
    assert norms._rms_kernel(x.detach(), written) is None
    y_torch = rms_norm(x, written)
    (dx_torch,) = torch.autograd.grad(y_torch, x, grad)
    assert (y.double() - want_y).abs().max() <= (y_torch.double() - want_y).abs().max() + tol[written] / 2
    assert (dx.double() - want_dx).abs().max() <= (dx_torch.double() - want_dx).abs().max() * 1.01 + 1e-6
    monkeypatch.undo()
    turned = x.detach().transpose(0, 1).requires_grad_()  # not contiguous: torch's path, the same values
    assert norms._rms_kernel(turned.detach(), written) is None
    torch.testing.assert_close(
        rms_norm(turned, written), y.detach().transpose(0, 1), rtol=tol[written], atol=tol[written]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_then_rms_norm_in_one_step_matches_float64(dtype):
    """qk-norm after rotary (rotary.rotary_rms_norm) on attention's head-split view of c_attn's output: where the
    compiled kernel is (CI's), one step whose value and gradient lie within float32 rounding (float32) or one bf16
    rounding (bf16) of float64's, at least as close as the two torch steps it replaces; the gradient reaches q's
    columns of c_attn's output and nothing else."""
    if not native.c_compiler():
        pytest.skip("no C compiler here")
    B, T, H, hs = 2, 9, 3, 64
    gen = torch.Generator().manual_seed(6)
    qkv = (torch.randn(B, T, 3 * H * hs, generator=gen) * 2).to(dtype).requires_grad_()
    cos, sin = rotary_angles(torch.arange(T), hs, 10000.0)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t[..., : H * hs].view(B, T, H, hs).transpose(1, 2)  # q as attention splits it

    assert rotary._rope_rms_kernels(heads(qkv), cos) is not None  # the compiled path
    y = rotary.rotary_rms_norm(heads(qkv), cos, sin)
    grad = torch.randn(y.shape, generator=gen).to(dtype)
    (dqkv,) = torch.autograd.grad(y, qkv, grad)
    two_steps = rms_norm(apply_rotary(heads(qkv), cos, sin))
    (dqkv_two,) = torch.autograd.grad(two_steps, qkv, grad)
    q64 = heads(qkv.detach().double()).requires_grad_()
    a, b = q64.chunk(2, dim=-1)
    cos64, sin64 = cos.double(), sin.double()
    turned = torch.cat((a * cos64 + b * sin64, b * cos64 - a * sin64), dim=-1)
    want = turned / (q64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    (want_dq,) = torch.autograd.grad(want, q64, grad.double())
    tol = {torch.float32: 2e-6, torch.bfloat16: 2**-8}[dtype]
    assert y.dtype == dtype and y.is_contiguous()
    torch.testing.assert_close(y.double(), want.detach(), rtol=tol, atol=tol)
    dq, dq_two = heads(dqkv).double(), heads(dqkv_two).double()
    scale = want_dq.abs().max().item()
    torch.testing.assert_close(dq, want_dq, rtol=0, atol=2 * tol * scale)
    assert (y.double() - want).abs().max() <= (two_steps.double() - want).abs().max() + 1e-6
    assert (dq - want_dq).abs().max() <= (dq_two - want_dq).abs().max() + 1e-6
    assert dqkv[..., H * hs :].abs().max() == 0  # k's and v's columns untouched by q's norm

"""onednn_f32: float32 CPU products of the Linear layers by oneDNN (kernels/linear.py). The product and both gradients
against float64 autograd, in each of the weight gradient's three forms; the layer takes oneDNN only where it should
(float32 outside autocast, large enough products, the switch on); a model trained with it follows torch's
arithmetic to float32 rounding; a run resumed from a checkpoint equals the uninterrupted run bit for bit with it on;
'auto' is on exactly where the rule says; the run and `bench` say which they used."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli, tiny_train_args
from gptforge.core import device as device_module
from gptforge.core.config import load_config
from gptforge.core.cpu import onednn_f32_available
from gptforge.core.device import onednn_f32_pays, resolve_onednn_f32
from gptforge.kernels import linear as linear_module
from gptforge.kernels.linear import MIN_MACS, OneDnnLinear
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.modules import Linear
from gptforge.model.vocab import resize_vocab
from gptforge.train.loop import train
from gptforge.weights.checkpoint import load_checkpoint

pytestmark = pytest.mark.skipif(not onednn_f32_available(), reason="oneDNN's matmul needs an x86-64 torch with oneDNN")


def float64_reference(x, w, b, grad):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    y = F.linear(x64, w64, b64)
    y.backward(grad.double())
    return y, x64.grad, w64.grad, None if b64 is None else b64.grad


@pytest.mark.parametrize(
    "inp,out",
    [(48, 200), (200, 48), (64, 64), (16, 8)],  # out > in, in > out, square: oneDNN; 16 x 8: torch's weight gradient
    ids=["wide", "narrow", "square", "small"],
)
@pytest.mark.parametrize("bias", [True, False])
def test_the_product_and_its_gradients_equal_float64(inp, out, bias):
    gen = torch.Generator().manual_seed(inp * out)
    x = torch.randn(3, 37, inp, generator=gen, requires_grad=True)
    w = torch.randn(out, inp, generator=gen, requires_grad=True)
    b = torch.randn(out, generator=gen, requires_grad=True) if bias else None
    grad = torch.randn(3, 37, out, generator=gen)
    y = OneDnnLinear.apply(x, w, b)
    y.backward(grad)
    ry, rx, rw, rb = float64_reference(x.detach(), w.detach(), None if b is None else b.detach(), grad)
    # float32 sums of up to 111 products of unit normals: errors ~1e-6 of the terms' size
    tol = dict(rtol=1e-4, atol=1e-4)
    assert y.dtype == torch.float32 and y.shape == (3, 37, out) and y.is_contiguous()
    torch.testing.assert_close(y.double(), ry, **tol)
    torch.testing.assert_close(x.grad.double(), rx, **tol)
    torch.testing.assert_close(w.grad.double(), rw, **tol)
    assert w.grad.is_contiguous() and w.grad.shape == w.shape
    if bias:
        torch.testing.assert_close(b.grad.double(), rb, **tol)


def test_an_expanded_gradient_and_a_strided_input():
    """A sum's gradient arrives with zero strides, a transposed activation with others: both give the right sums."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(40, 24, generator=gen)
    x = base.t().requires_grad_()  # (24, 40), not contiguous
    w = torch.randn(56, 40, generator=gen, requires_grad=True)
    OneDnnLinear.apply(x, w, None).sum().backward()
    ry, rx, rw, _ = float64_reference(x.detach(), w.detach(), None, torch.ones(24, 56))
    torch.testing.assert_close(x.grad.double(), rx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad.double(), rw, rtol=1e-4, atol=1e-4)


@pytest.fixture
def calls(monkeypatch):
    """How many oneDNN products the layers called."""
    seen = []
    real = linear_module.onednn_nt

    def counting(*args, **kwargs):
        seen.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_module, "onednn_nt", counting)
    return seen


def test_the_layer_takes_onednn_only_where_it_should(calls):
    layer = Linear(64, 256)
    big = torch.randn(4, 64, 64)  # 256 rows x 64 x 256 = 4.2M multiply-adds
    assert 256 * 64 * 256 >= MIN_MACS
    want = F.linear(big, layer.weight, layer.bias)
    assert torch.equal(layer(big), want) and not calls  # off by default: torch's product, bit for bit
    layer.onednn = True
    got = layer(big)
    assert len(calls) == 1 and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    layer(torch.randn(1, 1, 64))  # a decode step's row: below MIN_MACS
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(big).dtype == torch.bfloat16  # autocast's product, in bf16
    layer.double()
    layer(big.double())  # float64: torch's
    assert len(calls) == 1


def model(onednn: bool) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=64, vocab_size=96, dropout=0.0, bias=True)
    gpt = GPT(cfg)
    gpt.use_onednn_f32(onednn)
    return gpt


def test_a_model_trained_with_it_follows_torchs_arithmetic(calls):
    """Five SGD steps of a 128-wide GPT (every Linear above MIN_MACS): the losses and weights of torch's arithmetic
    to float32 rounding, and oneDNN took every product of the blocks and the head (the weight gradients of the
    matrices of MIN_WEIGHT_GRAD entries and up: the MLP's)."""
    runs = {}
    for onednn in (False, True):
        gpt = model(onednn)
        opt = torch.optim.SGD(gpt.parameters(), lr=0.1)  # (Adam's sign-like steps would magnify a zero's rounding)
        gen = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(5):
            x = torch.randint(0, 96, (8, 64), generator=gen)
            _, loss = gpt(x, torch.roll(x, -1, 1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs[onednn] = losses, gpt.state_dict()
    # per step: c_attn, c_proj, c_fc, c_proj of 2 blocks and the head, forward and input gradient; c_fc's and the
    # MLP's c_proj's weight gradients (128 x 512); the others' (128 x 384 and smaller) by torch
    assert len(calls) == 5 * (9 * 2 + 4)
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5)
    for key, tensor in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][key], tensor, rtol=1e-4, atol=1e-5)


def test_the_switch_survives_a_grown_vocabulary():
    for untie in (False, True):
        torch.manual_seed(0)
        gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50, untie_head=untie))
        gpt.use_onednn_f32(True)
        resize_vocab(gpt, 64)
        assert gpt.lm_head.onednn and isinstance(gpt.lm_head, Linear)
        assert (gpt.lm_head.weight is gpt.transformer.wte.weight) is not untie


def test_auto_is_on_for_amd_processors_with_full_width_avx512_only():
    def cpu(vendor, family, capability):
        return {"vendor": vendor, "family": str(family), "capability": capability}

    assert onednn_f32_pays(cpu("AuthenticAMD", 26, "AVX512")) is True  # Zen 5
    assert onednn_f32_pays(cpu("AuthenticAMD", 26, "AVX2")) is False  # AVX-512 turned off
    assert onednn_f32_pays(cpu("AuthenticAMD", 25, "AVX512")) is False  # Zen 4: 512-bit operations in two halves
    assert onednn_f32_pays(cpu("AuthenticAMD", 23, "AVX2")) is False  # Zen 2: MKL's AVX2 code is as fast
    assert onednn_f32_pays(cpu("GenuineIntel", 6, "AVX512")) is False  # MKL has its AVX-512 code there
    assert onednn_f32_pays(cpu("", "", "AVX512")) is False  # no /proc/cpuinfo
    here = onednn_f32_pays()
    assert resolve_onednn_f32("auto", "cpu") is here
    assert resolve_onednn_f32("auto", "cuda") is False and resolve_onednn_f32(True, "cuda") is False
    assert resolve_onednn_f32(True, "cpu") is True and resolve_onednn_f32(False, "cpu") is False


def test_asking_for_it_where_it_cannot_run_says_so_and_keeps_torchs(monkeypatch, capsys):
    """An ARM CPU, a torch without oneDNN, or a run resumed there whose config.json says True: torch's products."""
    monkeypatch.setattr(device_module, "onednn_f32_available", lambda: False)
    assert resolve_onednn_f32(True, "cpu") is False
    assert "onednn_f32=True" in capsys.readouterr().err
    assert resolve_onednn_f32("auto", "cpu") is False


def run_args(char_data, out, **overrides):
    # 64 wide, 16 x 64 tokens a step: every Linear's product is above MIN_MACS, so oneDNN takes them all
    return tiny_train_args(char_data, out, n_embd=64, block_size=64, batch_size=16, dropout=0.1, **overrides)


def test_a_resumed_run_equals_the_uninterrupted_one_with_it_on(char_data, tmp_path):
    """Stopped at step 6 and resumed to 12: the weights, the optimizer state and every logged loss equal the
    12-step run's bit for bit, with oneDNN's products (asked for, so on any x86 machine)."""
    common = dict(max_iters=12, lr_decay_iters=12, eval_interval=6, onednn_f32=True)
    train(load_config(run_args(char_data, tmp_path / "whole", **common)))
    train(load_config(run_args(char_data, tmp_path / "split", **{**common, "max_iters": 6})))
    train(load_config(run_args(char_data, tmp_path / "split", **common, init_from="resume")))
    whole, split = load_checkpoint(str(tmp_path / "whole/ckpt.pt")), load_checkpoint(str(tmp_path / "split/ckpt.pt"))
    assert whole["iter_num"] == split["iter_num"] == 12 and whole["config"]["onednn_f32"] is True
    for key, tensor in whole["model"].items():
        assert torch.equal(tensor, split["model"][key]), key
    for pid, state in whole["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, split["optimizer"]["state"][pid][name]), (pid, name)
    assert (tmp_path / "whole/log.txt").read_text() == (tmp_path / "split/log.txt").read_text()


def test_the_run_and_bench_say_what_they_used(char_data, tmp_path):
    out = tmp_path / "run"
    done = run_cli("train", *run_args(char_data, out, max_iters=2, eval_interval=2))
    assert done.returncode == 0, done.stderr
    saved = json.loads((out / "config.json").read_text())
    assert saved["onednn_f32"] is onednn_f32_pays()  # 'auto', resolved for this machine
    assert ("float32 products by oneDNN" in done.stdout + done.stderr) is onednn_f32_pays()
    off = run_cli("train", *run_args(char_data, tmp_path / "off", max_iters=2, eval_interval=2, onednn_f32=False))
    assert off.returncode == 0 and "oneDNN" not in off.stdout + off.stderr
    bench = run_cli(
        "bench", *run_args(char_data, tmp_path / "b"), "--onednn_f32=True", "--iters=2", "--warmup=1", "--rounds=1",
        "--compare", "--json",
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    result = json.loads(bench.stdout)
    assert result["default"]["onednn_f32"] is True and result["baseline"]["onednn_f32"] is False
    bad = run_cli("train", *run_args(char_data, tmp_path / "bad"), "--onednn_f32=sometimes")
    assert bad.returncode == 2 and "onednn_f32" in bad.stderr and "Traceback" not in bad.stderr

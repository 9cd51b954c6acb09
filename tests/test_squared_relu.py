"""relu(x)^2, the modern recipe's MLP activation (activations.SquaredReLU): on a CPU in float32 and bf16
cpu_kernels.c's one pass each way, with the bits of torch's operations it replaces (relu, `r * r`; `(g * r).mul_(2)`),
and against float64; a model trains through it with the same loss and gradients."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import loss_and_grads
from gptforge.kernels import activations, native
from gptforge.kernels import checks as native_checks
from gptforge.kernels.reference import SPECIAL, same_bits
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.modules import ReLU2


@pytest.fixture
def counted(monkeypatch):
    """The compiled kernels' calls, forward and backward, by dtype."""
    calls = []
    real = native.native_kernels()
    assert real is not None  # CI has a C compiler: the compiled path must be what runs there

    def logged(function, dtype, way):  # noqa: ANN001, ANN202
        return lambda *args: calls.append((dtype, way)) or function(*args)

    wrapped = {dtype: (logged(fs[0], dtype, 0), logged(fs[1], dtype, 1)) for dtype, fs in real.relu2.items()}
    monkeypatch.setattr(activations, "cpu_kernels", lambda *t: native.cpu_kernels(*t) and real._replace(relu2=wrapped))
    return calls


def torch_relu2(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operations the kernels replace: relu(x)^2 as r * r, and its gradient for g as (g * r) * 2."""
    r = torch.relu(x)
    return r * r, (g * r).mul_(2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5), (4, 33, 1536), (70001,)])
def test_squared_relu_gives_torchs_bits_and_float64s_values(dtype, shape, counted):
    gen = torch.Generator().manual_seed(sum(shape))
    x, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    x.view(-1)[: len(SPECIAL)] = torch.tensor(SPECIAL)  # -0, NaN, infinities, a subnormal, near-overflow values
    g.view(-1)[-len(SPECIAL) :] = torch.tensor(SPECIAL)
    x, g = x.to(dtype).requires_grad_(), g.to(dtype)

    h = ReLU2()(x)
    (dx,) = torch.autograd.grad(h, x, g)
    assert counted == [(dtype, 0), (dtype, 1)]  # the kernel, once each way
    want_h, want_dx = torch_relu2(x.detach(), g)
    assert h.dtype == dtype and same_bits(h, want_h) and same_bits(dx, want_dx)

    finite = x.detach().isfinite() & g.isfinite() & (x.detach().abs() < 1e18)  # no overflow in float64's square
    x64, g64 = x.detach().double()[finite], g.double()[finite]
    r64 = x64.clamp_min(0)
    info = torch.finfo(dtype)  # one rounding of the result (and of g r before the doubling); products that underflow
    torch.testing.assert_close(h.double()[finite], r64 * r64, rtol=info.eps, atol=info.tiny)
    torch.testing.assert_close(dx.double()[finite], 2 * g64 * r64, rtol=info.eps, atol=2 * info.tiny)


def test_a_strided_input_and_a_broadcast_gradient(counted):
    """A transposed x is read through a contiguous copy; the gradient of a sum (an expanded tensor) is made
    contiguous: the same values as torch's operations on them."""
    x = torch.randn(48, 40, generator=torch.Generator().manual_seed(3)).t().requires_grad_()
    h = ReLU2()(x)
    h.sum().backward()
    assert len(counted) == 2
    want_h, want_dx = torch_relu2(x.detach(), torch.ones_like(x))
    assert torch.equal(h, want_h) and torch.equal(x.grad, want_dx)


def test_elsewhere_torchs_operations(counted):
    """float64 (gradcheck's dtype) has no kernel: torch's operations, the same values."""
    x = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    assert torch.autograd.gradcheck(activations.SquaredReLU.apply, (x,))
    assert counted == []


@pytest.mark.parametrize("bf16", [True, False])
def test_a_model_trains_through_it_with_torchs_loss_and_gradients(bf16, counted, monkeypatch):
    torch.manual_seed(0)
    config = dict(rotary=True, rmsnorm=True, qk_norm=True, relu2=True, untie_head=True, bias=False, dropout=0.0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=2, n_embd=64, **config))
    idx = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(1))

    mine = loss_and_grads(model, idx, bf16=bf16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    assert counted == [(dtype, 0), (dtype, 0), (dtype, 1), (dtype, 1)]  # two blocks' MLPs, forward and backward
    monkeypatch.setattr(activations, "_relu2_kernels", lambda x: None)  # torch's operations
    theirs = loss_and_grads(model, idx, bf16=bf16)
    assert len(counted) == 4
    assert torch.equal(mine[0], theirs[0])
    for name, grad in mine[1].items():
        assert torch.equal(grad, theirs[1][name]), name


def test_the_load_check_refuses_a_wrong_kernel():
    """native's check before use compares the kernels with torch's bits: a forward one bit off in one element (its
    first, relu(0)^2) fails it, for either dtype."""
    real = native.native_kernels()
    assert real is not None and native_checks.relu2_agrees(real)
    for dtype, (forward, backward) in real.relu2.items():

        def off_by_a_bit(x, h, n, forward=forward):  # noqa: ANN001
            forward(x, h, n)
            ctypes.c_uint16.from_address(h).value ^= 1

        assert not native_checks.relu2_agrees(real._replace(relu2={**real.relu2, dtype: (off_by_a_bit, backward)}))

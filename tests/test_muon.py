"""optimizer='muon': the Newton-Schulz iteration against the SVD's polar factor, MuonAdamW's two kinds of step
against a hand computation and torch's AdamW, and a resumed Muon run equal to an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import kept_rates, whole_and_resumed
from gptforge.core.config import TrainConfig
from gptforge.core.errors import UserError
from gptforge.model import muon
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.muon import CUBIC, MuonAdamW, orthogonalize
from gptforge.model.optim import configure_optimizer
from gptforge.train.setup import muon_dtype, muon_settings


def polar(g: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return u @ vh


@pytest.mark.parametrize("shape", [(24, 24), (40, 16), (16, 40)])
def test_the_cubic_iteration_converges_to_the_polar_factor(shape):
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(orthogonalize(g, steps=60, coefficients=CUBIC), polar(g), rtol=0, atol=1e-10)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
def test_muons_five_quintic_steps_keep_the_singular_vectors_and_even_out_the_values(shape):
    """The quintic gives U f(S) V^T: in the SVD's own basis a diagonal matrix, every entry near 1."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x = orthogonalize(g)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    inner = u.T @ x @ vh.T  # diag(f(S)) when x = U f(S) V^T
    diagonal = torch.diagonal(inner)
    assert (inner - torch.diag(diagonal)).abs().max() < 2e-3
    assert diagonal.min() > 0.5 and diagonal.max() < 1.3, diagonal


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_a_stack_of_matrices_is_orthogonalised_as_each_alone(shape):
    """Same-shape matrices go through the iteration as one stack (one batched product per step): each comes out
    as it does alone."""
    g = torch.randn(3, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    stacked = orthogonalize(g)
    for i in range(3):
        torch.testing.assert_close(stacked[i], orthogonalize(g[i]), rtol=0, atol=1e-12)


def spread(k: int, m: int, n: int, seed: int) -> torch.Tensor:
    """k matrices m x n (m <= n) with singular values from 1 down to 1e-4, like a gradient's: the hard case for
    an iteration on the Gram matrix, whose eigenvalues span 1 to 1e-8."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(k, m, m, dtype=torch.float64, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(k, n, m, dtype=torch.float64, generator=gen))[0]
    return (u * torch.logspace(0, -4, m, dtype=torch.float64)) @ v.mT


def step_by_step(monkeypatch, g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """orthogonalize with every step on X (no Gram form)."""
    with monkeypatch.context() as m:
        m.setattr(muon, "gram_form_pays", lambda x: False)
        return orthogonalize(g, dtype=dtype)


@pytest.mark.parametrize("shape", [(3, 48, 96), (3, 160, 40), (40, 130)])
def test_the_gram_form_is_the_step_by_step_iteration(monkeypatch, shape):
    """Wide matrices (n >= 2m) iterate on their m x m side in float64 and float32 CPU products: the same result as
    the step-by-step iteration, to float64's rounding in float64, and in float32 within 1e-3 (relative; measured
    0.8-3e-4, where the step-by-step form's float32 is within 1e-5 and bf16's, which Muon trains with as well,
    within 0.06-0.12) over a spectrum of 1 .. 1e-4."""
    m, n = sorted(shape[-2:])
    wide = spread(shape[0] if len(shape) == 3 else 1, m, n, seed=4)  # m x n, the side orthogonalize iterates on
    wide = wide if len(shape) == 3 else wide[0]
    g = wide.mT if shape[-2] > shape[-1] else wide
    assert muon.gram_form_pays(wide) and muon.gram_form_pays(wide.float())
    gram64, gram32 = orthogonalize(g), orthogonalize(g.float())
    step64 = step_by_step(monkeypatch, g)
    torch.testing.assert_close(gram64, step64, rtol=0, atol=1e-12)
    assert gram32.dtype == torch.float32 and gram32.shape == g.shape
    assert (gram32.double() - step64).norm() / step64.norm() < 1e-3


def test_the_gram_form_is_taken_only_where_it_is_cheaper_and_exact_enough():
    """Only at n >= 2m, on a CPU, and not in bfloat16 (its m x m products keep their rounding errors: the singular
    values drift to ~2.5), nor in float32 products done at lower precision (set_float32_matmul_precision)."""
    wide, narrow = torch.zeros(2, 32, 64), torch.zeros(2, 48, 80)
    assert muon.gram_form_pays(wide) and muon.gram_form_pays(wide.double())
    assert not muon.gram_form_pays(narrow)
    assert not muon.gram_form_pays(wide.bfloat16()) and not muon.gram_form_pays(wide.half())
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert not muon.gram_form_pays(wide) and muon.gram_form_pays(wide.double())
    finally:
        torch.set_float32_matmul_precision(before)
    x = spread(1, 32, 96, seed=5)[0].bfloat16()
    top = torch.linalg.svdvals(muon._gram_form(x, 5, muon.QUINTIC, torch.addmm).double()).max()
    assert top > 1.5, top  # why bf16 keeps the step-by-step form (within bf16's precision of float64's: below)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (128, 128)])
def test_the_iteration_in_bfloat16_gives_float32s_result_to_bfloat16_precision(shape):
    """What Muon needs of the iteration in bf16: the same singular vectors, and each singular value taken where
    the float64 computation of the same iteration (the reference) takes it."""
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    reference = orthogonalize(g)
    low = orthogonalize(g.float(), dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16
    error = (low.double() - reference).norm() / reference.norm()
    assert error < 0.03, error  # bf16 keeps 8 bits of mantissa: ~0.4% a rounding, over 15 products
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    inner = u.T @ low.double() @ vh.T
    diagonal = torch.diagonal(inner)
    assert (inner - torch.diag(diagonal)).abs().max() < 0.05
    assert (diagonal - torch.diagonal(u.T @ reference @ vh.T)).abs().max() < 0.03


def test_a_bfloat16_muon_step_applies_the_bfloat16_iteration():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 16))
    start = w.detach().clone()
    group = dict(params=[w], kind="muon", lr=0.05, momentum=0.95, momentum_warmup=300, ns_dtype="bfloat16")
    opt = MuonAdamW([group])
    w.grad = torch.randn(32, 16)
    opt.step()
    momentum = 0.85 + min(1 / 300, 1.0) * (0.95 - 0.85)
    direction = w.grad.add(w.grad, alpha=momentum)  # the first step: buf = grad; Nesterov: grad + momentum * buf
    expected = start - 0.05 * (32 / 16) ** 0.5 * orthogonalize(direction, dtype=torch.bfloat16).float()
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bf16, chosen", [(3e11, "bfloat16"), (1.5e11, "float32"), (2e9, "float32")])
def test_muon_dtype_auto_is_bfloat16_where_its_products_measure_faster(monkeypatch, tmp_path, bf16, chosen):
    """On a CPU, by the measured rates (float32's 1.6e11 here), not by the CPU's flags: bf16 at half float32's rate
    (a Xeon that lists avx512_bf16) keeps Newton-Schulz in float32."""
    kept_rates(monkeypatch, tmp_path, float32=1.6e11, bfloat16=bf16)
    assert muon_dtype(TrainConfig(muon_dtype="auto", device="cpu")) == chosen
    assert muon_dtype(TrainConfig(muon_dtype="auto", device="auto")) == muon_dtype(
        TrainConfig(muon_dtype="auto", device="cuda" if torch.cuda.is_available() else "cpu")
    )
    assert muon_dtype(TrainConfig(muon_dtype="auto", device="cuda")) == "bfloat16"
    for chosen in ("float32", "bfloat16"):
        assert muon_dtype(TrainConfig(muon_dtype=chosen, device="cpu")) == chosen
    model = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=1, n_head=2, n_embd=32))
    cfg = TrainConfig(optimizer="muon", muon_dtype="bfloat16")
    opt = configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon_settings(cfg))
    assert next(g for g in opt.param_groups if g["kind"] == "muon")["ns_dtype"] == "bfloat16"


def test_a_muon_step_is_the_orthogonalised_nesterov_momentum():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 16))
    start = w.detach().clone()
    opt = MuonAdamW([dict(params=[w], kind="muon", lr=0.05, momentum=0.95, momentum_warmup=300)])
    grads = [torch.randn(32, 16) for _ in range(2)]
    buf = torch.zeros(32, 16)
    expected = start.clone()
    for step, grad in enumerate(grads, start=1):
        w.grad = grad.clone()
        opt.step()
        momentum = 0.85 + min(step / 300, 1.0) * (0.95 - 0.85)  # the warm-up from 0.85
        buf = momentum * buf + grad
        expected -= 0.05 * orthogonalize(grad + momentum * buf) * (32 / 16) ** 0.5
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-6)


def test_its_adamw_groups_step_as_torchs_adamw():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(10, 7)), torch.nn.Parameter(torch.randn(10, 7))
    with torch.no_grad():
        b.copy_(a)
    ours = MuonAdamW([dict(params=[a], kind="adamw", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)])
    theirs = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(5):
        grad = torch.randn(10, 7)
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_configure_optimizer_gives_the_blocks_matrices_to_muon_and_the_rest_to_adamw():
    model = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=32, bias=True))
    cfg = TrainConfig(optimizer="muon", learning_rate=1e-3, muon_lr=0.03)
    opt = configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon_settings(cfg))
    kinds = {id(p): g["kind"] for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        hidden = name.startswith("transformer.h.") and p.dim() == 2
        assert kinds[id(p)] == ("muon" if hidden else "adamw"), name
    muon = next(g for g in opt.param_groups if g["kind"] == "muon")
    assert muon["lr"] == 0.03 and muon["lr_scale"] == pytest.approx(30.0) and muon["weight_decay"] == 0.0
    adamw = configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon_settings(TrainConfig()))
    assert isinstance(adamw, torch.optim.AdamW) and not any("kind" in g for g in adamw.param_groups)


@pytest.mark.parametrize("ns, normuon", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_a_resumed_muon_run_equals_an_uninterrupted_one(char_data, tmp_path, ns, normuon):
    """normuon: the neurons' running statistics are saved with the optimizer and carried on."""
    run = dict(max_iters=12, lr_decay_iters=12, warmup_iters=3, eval_interval=6, optimizer="muon", muon_warmup=5)
    run["muon_dtype"] = ns
    run["normuon"] = normuon
    whole, split = tmp_path / "whole", tmp_path / "split"
    a, b = whole_and_resumed(char_data, tmp_path, run)
    kinds = {g["kind"] for g in a["optimizer"]["param_groups"]}
    assert kinds == {"muon", "adamw"}
    assert {g.get("ns_dtype") for g in a["optimizer"]["param_groups"] if g["kind"] == "muon"} == {ns}
    muon_group = next(g for g in a["optimizer"]["param_groups"] if g["kind"] == "muon")
    assert ("normuon_beta2" in muon_group) == normuon
    for i in muon_group["params"]:  # every matrix's statistics in both checkpoints, equal
        ours, theirs = a["optimizer"]["state"][i], b["optimizer"]["state"][i]
        assert (muon.NEURON_STATE in ours) == normuon
        if normuon:
            assert torch.equal(ours[muon.NEURON_STATE], theirs[muon.NEURON_STATE])
    assert (whole / "log.txt").read_text() == (split / "log.txt").read_text()
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    evals = [row["val_loss"] for row in rows if row["kind"] == "eval"]
    assert len(evals) == 3 and evals[0] > evals[1] > evals[2] and evals[2] < evals[0] - 0.3, evals  # it learns


def test_a_resumed_run_orthogonalises_in_its_own_muon_dtype_not_the_checkpoints():
    from gptforge.train.runstate import load_optimizer_state

    model = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=1, n_head=2, n_embd=32))

    def optimizer(ns: str) -> torch.optim.Optimizer:
        return configure_optimizer(
            model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon_settings(TrainConfig(optimizer="muon", muon_dtype=ns))
        )

    saved = optimizer("float32").state_dict()
    older = {**saved, "param_groups": [{k: v for k, v in g.items() if k != "ns_dtype"} for g in saved["param_groups"]]}
    for state in (saved, older):  # a checkpoint written before the setting existed too
        resumed = optimizer("bfloat16")
        load_optimizer_state(model, resumed, {"optimizer": state}, fsdp=False, path="ckpt.pt")
        assert [g.get("ns_dtype") for g in resumed.param_groups if g["kind"] == "muon"] == ["bfloat16"]


def test_a_resumed_run_steps_with_its_own_settings_and_the_checkpoints_moments():
    """Settings changed on resume (start.py announces them) take effect: every group's hyperparameters come from
    the resuming run, the moments and step counts from the checkpoint. torch's load_state_dict alone keeps the
    checkpoint's lr_scale (muon_lr), betas, weight decay and momentum, so `--muon_lr=0.03` on resume changed
    nothing but the message."""
    from gptforge.train.runstate import load_optimizer_state

    model = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=1, n_head=2, n_embd=32))
    old = dict(optimizer="muon", muon_lr=0.05, muon_momentum=0.95, weight_decay=0.1, beta2=0.95)
    new = dict(optimizer="muon", muon_lr=0.03, muon_momentum=0.9, weight_decay=0.0, beta2=0.99)

    def optimizer(settings: dict) -> torch.optim.Optimizer:
        cfg = TrainConfig(**settings)
        return configure_optimizer(model, cfg.weight_decay, 1e-3, (0.9, cfg.beta2), "cpu", muon_settings(cfg))

    before = optimizer(old)
    x = torch.randint(0, 37, (2, 16))
    model(x, x)[1].backward()
    before.step()
    saved = before.state_dict()
    resumed = optimizer(new)
    load_optimizer_state(model, resumed, {"optimizer": saved}, fsdp=False, path="ckpt.pt")
    fresh = optimizer(new)
    for got, want in zip(resumed.param_groups, fresh.param_groups, strict=True):
        assert {k: v for k, v in got.items() if k != "params"} == {k: v for k, v in want.items() if k != "params"}
    muon = next(g for g in resumed.param_groups if g["kind"] == "muon")
    assert muon["lr_scale"] == pytest.approx(30.0) and muon["momentum"] == 0.9
    assert {g["betas"] for g in resumed.param_groups if g["kind"] == "adamw"} == {(0.9, 0.99)}
    for p in model.parameters():  # the moments are the checkpoint's
        for key, value in before.state[p].items():
            assert torch.equal(resumed.state[p][key], value), key


def test_a_split_qkv_step_orthogonalises_the_query_key_and_value_rows_each_alone():
    """muon_split_qkv: c_attn's gradient (3C x C) is three C x C matrices, each orthogonalised alone and stepped at
    a square matrix's scale (1), while the same step without the split orthogonalises the whole (scale sqrt 3).
    The reference is orthogonalize per block, and the blocks' result is near each block's SVD polar factor."""
    torch.manual_seed(0)
    c = 16
    grads = [torch.randn(3 * c, c) for _ in range(2)]
    for split in (True, False):
        w, v = torch.nn.Parameter(torch.randn(3 * c, c)), torch.nn.Parameter(torch.randn(c, c))
        start, other = w.detach().clone(), v.detach().clone()
        group = dict(params=[w, v], kind="muon", lr=0.05, momentum=0.95, momentum_warmup=300)
        opt = MuonAdamW([{**group, "row_blocks": [3, 1]} if split else group])
        buf, vbuf = torch.zeros(3 * c, c), torch.zeros(c, c)
        for step, grad in enumerate(grads, start=1):
            w.grad, v.grad = grad.clone(), grad[:c].clone()
            opt.step()
            momentum = 0.85 + min(step / 300, 1.0) * (0.95 - 0.85)
            buf, vbuf = momentum * buf + grad, momentum * vbuf + grad[:c]
            direction = grad + momentum * buf
            if split:
                update = torch.cat([orthogonalize(block) for block in direction.split(c)])
                assert (update[c : 2 * c] - polar(direction[c : 2 * c])).abs().max() < 0.35  # Muon's loose fit
            else:
                update = orthogonalize(direction) * 3**0.5
            start -= 0.05 * update
            other -= 0.05 * orthogonalize(grad[:c] + momentum * vbuf)  # the plain matrix beside it, unchanged
        torch.testing.assert_close(w.detach(), start, rtol=0, atol=1e-6)
        torch.testing.assert_close(v.detach(), other, rtol=0, atol=1e-6)


def neuron_reference(update: torch.Tensor, running: torch.Tensor, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon's normalisation written out in float64 for one matrix: its neurons are its rows when it is at least as
    tall as wide, else its columns; each divided by the root of the running mean of its squared entries, the matrix
    then scaled back to its Frobenius norm. Returns (the normalised update, the new running means)."""
    u = update.double() if update.size(0) >= update.size(1) else update.double().T  # neurons as rows
    running = beta2 * running + (1 - beta2) * (u * u).mean(dim=1)
    out = u / running.sqrt().unsqueeze(1)
    out = out * (u.norm() / out.norm())
    return (out if update.size(0) >= update.size(1) else out.T), running


@pytest.mark.parametrize("split", [False, True])
def test_a_normuon_step_normalises_each_neuron_as_a_float64_hand_computation(split):
    """Three Muon steps with normuon_beta2 against the same momentum and orthogonalize (float32, as the optimizer)
    followed by the normalisation in float64 (neuron_reference): a tall matrix (its rows), a wide one (its
    columns), and with row_blocks a fused 3C x C matrix as three square blocks whose rows are the neurons. The
    first step's update has every neuron of a matrix at the same size (the running mean is its own square then)."""
    torch.manual_seed(0)
    c, beta2 = 16, 0.95
    shapes = [(3 * c, c), (c, 3 * c)]
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]
    expected = [p.detach().double().clone() for p in params]
    group = dict(params=params, kind="muon", lr=0.05, momentum=0.95, momentum_warmup=300, normuon_beta2=beta2)
    opt = MuonAdamW([{**group, "row_blocks": [3, 1]} if split else group])
    bufs = [torch.zeros(*shape) for shape in shapes]
    running: list[torch.Tensor | None] = [None, None]
    for step in range(1, 4):
        grads = [torch.randn(*shape) for shape in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        momentum = 0.85 + min(step / 300, 1.0) * (0.95 - 0.85)
        for i, (g, (rows, cols)) in enumerate(zip(grads, shapes, strict=True)):
            bufs[i] = momentum * bufs[i] + g
            direction = g + momentum * bufs[i]
            blocks = 3 if split and i == 0 else 1
            ortho = torch.cat([orthogonalize(b) for b in direction.split(rows // blocks)])
            neurons = rows if rows // blocks >= cols else cols
            before = torch.zeros(neurons, dtype=torch.float64) if running[i] is None else running[i]
            update, running[i] = neuron_reference(ortho, before, beta2)
            if step == 1:  # every neuron the same size, the matrix's norm kept
                sizes = update.norm(dim=1 if update.size(0) >= update.size(1) else 0)
                torch.testing.assert_close(sizes, torch.full_like(sizes, sizes.mean().item()), rtol=1e-9, atol=0)
                torch.testing.assert_close(update.norm(), ortho.double().norm(), rtol=1e-9, atol=0)
            scale = max(1.0, rows / blocks / cols) ** 0.5
            expected[i] -= 0.05 * scale * update
            state = opt.state[params[i]][muon.NEURON_STATE]
            torch.testing.assert_close(state.double(), running[i], rtol=1e-5, atol=0)
        for p, e in zip(params, expected, strict=True):
            torch.testing.assert_close(p.detach().double(), e, rtol=0, atol=1e-6)


def test_normuon_keeps_an_all_zero_update_zero_and_a_run_resumed_without_it_drops_the_statistics():
    """zero_init's first steps give the matrices before a zero projection no gradient: their update stays zero (no
    0/0). A run resumed without normuon steps as plain Muon and keeps no statistics; with it again they restart."""
    from gptforge.train.runstate import load_optimizer_state

    w = torch.nn.Parameter(torch.randn(24, 8))
    opt = MuonAdamW([dict(params=[w], kind="muon", lr=0.05, momentum=0.95, momentum_warmup=300, normuon_beta2=0.95)])
    before = w.detach().clone()
    w.grad = torch.zeros_like(w)
    opt.step()
    assert torch.equal(w.detach(), before)
    assert torch.equal(opt.state[w][muon.NEURON_STATE], torch.zeros(24))
    model = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=1, n_head=2, n_embd=32))

    def optimizer(normuon: bool) -> torch.optim.Optimizer:
        cfg = TrainConfig(optimizer="muon", normuon=normuon)
        return configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon_settings(cfg))

    x = torch.randint(0, 37, (2, 16))
    saved = optimizer(True)
    model(x, x)[1].backward()
    saved.step()
    assert all(muon.NEURON_STATE in saved.state[p] for p in saved.param_groups[-1]["params"])
    plain = optimizer(False)
    load_optimizer_state(model, plain, {"optimizer": saved.state_dict()}, fsdp=False, path="x")
    assert "normuon_beta2" not in plain.param_groups[-1]
    plain.step()
    assert not any(muon.NEURON_STATE in plain.state[p] for p in plain.param_groups[-1]["params"])


def test_split_qkv_marks_the_attentions_fused_matrices_only():
    model = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=32))
    names = {id(p): n for n, p in model.named_parameters()}
    for split in (True, False):
        cfg = TrainConfig(optimizer="muon", muon_split_qkv=split)
        muon_group = configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon_settings(cfg)).param_groups[-1]
        if not split:
            assert "row_blocks" not in muon_group
            continue
        marked = {names[id(p)]: k for p, k in zip(muon_group["params"], muon_group["row_blocks"], strict=True)}
        assert {n for n, k in marked.items() if k == 3} == {f"transformer.h.{i}.attn.c_attn.weight" for i in (0, 1)}
        assert set(marked.values()) == {1, 3}
    with pytest.raises(ValueError, match="row_blocks"):
        MuonAdamW([dict(params=[torch.nn.Parameter(torch.randn(10, 4))], kind="muon", row_blocks=[3])])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_embedding_lr_scale_steps_the_embedding_as_adamw_at_that_multiple(optimizer):
    """The untied embedding in a group of its own at scale x the learning rate (the schedule keeps the ratio: the
    training loop sets each group's lr to lr x lr_scale), stepping as torch's AdamW at that rate; the head and
    the rest as before."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=1, n_head=2, n_embd=32, untie_head=True))
    cfg = TrainConfig(optimizer=optimizer, untie_head=True, embedding_lr_scale=10.0)
    opt = configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon_settings(cfg), cfg.embedding_lr_scale)
    wte, head = model.transformer.wte.weight, model.lm_head.weight
    (emb_group,) = [g for g in opt.param_groups if any(p is wte for p in g["params"])]
    assert emb_group["params"] == [wte] and emb_group["lr_scale"] == 10.0 and emb_group["weight_decay"] == 0.1
    assert not any(p is head for p in emb_group["params"])
    assert len(opt.param_groups) == (4 if optimizer == "muon" else 3) and opt.param_groups[2] is emb_group
    reference = wte.detach().clone().requires_grad_()
    theirs = torch.optim.AdamW([reference], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(3):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * group.get("lr_scale", 1.0)  # what the training loop does at every step
        x = torch.randint(0, 37, (2, 16))
        opt.zero_grad()
        model(x, x)[1].backward()
        reference.grad = wte.grad.clone()
        opt.step()
        theirs.step()
    torch.testing.assert_close(wte.detach(), reference.detach(), rtol=0, atol=1e-6)
    tied = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(UserError, match="tied to the output head"):
        configure_optimizer(tied, 0.1, 1e-3, (0.9, 0.95), "cpu", None, 10.0)


def test_a_run_resumed_without_split_qkv_orthogonalises_whole_matrices_again():
    from gptforge.train.runstate import load_optimizer_state

    model = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=1, n_head=2, n_embd=32))

    def optimizer(split: bool) -> torch.optim.Optimizer:
        cfg = TrainConfig(optimizer="muon", muon_split_qkv=split)
        return configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon_settings(cfg))

    for saved, now in ((True, False), (False, True)):
        resumed = optimizer(now)
        load_optimizer_state(model, resumed, {"optimizer": optimizer(saved).state_dict()}, fsdp=False, path="x")
        assert ("row_blocks" in resumed.param_groups[-1]) == now


def test_bench_refuses_a_scaled_embedding_tied_to_the_head(char_data, tmp_path):
    """bench builds its optimizer without `gptforge train`'s setup: the same refusal, exit 2, no traceback."""
    from conftest import run_cli
    from test_time_to_loss import config_file

    config = config_file(tmp_path / "tied.py", char_data, max_iters=2)
    r = run_cli("bench", str(config), "--embedding_lr_scale=2.0", "--iters=1", "--warmup=0", "--rounds=1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--embedding_lr_scale=2.0: the embedding is tied to the output head" in r.stderr

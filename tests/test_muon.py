"""optimizer='muon': the Newton-Schulz iteration against the SVD's polar factor, MuonAdamW's two kinds of step
against a hand computation and torch's AdamW, and a resumed Muon run equal to an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import whole_and_resumed
from gptforge.core.config import TrainConfig
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.muon import CUBIC, MuonAdamW, orthogonalize
from gptforge.model.optim import configure_optimizer, muon_settings


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
    assert configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon_settings(TrainConfig())).__class__ is (
        torch.optim.AdamW
    )


def test_a_resumed_muon_run_equals_an_uninterrupted_one(char_data, tmp_path):
    run = dict(max_iters=12, lr_decay_iters=12, warmup_iters=3, eval_interval=6, optimizer="muon", muon_warmup=5)
    whole, split = tmp_path / "whole", tmp_path / "split"
    a, _ = whole_and_resumed(char_data, tmp_path, run)
    kinds = {g["kind"] for g in a["optimizer"]["param_groups"]}
    assert kinds == {"muon", "adamw"}
    assert (whole / "log.txt").read_text() == (split / "log.txt").read_text()
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    evals = [row["val_loss"] for row in rows if row["kind"] == "eval"]
    assert len(evals) == 3 and evals[0] > evals[1] > evals[2] and evals[2] < evals[0] - 0.3, evals  # it learns

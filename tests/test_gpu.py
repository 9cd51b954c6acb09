"""On a CUDA GPU (`pytest -m gpu`; skipped where there is none): the modern recipe's switches and Muon with bf16
autocast and torch.compile against a CPU float32 run, Muon's iteration on the GPU against the SVD, a resumed Muon
run and a kill -9 campaign equal to an uninterrupted run, and KV-cache generation with rotary equal to recomputation."""

from __future__ import annotations

import pytest
import torch

from campaign_tools import run_campaign
from conftest import run_cli, tiny_train_args, whole_and_resumed
from gptforge.infer.engine import generate
from gptforge.model.muon import orthogonalize
from gptforge.weights.checkpoint import load_checkpoint
from test_faults import check_campaign
from test_modern import ALL_ON, tiny
from test_train import records

pytestmark = pytest.mark.gpu

MODERN = {**ALL_ON, "optimizer": "muon", "muon_warmup": 5}
NORMUON = {**MODERN, "normuon": True}  # the speedrun configs' optimizer: Muon with its per-neuron statistics


def val_losses(out_dir) -> list[float]:
    return [row["val_loss"] for row in records(out_dir, "eval")]


def test_the_modern_recipe_with_bf16_and_compile_learns_as_on_the_cpu(char_data, tmp_path):
    run = dict(**NORMUON, max_iters=30, lr_decay_iters=30, eval_interval=10)
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    r = run_cli("train", *tiny_train_args(char_data, gpu, **run, device="cuda", dtype="bfloat16", compile=True))
    assert r.returncode == 0, r.stderr
    assert "dtype bfloat16" in r.stdout, r.stdout
    r = run_cli("train", *tiny_train_args(char_data, cpu, **run))
    assert r.returncode == 0, r.stderr
    on_gpu, on_cpu = val_losses(gpu), val_losses(cpu)
    assert on_gpu[-1] < on_gpu[0] - 0.5, on_gpu  # it learns
    assert on_gpu[-1] == pytest.approx(on_cpu[-1], abs=0.1), (on_gpu, on_cpu)
    ckpt = load_checkpoint(str(gpu / "ckpt.pt"))
    assert ckpt["config"]["compile"] is True and {g["kind"] for g in ckpt["optimizer"]["param_groups"]} == {
        "muon",
        "adamw",
    }


@pytest.mark.parametrize("shape", [(768, 3072), (3072, 768), (768, 2304)])
def test_the_iteration_on_the_gpu_keeps_the_svds_singular_vectors(shape):
    """GPT-2 124M's matrix shapes: in the SVD's basis (computed in float64) the update is diagonal, near 1."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0)).cuda()
    x = orthogonalize(g).double()
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    inner = u.T @ x @ vh.T
    diagonal = torch.diagonal(inner)
    assert (inner - torch.diag(diagonal)).abs().max() < 5e-3
    assert diagonal.min() > 0.5 and diagonal.max() < 1.3, diagonal


@pytest.mark.parametrize("optimizer", [MODERN, NORMUON], ids=["muon", "normuon"])
def test_a_resumed_muon_run_on_the_gpu_equals_an_uninterrupted_one(char_data, tmp_path, optimizer):
    run = dict(**optimizer, device="cuda", max_iters=12, lr_decay_iters=12, warmup_iters=3, eval_interval=6)
    a, _ = whole_and_resumed(char_data, tmp_path, run)  # asserts the weights equal
    assert a["config"]["device"] == "cuda"
    assert (tmp_path / "whole/log.txt").read_text() == (tmp_path / "split/log.txt").read_text()


def test_generation_with_the_cache_equals_recomputation_on_the_gpu():
    model = tiny(**{**ALL_ON, "zero_init": False}).cuda().eval()
    prompt = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(4)).cuda()
    cached = generate(model, prompt, 40, temperature=0, use_cache=True)
    plain = generate(model, prompt, 40, temperature=0, use_cache=False)
    assert torch.equal(cached, plain)


def test_kill_9_campaign_on_the_gpu_with_every_switch_and_muon(char_data, tmp_path):
    """SIGKILLs at start-up, mid-step and in checkpoint writes of a CUDA run: the final weights, Muon's momenta,
    NorMuon's statistics and the losses equal an uninterrupted CUDA run's exactly."""
    figures = run_campaign(char_data, tmp_path / "campaign", kills=3, seed=5, max_iters=24, device="cuda", **NORMUON)
    check_campaign(figures, 3)

"""The modern recipe's switches and Muon with the rest of gptforge: kill -9 and resume bit-identically, gradient
accumulation and bf16 autocast, `eval loss`, `eval hellaswag`, `bench`, and torch.compile (equal to eager).
DDP and FSDP with them: tests/test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from campaign_tools import run_campaign
from conftest import run_cli, tiny_train_args, train_in_process
from test_faults import check_campaign
from test_modern import ALL_ON, tiny, traced_graphs

MODERN = {**ALL_ON, "optimizer": "muon", "muon_warmup": 5}


def test_kill_9_campaign_with_every_switch_and_muon(char_data, tmp_path):
    """SIGKILLs at start-up, mid-step and in checkpoint writes: the final weights, Muon's momenta and the losses
    equal an uninterrupted run's exactly."""
    figures = run_campaign(char_data, tmp_path / "campaign", kills=4, seed=2, max_iters=24, **MODERN)
    check_campaign(figures, 4)


def test_accumulation_bf16_eval_loss_and_bench_with_every_switch(char_data, tmp_path):
    out = tmp_path / "run"
    args = tiny_train_args(
        char_data, out, **MODERN, gradient_accumulation_steps=2, dtype="bfloat16", max_iters=4, eval_interval=2
    )
    r = run_cli("train", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "dtype bfloat16" in r.stdout and "2 accumulation" in r.stdout
    r = run_cli("eval", "loss", f"--out_dir={out}", "--eval_iters=2", "--split=both", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sorted(line.split()[0] for line in lines) == ["train", "val"] and all(" loss " in x for x in lines)
    bench = [a for a in args if not a.startswith(("--out_dir", "--max_iters", "--eval"))]
    r = run_cli("bench", *bench, "--iters=1", "--rounds=1", "--warmup=1", "--dtype=float32", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" default:") and "ms/iter" in r.stdout


def test_hellaswag_scores_a_model_with_every_switch(bpe_data, hellaswag_path, tmp_path):
    out = tmp_path / "bpe-run"
    train_in_process(*tiny_train_args(bpe_data, out, dataset="bpe", **MODERN, max_iters=2, eval_interval=2))
    r = run_cli(
        "eval", "hellaswag", f"--out_dir={out}", "--limit=4", f"--hellaswag_path={hellaswag_path}", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hellaswag: 4 examples, acc ")


PACKED = torch.tensor([list(range(20)) + list(range(12)), list(range(32))])  # two documents in the first row


@pytest.mark.slow
@pytest.mark.parametrize(
    ("switches", "positions"),
    [
        (ALL_ON, None),
        (ALL_ON, PACKED),  # the angles of (B, T) positions, (B, 1, T, hs / 2), and a document mask
        ({**ALL_ON, "qk_norm": False}, None),  # rotary alone
        ({**ALL_ON, "rotary": False}, None),  # qk-norm alone
    ],
    ids=["every-switch", "packed-positions", "rotary-alone", "qk-norm-alone"],
)
def test_compile_equals_eager_with_every_switch(switches, positions):
    """Under torch.compile q and k are rotated and normalised before the heads move (gpt.heads_second), eagerly
    after: the loss and every gradient agree."""
    torch._dynamo.reset()
    model = tiny(**{**switches, "zero_init": False})
    compiled = torch.compile(tiny(**{**switches, "zero_init": False}))
    idx = torch.randint(0, 37, (2, 32), generator=torch.Generator().manual_seed(8))
    eager_loss = model(idx, idx, positions=positions)[1]
    compiled_loss = compiled(idx, idx, positions=positions)[1]
    eager_loss.backward()
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=1e-5)
    for (name, a), b in zip(model.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-5, msg=name)


def test_compiled_attention_takes_views_of_c_attn_in_its_own_order():
    """Under torch.compile attention's q, k and v are (B, nh, T, hs) views of (B, T, nh, hs) tensors (heads
    adjacent in memory): rotated and normalised before the heads move, so their gradients come back in c_attn's order,
    with no copy that transposes them (on an H100 such a copy took ~5% of GPT-2's step). Read from the strides of
    the traced graph's example values."""
    idx = torch.randint(0, 37, (2, 32), generator=torch.Generator().manual_seed(3))
    graphs = traced_graphs(tiny(**ALL_ON), idx, idx)  # n_head 2, n_embd 32: hs 16
    seen = [
        [arg.meta["example_value"].stride() for arg in node.args[:3]]
        for graph in graphs
        for node in graph.graph.nodes
        if node.target is torch.nn.functional.scaled_dot_product_attention
    ]
    assert len(seen) == 2  # one per layer
    # q and k: the rotation's (B, T, nh, hs) outputs; v: c_attn's own (B, T, 3 C) output, sliced
    assert all(strides == [(32 * 32, 16, 32, 1)] * 2 + [(32 * 96, 16, 96, 1)] for strides in seen), seen

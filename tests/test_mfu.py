"""MFU, one definition for train, bench and the dashboard: model FLOPs per second over the peak of the dtype the
step runs in on this device. On a real run against the measured ceiling it stays a fraction."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli, tiny_train_args


def test_mfu_of_a_real_run_against_the_measured_ceiling_stays_within_0_and_1(char_data, tmp_path):
    """The README CPU recipe's model (4 x 128, block 64, batch 12), peak_flops=0: the ceiling is measured."""
    out = tmp_path / "run"
    shape = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, max_iters=20, lr_decay_iters=20)
    r = run_cli("train", *tiny_train_args(char_data, out, **shape, eval_interval=20, peak_flops=0))
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mfus = [rec["mfu"] for rec in records if rec["kind"] == "train" and rec["mfu"] is not None]
    assert len(mfus) >= 10  # from step 5 on (the first steps are warm-up)
    assert all(0 < mfu <= 1 for mfu in mfus), mfus


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
        ("NVIDIA H200", "bfloat16", 989e12),
        ("NVIDIA H200", "float32", 494e12),
    ],
)
def test_a_known_gpu_is_measured_against_its_data_sheet_peak(monkeypatch, name, dtype, peak):
    """MFU on a GPU is against the data sheet's dense peak, not the 2048-wide probe (which read ~280-385 TFLOP/s of
    bf16 on an H200): the H200 has the H100's tensor cores."""
    from gptforge.core import device

    monkeypatch.setattr(device.torch.cuda, "get_device_name", lambda _device=None: name)
    monkeypatch.setattr(device, "measure_matmul_flops", lambda *a, **k: pytest.fail("measured a known GPU"))
    assert device.peak_flops("cuda:0", dtype) == peak

"""MFU, one definition for train, bench and the dashboard: model FLOPs per second over the peak of the dtype the
step runs in on this device. On a real run against the measured ceiling it stays a fraction."""

from __future__ import annotations

import json

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

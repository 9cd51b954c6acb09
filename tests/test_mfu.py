"""MFU, one definition for train, bench and the dashboard: model FLOPs per second over the machine's fastest product
ceiling, whatever format the step runs in. On a real run against the measured ceiling it stays a fraction."""

from __future__ import annotations

import json

import pytest

from conftest import kept_rates, run_cli, tiny_train_args


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
    "name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("Tesla V100-SXM2-16GB", 125e12)]
)
def test_a_known_gpu_is_measured_against_its_data_sheet_peak(monkeypatch, name, peak):
    """MFU on a GPU is against the data sheet's fastest dense peak (bf16, or fp16 on a V100), a float32 (TF32) run
    too, not the 2048-wide probe (which read ~280-385 TFLOP/s of bf16 on an H200): the H200 has the H100's tensor
    cores."""
    from gptforge.core import device

    monkeypatch.setattr(device.torch.cuda, "get_device_name", lambda _device=None: name)
    monkeypatch.setattr(device, "measure_matmul_flops", lambda *a, **k: pytest.fail("measured a known GPU"))
    assert device.peak_flops("cuda:0") == peak


@pytest.mark.parametrize("bf16, measured", [(6e11, ["float32", "bfloat16"]), (3e9, ["float32"])])
def test_a_cpu_run_is_measured_against_the_fastest_ceiling(monkeypatch, tmp_path, bf16, measured):
    """On a CPU the best of the float32 and bfloat16 ceilings, whichever the run multiplies in; bfloat16's not measured
    where the probe finds it emulated (its 2048-wide product would only cost time)."""
    from gptforge.core import device

    kept_rates(monkeypatch, tmp_path, float32=1.6e11, bfloat16=bf16)
    ceilings = {"float32": 1.7e11, "bfloat16": 4.1e11}
    asked = []
    monkeypatch.setattr(device, "measure_matmul_flops", lambda _d, dtype: asked.append(dtype) or ceilings[dtype])
    assert device.peak_flops("cpu") == max(ceilings[d] for d in measured) and asked == measured
    assert device.peak_flops("cpu", measured={"float32": 1e11, "bfloat16": 3e11}) == 3e11
    assert device.peak_flops("cpu", configured=5e10) == 5e10


def test_a_cpu_ceiling_narrows_the_measured_product_where_the_probe_is_slow(monkeypatch):
    """On a CPU the 256-wide probe decides the measured width: at a float32 rate (0.3 ms) the full 2048, where bf16
    is emulated (11 ms for the probe: ~3 GFLOP/s, 5.6 s for one 2048-wide product) 512, and at a minute per
    2048-wide product (0.2 s for the probe) the probe's own width. The FLOP/s returned are the measured width's."""
    from gptforge.core import cpu as device

    for probe_seconds, width in ((0.0003, 2048), (0.011, 512), (0.2, 256)):
        widths = []

        def seconds(_device, _dtype, n, reps, probe=probe_seconds, widths=widths):
            widths.append(n)
            return probe * (n / device.PROBE_N) ** 3

        monkeypatch.setattr(device, "product_seconds", seconds)
        flops = device.measure_matmul_flops("cpu", "bfloat16")
        assert widths == [device.PROBE_N, width]
        assert flops == pytest.approx(2 * device.PROBE_N**3 / probe_seconds)
    assert device.affordable_width(2048, 256, 0.0) == 2048
    assert device.affordable_width(2048, 256, 60.0) == 256  # the probe's width, however slow

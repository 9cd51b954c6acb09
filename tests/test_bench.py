"""`gptforge bench`: the command's contract and the consistency of its figures (not a speed test)."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

TINY = [
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=16",
    "--batch_size=4",
    "--device=cpu",
    "--dataset=tiny_char",
    "--gradient_accumulation_steps=2",
    "--compile=False",
]


def test_bench_json_contract_and_consistent_figures(tmp_path):
    r = run_cli(
        "bench",
        *TINY,
        "--compare",
        "--json",
        "--iters=3",
        "--warmup=1",
        "--rounds=2",
        "--generation",
        "--tokenizers",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object on stdout
    tokens_per_iter = 2 * 4 * 16
    for mode in ("default", "baseline"):
        m = out[mode]
        assert set(m) >= {"ms_per_iter", "tokens_per_s", "mfu", "peak_mem_bytes"}
        assert m["ms_per_iter"] > 0 and 0 < m["mfu"] < 1 and m["peak_mem_bytes"] > 10 * 2**20
        assert m["tokens_per_s"] == pytest.approx(tokens_per_iter / (m["ms_per_iter"] / 1000), rel=1e-9)
        # train's definition: model FLOPs per second over the ceiling of the dtype the mode runs in
        assert m["mfu"] == pytest.approx(m["achieved_flops"] / m["peak_flops"], rel=1e-9) and m["peak_flops"] > 1e9
    assert out["baseline"]["dtype"] == "float32" and out["baseline"]["compile"] is False
    assert out["speedup"] == pytest.approx(out["default"]["tokens_per_s"] / out["baseline"]["tokens_per_s"])
    peaks = out["device"]["matmul_ceiling_flops"]
    assert out["device"]["peak_flops"] == out["default"]["peak_flops"] and peaks["float32"] > 1e9
    g = out["generation"]
    assert g["cached"]["tokens_per_s"] > 0 and g["uncached"]["tokens_per_s"] > 0
    assert g["cache_speedup"] == pytest.approx(g["cached"]["tokens_per_s"] / g["uncached"]["tokens_per_s"])
    assert out["tokenizers"]["char"]["tokens_per_s"] > 0 and out["tokenizers"]["gpt2"]["tokens"] > 0
    assert "round 2/2 baseline" in r.stderr  # progress goes to stderr


def test_bench_without_compare_and_with_given_peak(tmp_path):
    r = run_cli("bench", *TINY, "--json", "--iters=2", "--warmup=0", "--rounds=1", "--peak_flops=1e9", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "baseline" not in out and "speedup" not in out
    m = out["default"]
    # MFU = model FLOPs per second / the given peak
    assert m["mfu"] == pytest.approx(m["achieved_flops"] / 1e9, rel=1e-9)


def test_bench_table_and_errors(tmp_path):
    r = run_cli("bench", *TINY, "--iters=1", "--warmup=0", "--rounds=1", cwd=tmp_path)
    assert r.returncode == 0 and "ms/iter" in r.stdout and "tok/s" in r.stdout
    r = run_cli("bench", *TINY, "--iters=many", cwd=tmp_path)
    assert r.returncode == 2 and "argument --iters: invalid int value: 'many'" in r.stderr
    r = run_cli("bench", "--help")
    assert r.returncode == 0 and "--compare" in r.stdout


def test_compare_names_its_baseline_and_warns_that_muon_steps_are_not_time_to_quality(tmp_path):
    r = run_cli("bench", *TINY, "--optimizer=muon", "--compare", "--iters=1", "--warmup=0", "--rounds=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    flat = " ".join(r.stdout.split())
    assert "over the baseline (float32, eager, nanoGPT's AdamW and torch's dropout" in flat
    assert "per-step speed is not time to quality; compare that with --target_loss" in flat
    r = run_cli("bench", "--help", cwd=tmp_path)
    assert "With --target_loss: time to quality" in " ".join(r.stdout.split())

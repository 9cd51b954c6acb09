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
        # train's definition: model FLOPs per second over the machine's fastest ceiling, whatever the mode runs in
        assert m["mfu"] == pytest.approx(m["achieved_flops"] / m["peak_flops"], rel=1e-9) and m["peak_flops"] > 1e9
    assert out["baseline"]["dtype"] == "float32" and out["baseline"]["compile"] is False
    assert out["speedup"] == pytest.approx(out["default"]["tokens_per_s"] / out["baseline"]["tokens_per_s"])
    peaks = out["device"]["matmul_ceiling_flops"]
    assert out["device"]["peak_flops"] == out["default"]["peak_flops"] and peaks["float32"] > 1e9
    assert out["default"]["peak_flops"] == out["baseline"]["peak_flops"] == max(peaks.values())
    # the ceilings: sampled after each of the 2 rounds, the best sample counts; bfloat16's unless the probe finds it
    # emulated or slow (under half float32's rate)
    samples, rates = out["device"]["matmul_ceiling_samples"], out["device"]["cpu_product_rates"]
    sampled = ["float32", "bfloat16"] if rates["bfloat16"] >= 0.5 * rates["float32"] else ["float32"]
    assert {k: len(v) for k, v in samples.items()} == dict.fromkeys(sampled, 2)
    assert peaks == {k: max(v) for k, v in samples.items()}
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
    assert "GFLOP/s (the best of 1 measured between the rounds: float32 " in r.stdout
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


def test_profile_sums_one_more_step_by_kind(tmp_path):
    """--profile: one step after the timed ones under torch.profiler; every operator counted once, in one kind."""
    r = run_cli("bench", *TINY, "--profile", "--json", "--iters=1", "--warmup=1", "--rounds=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["profile"]
    assert p["device"] == "cpu" and 0 < p["total_ms"] <= p["wall_ms"] * 1.1
    assert sum(p["kinds"].values()) == pytest.approx(p["total_ms"], rel=1e-9)
    names = [name for name, _, _ in p["top"]]
    assert "aten::mm" in names and p["kinds"]["matmul"] > 0
    assert all(calls >= 1 and ms >= 0 for _, ms, calls in p["top"])
    r = run_cli("bench", *TINY, "--profile", "--iters=1", "--warmup=0", "--rounds=1", cwd=tmp_path)
    assert r.returncode == 0 and "profile of one more step" in r.stdout and "matmul" in r.stdout, r.stderr
    r = run_cli("bench", *TINY, "--profile", "--target_loss=2.0", cwd=tmp_path)
    assert r.returncode == 2 and "--profile profiles one training step" in r.stderr, r.stderr


def test_profile_kinds_of_the_kernels_an_h200_ran():
    """Kernel names seen in a GPT-2 124M step on an H200 (torch 2.11, compile, bf16; docs/PERFORMANCE.md), cut
    short, each in the kind a reader expects."""
    from gptforge.bench.profile import GPU_KINDS, summarize

    seen = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_splitK_NTN": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*)": "attention",
        "triton_red_fused__log_softmax__log_softmax_backward_data__to_copy_add_arange_eq_expand_nll": "loss (softmax)",
        "triton_poi_fused_gelu_gelu_backward_view_6": "fused (inductor)",
        "triton_per_fused__fused_rms_norm__to_copy__unsafe_view_add_arange_cat_cos_div_mul": "fused (inductor)",
        "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>>": "copy / fill",
    }
    assert_each_in_its_kind(seen, GPU_KINDS, "cuda:0")
    both = summarize({n: [1.0, 1] for n in seen}, GPU_KINDS, 20.0, "cuda:0")
    assert both["total_ms"] == len(seen) and sum(both["kinds"].values()) == len(seen)
    assert both["kinds"]["matmul"] == 2.0 and both["kinds"]["attention"] == 2.0


def test_profile_kinds_of_a_cpu_steps_operators():
    """Operators seen in CPU steps (the baby speedrun in bf16 and in float32 with onednn_f32), each in the kind a
    reader expects: the attention's in-place batched products and oneDNN's float32 Linear are products too; the
    attention's softmax is the attention's, the loss's log-softmax the loss's."""
    from gptforge.bench.profile import CPU_KINDS

    seen = {
        "aten::mm": "matmul",
        "aten::baddbmm_": "matmul",
        "aten::addmm_": "matmul",
        "mkldnn::_linear_pointwise": "matmul",
        "aten::bmm": "matmul",
        "CausalBlocksBackward": "attention",
        "aten::_softmax": "attention",
        "aten::_softmax_backward_data": "attention",
        "aten::_log_softmax": "loss (softmax)",
        "aten::_log_softmax_backward_data": "loss (softmax)",
        "aten::nll_loss_forward": "loss (softmax)",
        "HeadLossBackward": "loss (softmax)",
        "aten::copy_": "copy / cast",
        "aten::mul_": "other",
        "aten::addcmul_": "other",
    }
    assert_each_in_its_kind(seen, CPU_KINDS, "cpu")


def assert_each_in_its_kind(seen: dict[str, str], kinds: list[tuple[str, str]], device: str) -> None:
    """Each name of `seen`, profiled alone, is summed under the kind `seen` gives it, and only there."""
    from gptforge.bench.profile import summarize

    for name, kind in seen.items():
        result = summarize({name: [2.0, 3]}, kinds, 5.0, device)
        assert result["kinds"] == {kind: 2.0}, (name, result["kinds"])

"""dtype='auto' and muon_dtype='auto' on a CPU decide by the product rates the machine measures, not by its flags:
train, bench, sample, chat, serve and Muon, each through the real CLI. oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA) has
no bf16 kernels on any x86-64 CPU, which makes bf16 products slow on every machine; the machine's own oneDNN shows
the other side where its bf16 products are faster (and checks consistency with its own rates where they are not).
The rates are measured once into a fresh $GPTFORGE_CACHE_DIR, then read back by every later command."""

from __future__ import annotations

import json
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli, tiny_train_args

X86 = platform.machine().lower() in ("x86_64", "amd64")
REASON = re.compile(r"\(auto: bfloat16 products ([\d.,]+) GFLOP/s a core against float32's ([\d.,]+)\)")
WIDE = dict(n_layer=1, n_head=2, n_embd=256, block_size=16, batch_size=4, max_iters=2, eval_interval=2, eval_iters=1)


def said_rates(text: str) -> tuple[float, float]:
    """(bfloat16, float32) GFLOP/s from the line that names an automatic choice."""
    found = REASON.search(text)
    assert found, text
    return tuple(float(rate.replace(",", "")) for rate in found.groups())


def kept(cache: Path, held: bool) -> dict[str, float]:
    """The one entry of product_rates.json: measured once, by the first command."""
    machines = json.loads((cache / "product_rates.json").read_text())["machines"]
    assert len(machines) == 1 and list(machines)[0].endswith(f"ONEDNN_MAX_CPU_ISA={'AVX2' if held else ''}")
    return next(iter(machines.values()))


def serve_says(run: Path, env: dict) -> str:
    """What `gptforge serve` prints until it serves (the dtype line comes with the model's load), then Ctrl-C."""
    cmd = [sys.executable, "-m", "gptforge", "serve", f"--out_dir={run}", "--port=0", "--device=cpu", "--compile=off"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if not line or "serving on" in line:
            break
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    return "".join(lines)


@pytest.mark.parametrize("held", [pytest.param(True, marks=pytest.mark.skipif(not X86, reason="x86-64")), False])
def test_auto_picks_the_format_whose_products_measure_faster(char_data, tmp_path, held):
    import os

    cache = tmp_path / "cache"
    env = {"GPTFORGE_CACHE_DIR": str(cache), **({"ONEDNN_MAX_CPU_ISA": "AVX2"} if held else {})}
    run = tmp_path / "run"
    args = tiny_train_args(char_data, run, dtype="auto", optimizer="muon", muon_dtype="auto", **WIDE)
    trained = run_cli("train", *args, env=env)
    assert trained.returncode == 0, trained.stderr
    rates = kept(cache, held)
    half, single = said_rates(trained.stdout)
    assert (half, single) == (round(rates["bfloat16"] / 1e9, 1), round(rates["float32"] / 1e9, 1))
    faster = "bfloat16" if rates["bfloat16"] >= 1.25 * rates["float32"] else "float32"
    if held:
        assert rates["bfloat16"] < 0.5 * rates["float32"] and faster == "float32"
    assert f"dtype {faster} (auto: " in trained.stdout and f"Newton-Schulz in {faster}" in trained.stdout
    assert json.loads((run / "config.json").read_text())["dtype"] == faster
    full_env = {**os.environ, **env}
    for command in (
        ("sample", "--num_samples=1", "--max_new_tokens=2", "--start=a"),
        ("chat", "-p", "a", "--max_new_tokens=2"),
    ):
        used = run_cli(*command, f"--out_dir={run}", "--device=cpu", env=env)
        assert used.returncode == 0, used.stderr
        assert said_rates(used.stderr) == (half, single) and f"dtype {faster} (auto: " in used.stderr, used.stderr
    assert f"dtype {faster} (auto: " in serve_says(run, full_env)
    bench = run_cli("bench", *(f"--{k}={v}" for k, v in WIDE.items() if k in ("n_layer", "n_head", "n_embd")),
                    "--block_size=16", "--batch_size=2", "--device=cpu", "--compile=False", "--dataset=tiny_char",
                    "--iters=1", "--warmup=0", "--rounds=1", "--json", cwd=tmp_path, env=env)  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    out = json.loads(bench.stdout)
    assert out["default"]["dtype"] == faster and out["device"]["cpu_product_rates"] == {
        k: rates[k] for k in ("float32", "bfloat16")
    }
    assert out["default"]["peak_flops"] == max(out["device"]["matmul_ceiling_flops"].values())
    if held:  # emulated: its 2048-wide ceiling is not worth measuring, and MFU is against float32's
        assert list(out["device"]["matmul_ceiling_flops"]) == ["float32"]


def test_rates_read_from_one_cache_folder_stay_with_it(tmp_path, monkeypatch):
    """The process's memo of kept rates is per file: rates read (or measured) under one GPTFORGE_CACHE_DIR are not
    what another folder's file holds, and nothing measured later writes one folder's rates into the other's file."""
    from conftest import kept_rates
    from gptforge.core import cpu

    kept_rates(monkeypatch, tmp_path / "a", float32=1.6e11, bfloat16=2e9)
    assert not cpu.half_pays()
    kept_rates(monkeypatch, tmp_path / "b", float32=1.6e11, bfloat16=6e11)
    assert cpu.half_pays() and cpu.cpu_product_rates()["float32"] == 1.6e11
    monkeypatch.setenv("GPTFORGE_CACHE_DIR", str(tmp_path / "a"))
    assert not cpu.half_pays()
    assert json.loads((tmp_path / "b" / cpu.RATES_FILE).read_text())["machines"][cpu.machine_key()]["bfloat16"] == 6e11

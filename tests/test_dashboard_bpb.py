"""The dashboard's loss / bits-per-byte toggle in a real browser (issue 26): with it on, the loss chart draws each
evaluation's train_bpb and val_bpb, its axis and title say so, the card shows val bpb, and the choice lives in the
page's address; off again, the losses come back. Skips as test_dashboard_browser does without Chromium."""

from __future__ import annotations

import json
import math

import pytest

from test_dashboard import write_run
from test_dashboard_browser import need_browser, page_at

LOSS_TRACES = """id => Object.fromEntries((document.getElementById('chart-loss').data || [])
    .filter(t => t.legendgroup === id).map(t => [t.name, {x: Array.from(t.x), y: Array.from(t.y)}]))"""


def test_the_loss_chart_toggles_to_bits_per_byte(tmp_path, dashboard):
    need_browser()
    run = write_run(tmp_path / "own", 40, max_iters=100, eval_every=10)
    lines = []  # the evaluations carry bits per byte, as train writes them (3.2 bytes per token)
    for raw in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(raw)
        if record["kind"] == "eval":
            for split in ("train", "val"):
                record[f"{split}_bpb"] = record[f"{split}_loss"] / (math.log(2) * 3.2)
        lines.append(json.dumps(record) + "\n")
    (run / "metrics.jsonl").write_text("".join(lines))
    evals = [json.loads(x) for x in lines if '"eval"' in x]
    url = dashboard(tmp_path)
    with page_at(url + "#runs=own") as page:
        page.wait_for_function(f"() => Object.keys(({LOSS_TRACES})('own')).length >= 2", timeout=15_000)
        assert page.evaluate(f"({LOSS_TRACES})('own')")["own val"]["y"] == pytest.approx([e["val_loss"] for e in evals])
        assert page.locator("#loss-title").inner_text() == "Loss"

        page.check("#bpb")
        page.wait_for_function("() => document.getElementById('loss-title').textContent === 'Bits per byte'")
        traces = page.evaluate(f"({LOSS_TRACES})('own')")
        assert set(traces) == {"own train", "own val"}
        assert traces["own val"]["x"] == [e["step"] for e in evals] == traces["own train"]["x"]
        assert traces["own val"]["y"] == pytest.approx([e["val_bpb"] for e in evals])
        assert traces["own train"]["y"] == pytest.approx([e["train_bpb"] for e in evals])
        layout = page.evaluate("() => document.getElementById('chart-loss').layout.yaxis.title.text")
        assert layout == "bits per byte" and "bpb=1" in page.evaluate("() => location.hash")
        stats = page.locator(".card[data-id='own'] .stats").text_content()
        assert f"val bpb{evals[-1]['val_bpb']:.4f}" in stats
        assert f"best val bpb{min(e['val_bpb'] for e in evals):.4f}" in stats

        page.uncheck("#bpb")
        page.wait_for_function("() => document.getElementById('loss-title').textContent === 'Loss'")
        traces = page.evaluate(f"({LOSS_TRACES})('own')")
        assert traces["own val"]["y"] == pytest.approx([e["val_loss"] for e in evals])
        assert len(traces["own train"]["x"]) == 40  # every train step again
    with page_at(url + "#runs=own&bpb=1") as page:  # the address keeps the choice
        page.wait_for_function("() => document.getElementById('loss-title').textContent === 'Bits per byte'")
        assert page.is_checked("#bpb")

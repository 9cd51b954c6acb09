"""The dashboard page in a real browser: Debian's Chromium driven by playwright (skips without them, fails
instead with GPTFORGE_REQUIRE_BROWSER=1). Run folders come from a live `gptforge train` or are written by hand."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, tiny_train_args
from gptforge.dashboard.server import start_dashboard
from test_dashboard import skip_line, write_run

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def need_browser():
    """playwright's sync API, or skip (fail with GPTFORGE_REQUIRE_BROWSER=1) when it or Chromium is missing."""
    problem = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        problem, sync_playwright = "playwright is not installed (pip install -e '.[test]')", None
    if problem is None and not os.access(CHROMIUM, os.X_OK):
        problem = f"{CHROMIUM} is missing (apt-get install chromium; `make test` does it)"
    if problem:
        if os.environ.get("GPTFORGE_REQUIRE_BROWSER") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return sync_playwright


@contextlib.contextmanager
def page_at(url: str):
    """A headless Chromium page opened at `url`; the block must leave no script error and no console error."""
    sync_playwright = need_browser()
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(url)
            yield page
        finally:
            browser.close()
    assert not errors, errors


def wait_for_lines(path: Path, kind: str, count: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count(f'"kind": "{kind}"') >= count:
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"training exited early: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.1)
    raise AssertionError(f"{path}: fewer than {count} {kind} lines after {timeout} s")


TRAIN_POINTS = """name => {
    const div = document.getElementById('chart-loss');
    const t = (div && div.data || []).find(t => t.name === name + ' train');
    return t ? t.x.length : 0;
}"""


def test_page_follows_a_live_training_run_and_compares_runs(tmp_path, char_data):
    sync_playwright = need_browser()
    runs = tmp_path / "runs"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }

    def train(name: str, max_iters: int, **kw) -> subprocess.Popen:
        args = tiny_train_args(char_data, runs / name, max_iters=max_iters, lr_decay_iters=max_iters, **kw)
        return subprocess.Popen(
            [sys.executable, "-m", "gptforge", "train", *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    short = train("short", 60, eval_interval=20)  # finishes first: the run to compare with
    live = train("live", 5000, eval_interval=50, learning_rate=1e-3)  # still writing while the page watches
    errors: list[str] = []
    try:
        wait_for_lines(runs / "live" / "metrics.jsonl", "train", 5, timeout=60, proc=live)
        server, url = start_dashboard([runs], port=0)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1440, "height": 1000})
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.goto(url)
                page.wait_for_selector("li.run[data-id='live']", timeout=15_000)
                page.click("li.run[data-id='live'] .name")  # show this run alone
                page.wait_for_function(f"() => ({TRAIN_POINTS})('live') > 0", timeout=15_000)
                first = page.evaluate(f"({TRAIN_POINTS})('live')")
                # no reload: the page polls and the trace gains the lines written since
                page.wait_for_function(f"() => ({TRAIN_POINTS})('live') >= {first + 20}", timeout=20_000)
                assert page.locator(".card[data-id='live'] .badge").inner_text() == "running"
                assert live.poll() is None, "the run should still be training"

                wait_for_lines(runs / "short" / "metrics.jsonl", "eval", 4, timeout=60, proc=None)
                short.wait(timeout=60)
                page.wait_for_selector("li.run[data-id='short']", timeout=15_000)
                page.click("li.run[data-id='short'] input")  # tick a second run: overlaid curves
                page.wait_for_function(f"() => ({TRAIN_POINTS})('short') >= 60", timeout=15_000)
                traces = page.evaluate("""() => document.getElementById('chart-loss').data
                    .filter(t => t.name.endsWith(' train')).map(t => [t.legendgroup, t.line.color])""")
                assert sorted(g for g, _ in traces) == ["live", "short"]
                assert traces[0][1] != traces[1][1], "one colour per run"
                # the learning-rate chart plots every train record's lr against its step, one trace per run
                lr = page.evaluate("""() => Object.fromEntries(document.getElementById('chart-lr').data
                    .map(t => [t.legendgroup, [Array.from(t.x), Array.from(t.y)]]))""")
                assert sorted(lr) == ["live", "short"]
                steps, lrs = lr["short"]
                assert steps == list(range(60)) and all(isinstance(v, float) for v in lrs)
                assert lrs[0] == pytest.approx(3e-3 / 6) and max(lrs) == pytest.approx(3e-3)  # warmup, peak
                assert lrs[-1] < 4e-4 and lrs == sorted(lrs[:5]) + sorted(lrs[5:], reverse=True)  # cosine to min_lr
                assert len(lr["live"][0]) >= first + 20 and max(lr["live"][1]) <= 1e-3
                page.wait_for_function(
                    "() => document.querySelector(\".card[data-id='short'] .badge\").textContent === 'finished'",
                    timeout=10_000,
                )
                assert page.locator("#config-diff").inner_text().count("max_iters") == 1

                page.check("#logscale")
                page.wait_for_function("() => document.getElementById('chart-loss').layout.yaxis.type === 'log'")
                page.uncheck("#logscale")
                page.wait_for_timeout(500)
                shot = tmp_path / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
                print(f"screenshot: {shot}")

                for bad in ("/../../pyproject.toml", "/%2e%2e/%2e%2e/pyproject.toml", "/static/..%2f..%2fREADME.md"):
                    status = page.evaluate(f"fetch({bad!r}).then(r => r.status)")
                    assert status in (403, 404), (bad, status)
                browser.close()
        finally:
            server.stop()
    finally:
        for proc in (live, short):
            if proc.poll() is None:
                proc.kill()
        for proc in (live, short):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert not [e for e in errors if "404" not in e and "403" not in e], errors


SKIP_TRACES = """id => Object.fromEntries(['chart-loss', 'chart-grad'].map(c => [c,
    (document.getElementById(c).data || []).filter(t => t.name === id + ' skipped')
    .map(t => ({x: Array.from(t.x), text: Array.from(t.text), yaxis: t.yaxis, symbol: t.marker.symbol,
                mode: t.mode, color: t.marker.color}))]))"""


def test_page_marks_skipped_steps_and_counts_them_in_the_run_list(tmp_path, dashboard):
    """A run folder written by hand (no training): skip lines become red x markers with the reason on hover."""
    need_browser()
    t0 = time.time() - 60
    run = write_run(tmp_path / "nan", 40, max_iters=100, t0=t0)
    skips = {
        12: skip_line(12, 1, t0 + 12),
        25: skip_line(25, 1, t0 + 25, loss=2.5, grad_norm=float("inf")),
        26: skip_line(26, 2, t0 + 26),
    }
    lines = []  # a skipped step writes a skip line instead of its train line
    for raw in (run / "metrics.jsonl").read_text().splitlines(keepends=True):
        record = json.loads(raw)
        lines.append(skips[record["step"]] if record["kind"] == "train" and record["step"] in skips else raw)
    (run / "metrics.jsonl").write_text("".join(lines))
    # a run that diverged: max_bad_steps skips in a row, then train exited without an end line (crashed)
    diverged = write_run(tmp_path / "diverged", 10, max_iters=100, t0=t0)
    with open(diverged / "metrics.jsonl", "a") as fh:
        fh.writelines(skip_line(10 + k, k + 1, t0 + 10 + k) for k in range(10))
    os.utime(diverged / "metrics.jsonl", (t0, t0))
    write_run(tmp_path / "fine", 5, max_iters=100, t0=t0)
    url = dashboard(tmp_path)
    with page_at(url + "#runs=nan") as page:
        page.wait_for_function(f"() => ({SKIP_TRACES})('nan')['chart-loss'].length === 1", timeout=15_000)
        traces = page.evaluate(f"({SKIP_TRACES})('nan')")
        for chart in ("chart-loss", "chart-grad"):
            (skip,) = traces[chart]
            assert skip["x"] == [12, 25, 26] and skip["mode"] == "markers" and skip["symbol"] == "x"
            assert skip["yaxis"] == "y2"  # a hidden 0..1 axis: the markers sit along the bottom at any scale
            assert skip["text"] == [
                "step 12 skipped: loss/grad norm not finite (1 in a row)",
                "step 25 skipped: loss/grad norm not finite (1 in a row)",
                "step 26 skipped: loss/grad norm not finite (2 in a row)",
            ]
        # the train curve has no point at a skipped step
        train_x = page.evaluate("""() => Array.from(document.getElementById('chart-loss').data
            .find(t => t.name === 'nan train').x)""")
        assert 12 not in train_x and 25 not in train_x and len(train_x) == 37

        # the hover text is what the chart shows over a marker
        page.evaluate("""() => { const div = document.getElementById('chart-loss');
            const i = div.data.findIndex(t => t.name === 'nan skipped');
            Plotly.Fx.hover(div, [{curveNumber: i, pointNumber: 1}]); }""")
        hover = page.locator("#chart-loss .hovertext").first.text_content(timeout=5_000)
        assert "step 25 skipped: loss/grad norm not finite (1 in a row)" in hover
        assert "loss 2.5000, grad norm not finite" in hover
        page.evaluate("() => Plotly.Fx.unhover(document.getElementById('chart-loss'))")
        page.check("#logscale")  # a log loss axis leaves the markers where they were
        page.wait_for_function("() => document.getElementById('chart-loss').layout.yaxis.type === 'log'")
        assert page.evaluate("() => document.getElementById('chart-loss').layout.yaxis2.range") == [0, 1]
        assert page.evaluate(f"({SKIP_TRACES})('nan')") == traces
        page.uncheck("#logscale")

        badge = page.locator("li.run[data-id='nan'] .skips")
        assert badge.inner_text() == "3 skipped"
        assert "the last at step 26, 2 in a row (the run stops at 10 in a row)" in badge.get_attribute("title")
        assert page.locator(".card[data-id='nan'] .skips").inner_text() == "3 skipped"
        assert page.locator("li.run[data-id='fine'] .skips").count() == 0  # no badge without skips
        assert page.locator("li.run[data-id='diverged'] .skips").inner_text() == "10 skipped"

        page.click("li.run[data-id='diverged'] .name")  # alone: its card says why it stopped
        card = page.locator(".card[data-id='diverged'] .badge")
        card.wait_for(timeout=10_000)
        assert card.inner_text() == "crashed" and "(--max_bad_steps)" in card.get_attribute("title")
        page.wait_for_function(f"() => ({SKIP_TRACES})('diverged')['chart-loss'].length === 1", timeout=10_000)
        assert page.evaluate(f"({SKIP_TRACES})('diverged')")["chart-loss"][0]["x"] == list(range(10, 20))
        shot = tmp_path / "skips.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"screenshot: {shot}")


NO_SAMPLES = "no samples (enable with --sample_interval)"


def metrics_run(folder: Path, samples: list[tuple[int, list[str]]] = (), chat: dict[int, dict] | None = None) -> Path:
    """A run folder written by metrics.Metrics as train writes one: 10 train lines, an eval, `samples`, and
    `chat` ({step: values}: an SFT run's held-out evaluations)."""
    from gptforge.train.metrics import Metrics

    folder.mkdir(parents=True)
    m = Metrics(str(folder))
    for step in range(10):
        m.log(step, "train", loss=3.0 - 0.1 * step, lr=1e-3, ms_per_iter=30.0, tokens_per_s=24000.0)
    m.log(10, "eval", train_loss=2.0, val_loss=2.1)
    for step, values in (chat or {}).items():
        m.log(step, "chat", **values)
    for step, texts in samples:
        m.log_samples(step, "All:", texts)
    m.close()
    (folder / "config.json").write_text(json.dumps({"max_iters": 100}))
    return folder


def test_page_shows_the_samples_or_says_how_to_get_them(tmp_path, dashboard):
    need_browser()
    metrics_run(tmp_path / "plain")  # no sample_interval: no samples.jsonl at all
    metrics_run(tmp_path / "sampled", samples=[(4, ["All: first"]), (8, ["All: second", "All: third"])])
    old = write_run(tmp_path / "old", 10, max_iters=100)
    (old / "samples.jsonl").write_text("")  # what every run had before samples.jsonl waited for samples
    torn = write_run(tmp_path / "torn", 10, max_iters=100)
    (torn / "samples.jsonl").write_text('{"step": 4, "prompt": "All:", "sam')  # cut by a crash: no sample in it
    assert not (tmp_path / "plain" / "samples.jsonl").exists()
    write_run(tmp_path / "early", 10, max_iters=100, sample_interval=50)  # samples on, the first not written yet
    url = dashboard(tmp_path)
    with page_at(url + "#runs=plain,sampled,old,torn,early&focus=early") as page:
        shown = "() => document.getElementById('samples').textContent"
        page.wait_for_function(f"() => ({shown})() === 'no samples yet (every 50 steps)'", timeout=15_000)
        for run_id in ("plain", "sampled", "old", "torn"):
            page.select_option("#focus", run_id)
            if run_id == "sampled":  # newest first
                page.wait_for_function(f"() => ({shown})().includes('All: second')", timeout=10_000)
                texts = page.locator("#samples .sample pre").all_inner_texts()
                assert texts == ["All: second", "All: third", "All: first"]
                metas = page.locator("#samples .sample .meta").all_inner_texts()
                assert [m.split(" · ")[0] for m in metas] == ["step 8", "step 8", "step 4"]
            else:
                page.wait_for_function(f"() => ({shown})() === {NO_SAMPLES!r}", timeout=10_000)
        page.wait_for_timeout(2500)  # a poll later the torn file's run still says so: nothing is loading
        assert page.evaluate(shown) == NO_SAMPLES


def ema(ys: list[float], w: float) -> list[float]:
    """app.js's smoothing: an exponential moving average, debiased as TensorBoard does."""
    out, last = [], 0.0
    for n, y in enumerate(ys, 1):
        last = last * w + (1 - w) * y
        out.append(last / (1 - w**n))
    return out


SERIES = """id => Object.fromEntries(['chart-tps', 'chart-mfu', 'chart-loss'].map(c => [c,
    Object.fromEntries((document.getElementById(c).data || []).filter(t => t.legendgroup === id)
    .map(t => [t.name, {x: Array.from(t.x), y: Array.from(t.y), opacity: t.opacity ?? 1}]))]))"""


def test_tokens_per_s_and_mfu_are_smoothed_like_the_loss(tmp_path, dashboard):
    need_browser()
    run = write_run(tmp_path / "spiky", 60, max_iters=100)
    tps = [24000.0 + (9000.0 if s % 7 == 3 else 0.0) - 50.0 * (s % 5) for s in range(60)]  # a spiky band
    mfu = [t / 800000.0 for t in tps]
    lines = []
    for raw in (run / "metrics.jsonl").read_text().splitlines(keepends=True):
        record = json.loads(raw)
        if record["kind"] == "train":
            record.update(tokens_per_s=tps[record["step"]], mfu=mfu[record["step"]])
        lines.append(json.dumps(record) + "\n")
    (run / "metrics.jsonl").write_text("".join(lines))
    url = dashboard(tmp_path)
    with page_at(url + "#runs=spiky&smooth=0.80") as page:
        page.wait_for_function(f"() => Object.keys(({SERIES})('spiky')['chart-tps']).length === 2", timeout=15_000)
        charts = page.evaluate(f"({SERIES})('spiky')")
        for chart, values in (("chart-tps", tps), ("chart-mfu", [v * 100 for v in mfu])):
            raw, smooth = charts[chart]["spiky (raw)"], charts[chart]["spiky"]
            assert raw["x"] == smooth["x"] == list(range(60))
            assert raw["y"] == pytest.approx(values) and raw["opacity"] < 0.5  # the raw points, faint
            assert len(smooth["y"]) == len(raw["y"]) and smooth["y"] != pytest.approx(raw["y"])
            assert smooth["y"] == pytest.approx(ema(values, 0.8))  # the slider's value, the loss's method
            assert max(smooth["y"]) - min(smooth["y"]) < (max(values) - min(values)) / 2  # the band narrows
        loss = charts["chart-loss"]
        assert loss["spiky train"]["y"] == pytest.approx(ema(loss["spiky train (raw)"]["y"], 0.8))

        # the slider at 0: one trace per chart, the raw values
        page.evaluate("""() => { const s = document.getElementById('smoothing');
            s.value = '0'; s.dispatchEvent(new Event('input')); }""")
        page.wait_for_function(f"() => Object.keys(({SERIES})('spiky')['chart-tps']).length === 1", timeout=5_000)
        charts = page.evaluate(f"({SERIES})('spiky')")
        assert list(charts["chart-tps"]) == ["spiky"] and charts["chart-tps"]["spiky"]["y"] == pytest.approx(tps)
        assert list(charts["chart-mfu"]) == ["spiky"]

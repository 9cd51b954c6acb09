"""The dashboard's charts of `gptforge rl` runs (reward, pass rates, held-out pass@1 per kind) and of SFT's held-out
accuracy in a real browser; a plain training run shows neither. Skips as test_dashboard_browser does without
Chromium."""

from __future__ import annotations

import json
from pathlib import Path

from test_dashboard import write_run
from test_dashboard_browser import metrics_run, need_browser, page_at

RL_CONFIG = {"init_from": "out-chat-sft", "kinds": "count,sub", "max_steps": 6, "num_generations": 8}
REWARDS = [0.125, 0.25, float("nan"), 0.5, 0.625, 0.75]  # a step whose rewards were not finite: a gap
HELD_OUT = {  # rl/evaluate.py's records: pass@1 overall and per kind; pass@8 where eval_pass_k measured it
    0: {"pass_at_1": 0.25, "pass_at_1_count": 0.5, "pass_at_1_sub": 0.0, "ended": 0.5},
    3: {"pass_at_1": 0.5, "pass_at_1_count": 0.75, "pass_at_1_sub": 0.25, "ended": 0.75, "pass_at_8": 0.875},
    6: {"pass_at_1": 0.625, "pass_at_1_count": 1.0, "pass_at_1_sub": 0.25, "ended": 1.0},
}


def rl_values(step: int, reward: float) -> dict:
    """An "rl" record's fields as rl/loop.py logs them (pass_at_8: a group of 8 answers)."""
    values = {
        "reward": reward,
        "pass_at_1": reward / 2,
        "pass_at_8": (reward + 1) / 2,
        "answer_tokens": 10.0 + step,
        "loss": 0.01,
        "kl": 0.0,
        "grad_norm": float("nan") if step == 4 else 0.5,
        "sampled_tokens_per_s": 1000.0 + 100 * step,
        "step_s": 2.0,
        "eta_s": 2.0 * (5 - step),
        "lr": 1e-4,
    }
    if step == 1:
        del values["answer_tokens"]  # a field missing from a record: a gap as well
    return values


def rl_run(folder: Path, rewards: list[float], resume_step: int | None = None) -> Path:
    """A `gptforge rl` run folder written by metrics.Metrics as rl/loop.py writes it: rl_config.json (no
    config.json), an rl_eval record every 3 steps, an rl record a step, the end record and ckpt.pt; with
    resume_step, the run resumed from that step's checkpoint (the file is rewritten from there)."""
    from gptforge.train.metrics import Metrics

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rl_config.json").write_text(json.dumps(RL_CONFIG))
    m = Metrics(str(folder), resume_step=resume_step)
    for step in range(resume_step or 0, 7):
        if step % 3 == 0:
            m.log(step, "rl_eval", **HELD_OUT[step])
        if step == 6:
            m.log(step, "end", reason="max_steps reached")
        else:
            m.log(step, "rl", **rl_values(step, rewards[step]))
    m.close()
    (folder / "ckpt.pt").write_bytes(b"")
    return folder


CHAT = {  # train/loop.py's "chat" records (evaluate/chat.py's task_accuracy) of an SFT run with tools
    10: {"acc": 0.5, "n": 40, "acc_count": 0.75, "acc_sub": 0.25, "calls_count": 1.0, "calls_sub": 0.5, "ended": 0.9},
    20: {"acc": 0.625, "n": 40, "acc_count": 0.875, "acc_sub": 0.375, "calls_count": 1.0, "calls_sub": 0.75,
         "ended": 1.0},
}  # fmt: skip

TRACES = """(chart, id) => Object.fromEntries((document.getElementById(chart).data || [])
    .filter(t => t.legendgroup === id)
    .map(t => [t.name, {x: Array.from(t.x), y: Array.from(t.y),
                        customdata: t.customdata ? Array.from(t.customdata) : null}]))"""
SHOWN = """() => Object.fromEntries(['chart-loss', 'chart-lr', 'chart-tps', 'chart-mfu', 'chart-rl-reward',
    'chart-rl-eval', 'chart-rl-length', 'chart-rl-tps', 'chart-rl-kl', 'chart-chat']
    .map(c => [c, document.getElementById(c).getClientRects().length > 0]))"""
RL_CHARTS = ("chart-rl-reward", "chart-rl-eval", "chart-rl-length", "chart-rl-tps", "chart-rl-kl")


def page_traces(page, chart: str, run_id: str) -> dict:
    return page.evaluate(f"([c, i]) => ({TRACES})(c, i)", [chart, run_id])


def test_page_charts_an_rl_run_and_reads_it_again_when_resumed(tmp_path, dashboard):
    """An RL run folder (rl_config.json, no config.json): reward and pass rates of each step, held-out pass@1
    overall and per kind, answer length, sampled tokens/s; no loss, tokens/s or MFU charts."""
    need_browser()
    rl = rl_run(tmp_path / "rl", REWARDS)
    assert not (rl / "config.json").exists()
    url = dashboard(tmp_path)
    with page_at(url + "#runs=rl&smooth=0") as page:
        page.wait_for_function(f"() => Object.keys(({TRACES})('chart-rl-eval', 'rl')).length === 4", timeout=15_000)
        reward = page_traces(page, "chart-rl-reward", "rl")
        assert list(reward) == ["rl reward", "rl pass@1", "rl pass@8"] and reward["rl reward"]["x"] == list(range(6))
        assert reward["rl reward"]["y"] == [0.125, 0.25, None, 0.5, 0.625, 0.75]  # NaN: a gap
        assert reward["rl pass@1"]["y"] == [0.0625, 0.125, None, 0.25, 0.3125, 0.375]
        assert reward["rl pass@8"]["y"] == [0.5625, 0.625, None, 0.75, 0.8125, 0.875]
        held = page_traces(page, "chart-rl-eval", "rl")
        assert list(held) == ["rl overall", "rl pass@8", "rl count", "rl sub"]  # one line per task kind
        assert all(t["x"] == [0, 3, 6] for t in held.values())
        assert held["rl overall"]["y"] == [0.25, 0.5, 0.625]
        assert held["rl overall"]["customdata"] == ["50%", "75%", "100%"]  # the share of answers that ended
        assert held["rl count"]["y"] == [0.5, 0.75, 1.0] and held["rl sub"]["y"] == [0.0, 0.25, 0.25]
        assert held["rl pass@8"]["y"] == [None, 0.875, None]
        assert page_traces(page, "chart-rl-length", "rl")["rl"]["y"] == [10.0, None, 12.0, 13.0, 14.0, 15.0]
        assert page_traces(page, "chart-rl-tps", "rl")["rl"]["y"] == [1000.0 + 100 * s for s in range(6)]
        assert page_traces(page, "chart-lr", "rl")["rl"]["y"] == [1e-4] * 6  # the charts it shares with train
        assert page_traces(page, "chart-grad", "rl")["rl"]["y"] == [0.5, 0.5, 0.5, 0.5, None, 0.5]
        shown = page.evaluate(SHOWN)  # no loss, tokens/s or MFU to draw; KL stays 0 without beta; no chat records
        assert [c for c, v in shown.items() if v] == ["chart-lr", *RL_CHARTS[:4]], shown
        assert "pass@8 (dashed)" in page.locator("#rl-reward-note").inner_text()
        card = page.locator(".card[data-id='rl']")
        assert card.locator(".badge").inner_text() == "finished"  # its end record; no config.json
        assert card.locator(".progress-text").inner_text().startswith("step 6 / 6")  # rl_config.json's max_steps
        labels, values = card.locator(".stat span").all_inner_texts(), card.locator(".stat b").all_inner_texts()
        stats = {k.lower(): v for k, v in zip(labels, values, strict=True) if k.lower() != "updated"}
        assert stats == {
            "reward": "0.750",
            "pass@1": "0.375",
            "held-out pass@1": "0.625",
            "answer tokens": "15",  # fmtNum: a whole number without decimals
            "sampled tok/s": "1,500",
        }
        assert "pass@1 0.625" in page.locator("li.run[data-id='rl'] .sub").inner_text()
        page.wait_for_function("() => document.getElementById('config').textContent.includes('num_generations')")
        assert "enable with --sample_interval" not in page.locator("#samples").inner_text()

        # resumed from step 3's checkpoint: the file is rewritten from there, and the page reads it again
        rl_run(rl, [0.0, 0.0, 0.0, 0.375, 0.5, 0.875], resume_step=3)
        page.wait_for_function(
            f"() => (({TRACES})('chart-rl-reward', 'rl')['rl reward'] || {{y: []}}).y[5] === 0.875", timeout=15_000
        )
        reward = page_traces(page, "chart-rl-reward", "rl")["rl reward"]
        assert reward["x"] == list(range(6)) and reward["y"] == [0.125, 0.25, None, 0.375, 0.5, 0.875]
        assert page_traces(page, "chart-rl-eval", "rl")["rl overall"]["x"] == [0, 3, 6]


def test_page_charts_sft_held_out_accuracy_and_a_plain_run_has_no_such_chart(tmp_path, dashboard):
    need_browser()
    rl_run(tmp_path / "rl", REWARDS)
    metrics_run(tmp_path / "sft", chat=CHAT)
    write_run(tmp_path / "plain", 20, max_iters=100)
    url = dashboard(tmp_path)
    with page_at(url + "#runs=sft&smooth=0") as page:  # an SFT run: held-out accuracy beside its train charts
        page.wait_for_function(f"() => Object.keys(({TRACES})('chart-chat', 'sft')).length === 3", timeout=15_000)
        chat = page_traces(page, "chart-chat", "sft")
        assert list(chat) == ["sft overall", "sft count", "sft sub"] and chat["sft overall"]["x"] == [10, 20]
        assert chat["sft overall"]["y"] == [0.5, 0.625] and chat["sft sub"]["y"] == [0.25, 0.375]
        assert chat["sft sub"]["customdata"] == ["50%", "75%"]  # the share that called a tool, on hover
        shown = page.evaluate(SHOWN)
        assert shown["chart-chat"] and shown["chart-loss"] and shown["chart-mfu"]
        assert not any(shown[c] for c in RL_CHARTS)
        sft_card = page.locator(".card[data-id='sft']")
        assert "held-out acc" in sft_card.inner_text().lower() and "0.625" in sft_card.inner_text()
        assert "acc 0.625" in page.locator("li.run[data-id='sft'] .sub").inner_text()

        page.click("li.run[data-id='plain'] .name")  # a pretraining run: its page as ever
        page.wait_for_function(f"() => Object.keys(({TRACES})('chart-loss', 'plain')).length > 0", timeout=10_000)
        shown = page.evaluate(SHOWN)
        assert [c for c, v in shown.items() if v] == ["chart-loss", "chart-lr", "chart-tps", "chart-mfu"], shown
        assert page.evaluate("() => document.getElementById('rl-grid').getClientRects().length") == 0
        assert all(page.evaluate(f"() => !document.getElementById('{c}').data") for c in (*RL_CHARTS, "chart-chat"))
        stats = page.locator(".card[data-id='plain'] .stat span").all_inner_texts()
        assert [s.lower() for s in stats] == ["loss", "val loss", "best val", "tokens/s", "mfu", "updated"]

        page.click("li.run[data-id='rl'] input")  # a plain run and an RL run: every chart of either
        page.wait_for_function(f"() => Object.keys(({TRACES})('chart-rl-reward', 'rl')).length === 3")
        shown = page.evaluate(SHOWN)
        assert shown["chart-loss"] and shown["chart-rl-reward"] and shown["chart-rl-eval"] and shown["chart-tps"]
        shot = tmp_path / "rl-and-plain.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"screenshot: {shot}")

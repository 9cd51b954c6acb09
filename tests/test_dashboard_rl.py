"""The dashboard with `gptforge rl` runs and resumed files: an RL folder (rl_config.json, no config.json) is a run
with its length, state, eta and figures; a metrics.jsonl rewritten under the same file id (a resume) is read again."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gptforge.dashboard.records import read_records
from test_dashboard import get_json, request, write_run


def test_a_file_rewritten_under_the_same_id_is_read_again(tmp_path, dashboard):
    """A resume rewrites metrics.jsonl through renames; twice between two polls and the file system may give the
    new file the old one's inode number, so the file id matches: the mark of the bytes before the offset does not."""
    run = write_run(tmp_path / "run", 6, max_iters=100)
    path = run / "metrics.jsonl"
    first = read_records(str(path))
    lines = path.read_text().splitlines(keepends=True)
    resumed = lines[:3] + [json.dumps({"step": s, "kind": "train", "loss": 9.0 + s}) + "\n" for s in range(2, 40)]
    with open(path, "w") as fh:  # in place: the same inode, as a reused one would be
        fh.write("".join(resumed))
    assert path.stat().st_size > first.offset and file_id_of(path) == first.file
    stale = read_records(str(path), first.offset, first.file)  # without the mark: read on from the old offset
    assert not stale.reset
    again = read_records(str(path), first.offset, first.file, mark=first.mark)
    assert again.reset and [r.get("loss") for r in again.records][-38:] == [9.0 + s for s in range(2, 40)]
    assert read_records(str(path), again.offset, again.file, mark=again.mark).records == []  # appends read on
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": 40, "kind": "train", "loss": 1.0}) + "\n")
    more = read_records(str(path), again.offset, again.file, mark=again.mark)
    assert not more.reset and more.records == [{"step": 40, "kind": "train", "loss": 1.0}]

    # the API sends the mark and takes it back; the run list's summary checks it too
    url = dashboard(tmp_path)
    assert get_json(url, "/api/runs")["runs"][0]["step"] == 40
    read = get_json(url, "/api/runs/run/metrics?offset=0")
    with open(path, "w") as fh:
        fh.write("".join(lines[:3]) + json.dumps({"step": 1, "kind": "train", "loss": 5.0}) + "\n" + "x" * 4000 + "\n")
    assert path.stat().st_size > read["offset"] and file_id_of(path) == read["file"]
    q = f"/api/runs/run/metrics?offset={read['offset']}&file={read['file']}&mark={read['mark']}"
    assert get_json(url, q)["reset"]
    assert get_json(url, "/api/runs")["runs"][0]["step"] == 1


def file_id_of(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev:x}-{st.st_ino:x}"


def rl_lines(steps: int, max_steps: int, t0: float, end: bool) -> list[dict]:
    """A `gptforge rl` run's records (rl/loop.py): an rl_eval every 2 steps, an rl record a step, maybe the end."""
    lines = []
    for s in range(steps + 1 if end else steps):
        if s % 2 == 0 or s == max_steps:
            held_out = {"pass_at_1": 0.125 * (s + 1), "pass_at_1_count": 0.5}
            lines.append({"step": s, "kind": "rl_eval", **held_out, "time": t0 + s})
        if s == max_steps:
            lines.append({"step": s, "kind": "end", "reason": "max_steps reached", "time": t0 + s})
            break
        eta = 10.0 * (max_steps - s - 1)
        r = {"reward": 0.1 * (s + 1), "pass_at_1": 0.05 * (s + 1), "pass_at_8": 0.5, "eta_s": eta, "lr": 1e-4}
        lines.append({"step": s, "kind": "rl", **r, "time": t0 + s})
    return lines


def test_an_rl_run_folder_is_a_run_with_its_progress_state_and_figures(tmp_path, dashboard):
    """`gptforge rl` writes rl_config.json and no config.json: its max_steps is the run's length, its end line
    finishes it, its last rl line's eta_s counts down, and the list shows its reward and held-out pass@1."""
    now = time.time()
    rl_config = {"init_from": "out-chat-sft", "max_steps": 4, "num_generations": 8, "device": "cpu"}
    for name, steps, end in (("rl-done", 4, True), ("rl-live", 2, False), ("rl-stopped", 2, False)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "rl_config.json").write_text(json.dumps(rl_config))
        (folder / "log.txt").write_text("")
        t0 = now - 600 if name == "rl-stopped" else now - 2
        lines = rl_lines(steps, 4, t0, end)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    stopped = tmp_path / "rl-stopped"
    os.utime(stopped / "metrics.jsonl", (now - 600, now - 600))
    (stopped / "ckpt.pt").write_bytes(b"")  # saved on the way out: resumable
    (tmp_path / "rl-live" / "config.json").write_text(json.dumps({"max_iters": 50}))  # the SFT run's, RL'd into
    sft = write_run(tmp_path / "sft", 5, max_iters=100)
    with open(sft / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 4, "kind": "chat", "acc": 0.375, "acc_count": 0.5, "ended": 1.0, "n": 8}) + "\n")
    url = dashboard(tmp_path)
    runs = {r["id"]: r for r in get_json(url, "/api/runs")["runs"]}
    assert sorted(runs) == ["rl-done", "rl-live", "rl-stopped", "sft"]
    fields = ("state", "step", "max_iters", "rl", "reward", "pass_at_1", "held_out_pass_at_1", "chat_acc")
    assert {k: runs["rl-done"][k] for k in fields} == {
        "state": "finished",
        "step": 4,
        "max_iters": 4,
        "rl": True,
        "reward": pytest.approx(0.4),
        "pass_at_1": pytest.approx(0.2),
        "held_out_pass_at_1": 0.625,
        "chat_acc": None,
    }
    assert runs["rl-done"]["eta_s"] == 0.0 and runs["rl-done"]["has_config"] and runs["rl-done"]["loss"] is None
    live = runs["rl-live"]
    assert (live["state"], live["step"], live["max_iters"], live["reward"]) == ("running", 1, 4, pytest.approx(0.2))
    assert 15.0 <= live["eta_s"] <= 20.0  # the last rl line's eta_s (20 s) counted down since it was written
    assert runs["rl-stopped"]["state"] == "stopped" and runs["rl-stopped"]["eta_s"] is None
    assert runs["rl-live"]["config"] == {"device": "cpu"}  # rl_config.json's keys, not the SFT run's config.json
    assert get_json(url, "/api/runs/rl-done/config") == rl_config
    assert get_json(url, "/api/runs/rl-live/config") == rl_config
    assert (runs["sft"]["rl"], runs["sft"]["reward"], runs["sft"]["chat_acc"]) == (False, None, 0.375)
    assert runs["sft"]["max_iters"] == 100 and get_json(url, "/api/runs/sft/config")["max_iters"] == 100
    kinds = [r["kind"] for r in get_json(url, "/api/runs/rl-done/metrics?offset=0")["records"]]
    assert kinds == ["rl_eval", "rl", "rl", "rl_eval", "rl", "rl", "rl_eval", "end"]
    status, body = request(url, "/static/rl.js")  # the page's script for these charts
    assert status == 200 and b"function addExtraRecord" in body

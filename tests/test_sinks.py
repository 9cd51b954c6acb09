"""Samples during training and the optional metric sinks (TensorBoard, wandb offline), run for real."""

from __future__ import annotations

import glob
import json
import os

import pytest

from conftest import run_cli, tiny_train_args
from test_train import records, run


def wandb_env(folder) -> dict[str, str]:
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(folder), "WANDB_SILENT": "true"}


def test_samples_during_training_leave_training_untouched(char_data, tmp_path):
    plain = run(char_data, tmp_path / "plain", max_iters=10, dropout=0.1)
    sampling = dict(max_iters=10, dropout=0.1, sample_interval=4, num_samples=3, sample_tokens=12, sample_prompt="All:")
    sampled = run(char_data, tmp_path / "sampled", **sampling)
    assert [r["loss"] for r in records(tmp_path / "plain", "train")] == [
        r["loss"] for r in records(tmp_path / "sampled", "train")
    ]
    assert plain["losses"] == sampled["losses"]
    assert not (tmp_path / "plain/samples.jsonl").exists()  # no samples, no file: the dashboard says so
    rows = [json.loads(line) for line in (tmp_path / "sampled/samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8, 10]  # every sample_interval and at the last step
    for r in rows:
        assert r["prompt"] == "All:" and len(r["samples"]) == 3
        assert all(s.startswith("All:") and len(s) == len("All:") + 12 for s in r["samples"])
    # seeded 42 + rank: the same run samples the same text
    run(char_data, tmp_path / "again", **sampling)
    assert (tmp_path / "again/samples.jsonl").read_text().count("All:") == (
        tmp_path / "sampled/samples.jsonl"
    ).read_text().count("All:")
    assert [json.loads(x)["samples"] for x in (tmp_path / "again/samples.jsonl").read_text().splitlines()] == [
        r["samples"] for r in rows
    ]


def test_a_resumed_run_keeps_the_samples_of_earlier_steps(char_data, tmp_path):
    common = dict(sample_interval=4, num_samples=1, sample_tokens=8, sample_prompt="A")
    run(char_data, tmp_path / "r", max_iters=10, lr_decay_iters=16, **common)
    first = (tmp_path / "r/samples.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(x)["step"] for x in first] == [4, 8, 10]
    with open(tmp_path / "r/samples.jsonl", "a") as fh:
        fh.write('{"step": 9, "prompt"')  # a line torn by a crash: dropped, as in metrics.jsonl
    run(char_data, tmp_path / "r", max_iters=16, lr_decay_iters=16, init_from="resume", **common)
    lines = (tmp_path / "r/samples.jsonl").read_text().splitlines(keepends=True)
    # resumed at step 10: every line the checkpoint covers kept as it was, step 10's too (the resumed run draws no
    # sample there: it is no longer the last step), the torn one dropped, then the new ones
    assert lines[:3] == first
    assert [json.loads(x)["step"] for x in lines] == [4, 8, 10, 12, 16]

    # a run without samples resumed leaves none either
    run(char_data, tmp_path / "plain", max_iters=4, lr_decay_iters=8, eval_interval=4)
    run(char_data, tmp_path / "plain", max_iters=8, lr_decay_iters=8, eval_interval=4, init_from="resume")
    assert not (tmp_path / "plain/samples.jsonl").exists()


def test_metrics_creates_samples_jsonl_with_the_first_samples(tmp_path):
    from gptforge.train.metrics import Metrics

    m = Metrics(str(tmp_path))
    m.log(0, "train", loss=2.0, lr=1e-3, ms_per_iter=1.0)
    assert not (tmp_path / "samples.jsonl").exists()
    m.log_samples(1, "A", ["Ab", "Ac"])
    m.log_samples(2, "A", ["Ad"])
    m.close()
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["samples"]) for r in rows] == [(1, ["Ab", "Ac"]), (2, ["Ad"])]
    # a fresh run in the same folder starts the samples over; resumed at step 1, those of steps after it go
    Metrics(str(tmp_path), resume_step=1).close()
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1]
    Metrics(str(tmp_path)).close()
    assert (tmp_path / "samples.jsonl").read_text() == ""


def test_sample_prompt_outside_the_vocabulary_is_a_user_error(char_data, tmp_path):
    from gptforge.core.errors import UserError

    with pytest.raises(UserError, match="--sample_prompt: character '€'"):
        run(char_data, tmp_path / "r", sample_interval=2, sample_prompt="€uro")


def test_tensorboard_events_read_back_with_tensorboards_reader(char_data, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(char_data, tmp_path / "r", max_iters=6, eval_interval=3, tensorboard_log=True, sample_interval=3)
    acc = EventAccumulator(str(tmp_path / "r/tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(6))
    expected = [r["loss"] for r in records(tmp_path / "r", "train")]
    assert [e.value for e in loss] == pytest.approx(expected, rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/val_loss")] == [0, 3, 6]
    assert "samples/text_summary" in acc.Tags()["tensors"]


def wandb_log_records(path: str) -> list[bytes]:
    """The records of a wandb offline run file: a 7-byte ':W&B' header, then LevelDB-style log blocks of
    32 KiB holding records (crc32c 4 bytes, length 2, type 1: full / first / middle / last)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # block trailer or zero padding
            pos += left if left < 7 else 7
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    return records


def test_wandb_offline_run_holds_the_logged_metrics(char_data, tmp_path):
    pytest.importorskip("wandb")
    # a process of its own: wandb keeps per-process state (its service, settings) that outlives a run
    r = run_cli(
        "train",
        *tiny_train_args(
            char_data,
            tmp_path / "r",
            max_iters=4,
            eval_interval=2,
            wandb_log=True,
            wandb_project="p",
            wandb_run_name="tiny",
        ),
        env=wandb_env(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    files = glob.glob(str(tmp_path / "wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, os.listdir(tmp_path)
    from wandb.proto import wandb_internal_pb2

    history = []
    for data in wandb_log_records(files[0]):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            )
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    assert losses == pytest.approx([r["loss"] for r in records(tmp_path / "r", "train")], rel=1e-6)
    assert [h["eval/val_loss"] for h in history if "eval/val_loss" in h] == pytest.approx(
        [r["val_loss"] for r in records(tmp_path / "r", "eval")], rel=1e-6
    )


def test_train_with_dashboard_serves_its_run(char_data, tmp_path):
    """dashboard=True: rank 0 starts the dashboard beside the run and prints its address; it serves the run."""
    pytest.importorskip("plotly")
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from conftest import tiny_train_args

    args = tiny_train_args(
        char_data,
        tmp_path / "r",
        max_iters=100000,
        lr_decay_iters=100000,
        eval_interval=50,
        dashboard=True,
        dashboard_port=0,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptforge", "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        url = None
        deadline = time.time() + 60
        for line in proc.stdout:
            if line.startswith("dashboard: open "):
                url = line.split()[2]
            if url and line.startswith("iter 3:") or time.time() > deadline:
                break
        assert url and url.startswith("http://127.0.0.1:"), url
        runs = json.loads(urllib.request.urlopen(url + "api/runs", timeout=10).read())
        assert len(runs["runs"]) == 1 and runs["runs"][0]["state"] == "running", runs
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_resumed_run_continues_the_same_wandb_run(char_data, tmp_path):
    """The wandb run id travels in the checkpoint: a resume logs into the same run, not a new one."""
    pytest.importorskip("wandb")
    common = dict(max_iters=6, lr_decay_iters=6, eval_interval=3, wandb_log=True, wandb_project="p")
    r = run_cli(
        "train", *tiny_train_args(char_data, tmp_path / "r", **{**common, "max_iters": 3}), env=wandb_env(tmp_path)
    )
    assert r.returncode == 0, r.stderr
    from gptforge.weights.checkpoint import load_checkpoint

    run_id = load_checkpoint(str(tmp_path / "r/ckpt.pt"))["wandb_run_id"]
    assert run_id
    r = run_cli(
        "train", *tiny_train_args(char_data, tmp_path / "r", **common, init_from="resume"), env=wandb_env(tmp_path)
    )
    assert r.returncode == 0, r.stderr
    assert load_checkpoint(str(tmp_path / "r/ckpt.pt"))["wandb_run_id"] == run_id
    folders = glob.glob(str(tmp_path / "wandb/offline-run-*"))
    assert len(folders) == 2 and all(f.endswith(f"-{run_id}") for f in folders)


def test_evaluations_state_perplexity_beside_the_loss(tmp_path, capsys):
    import math

    from gptforge.train.metrics import Metrics, perplexity

    m = Metrics(str(tmp_path))
    m.log(0, "eval", train_loss=math.log(65), val_loss=2.0, lr=1e-3)
    m.log(1, "eval", train_loss=float("nan"), val_loss=1000.0, lr=1e-3)
    m.log(1, "train", loss=2.0, lr=1e-3, ms_per_iter=1.0)
    m.close()
    first, second, train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert list(first) == ["step", "kind", "train_loss", "train_ppl", "val_loss", "val_ppl", "lr", "time"]
    assert first["train_ppl"] == pytest.approx(65.0) and first["val_ppl"] == pytest.approx(7.389056099)
    assert math.isnan(second["train_ppl"]) and second["val_ppl"] == math.inf  # no OverflowError
    assert "loss" in train and "ppl" not in train  # a train line is one noisy batch: no perplexity there
    out = capsys.readouterr().out
    assert "step 0: train loss 4.1744 (ppl 65.00), val loss 2.0000 (ppl 7.39)" in out
    assert (tmp_path / "log.txt").read_text().splitlines()[0] == "0 val 2.0000"  # build-nanogpt's format unchanged
    assert perplexity(0.0) == 1.0

"""Recovering runs: step checkpoints and rotation, the best checkpoint, falling back to an older readable
checkpoint, left-over temporary files, the NaN guard, and a disk that fills up during a checkpoint write."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

from conftest import run_cli, tiny_train_args
from gptforge.core.config import load_config
from gptforge.core.files import remove_stale_temporaries
from gptforge.train.loop import train
from gptforge.weights import checkpoint as ck


def run(data_dir, out_dir, **overrides):
    return train(load_config(tiny_train_args(data_dir, out_dir, **overrides)))


def records(out_dir, kind):
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r["kind"] == kind]


def digest(folder) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in sorted(os.listdir(folder))}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["iter_num"] == b["iter_num"]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for pid, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][pid][name]), (pid, name)


def test_step_checkpoints_best_and_rotation(char_data, tmp_path):
    """ckpt_interval=5 over 20 steps: model_00005/10/15 and model_00020 (the last step, final weights); keep_last=2
    leaves the newest two; ckpt_best.pt is the evaluation with the lowest val loss."""
    out = tmp_path / "run"
    run(char_data, out, max_iters=20, eval_interval=5, ckpt_interval=5, keep_last=2)
    names = sorted(n for n in os.listdir(out) if n.endswith(".pt"))
    assert names == ["ckpt.pt", "ckpt_best.pt", "model_00015.pt", "model_00020.pt"]
    latest = ck.load_checkpoint(str(out / "ckpt.pt"))
    assert ck.load_checkpoint(str(out / "model_00015.pt"))["iter_num"] == 15
    assert_same_weights(ck.load_checkpoint(str(out / "model_00020.pt")), latest)  # the last one: after every step
    evals = [r for r in records(out, "eval") if r["step"] > 0]
    best_step = min(evals, key=lambda r: r["val_loss"])["step"]
    best = ck.load_checkpoint(str(out / "ckpt_best.pt"))
    assert best["iter_num"] == best_step and best["best_val_loss"] == min(r["val_loss"] for r in evals)

    every = tmp_path / "all"
    run(char_data, every, max_iters=12, eval_interval=100, ckpt_interval=4)  # keep_last=0 keeps them all
    assert sorted(n for n in os.listdir(every) if n.startswith("model_")) == [
        "model_00004.pt",
        "model_00008.pt",
        "model_00012.pt",
    ]


def test_resume_falls_back_to_the_newest_readable_checkpoint(char_data, tmp_path):
    """ckpt.pt, ckpt_best.pt and the newest step checkpoint damaged: resume says so, continues from
    model_00010.pt, and ends with the weights of an uninterrupted run."""
    common = dict(max_iters=20, lr_decay_iters=20, eval_interval=5, ckpt_interval=5)
    run(char_data, tmp_path / "whole", **common)
    out = tmp_path / "damaged"
    run(char_data, out, **{**common, "max_iters": 15})
    for name in ("ckpt.pt", "ckpt_best.pt"):
        data = (out / name).read_bytes()
        (out / name).write_bytes(data[: len(data) // 2])  # torn, as a failing disk or a partial copy leaves it
    (out / "model_00015.pt").write_text("not a checkpoint")
    r = run_cli("train", *tiny_train_args(char_data, out, **common, init_from="resume"))
    assert r.returncode == 0, r.stderr
    assert "cannot read checkpoint" in r.stdout and str(out / "ckpt.pt") in r.stdout
    assert f"resuming {out} from iter 10 ({out / 'model_00010.pt'}) (the newest readable checkpoint)" in r.stdout
    assert_same_weights(ck.load_checkpoint(str(out / "ckpt.pt")), ck.load_checkpoint(str(tmp_path / "whole/ckpt.pt")))


def test_resume_with_no_readable_checkpoint_names_them_all(char_data, tmp_path):
    out = tmp_path / "run"
    run(char_data, out, max_iters=5, eval_interval=5, ckpt_interval=5)
    for name in ("ckpt.pt", "ckpt_best.pt", "model_00005.pt"):
        (out / name).write_bytes(b"\0" * 100)
    before = digest(out)
    r = run_cli("train", *tiny_train_args(char_data, out, max_iters=8, init_from="resume"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    for name in ("ckpt.pt", "ckpt_best.pt", "model_00005.pt"):
        assert str(out / name) in r.stderr
    assert "--init_from=scratch" in r.stderr
    assert digest(out) == before  # nothing was touched


def test_temporary_files_of_killed_writers_are_removed(char_data, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = out / f".ckpt.pt.{int(gone.stdout)}.tmp"  # a pid that has exited: its writer was killed mid-write
    live = out / f".ckpt.pt.{os.getpid()}.tmp"  # a live process's: maybe still writing, left alone
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    assert remove_stale_temporaries(str(out)) == [dead.name]
    assert live.exists() and not dead.exists()
    dead.write_bytes(b"partial")
    run(char_data, out, max_iters=2)
    assert not dead.exists()


def test_a_non_finite_step_is_skipped_and_never_reaches_the_weights(char_data, tmp_path, monkeypatch):
    """Step 3's gradients are made NaN: the step is skipped and logged, AdamW takes one step fewer, the weights
    stay finite, and the other steps train normally."""
    import gptforge.train.loop as train_module

    real = train_module.accumulate_gradients
    calls = []

    def poisoned(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        calls.append(1)
        if len(calls) == 4:  # step 3
            next(model.parameters()).grad.fill_(float("nan"))
        return out

    monkeypatch.setattr(train_module, "accumulate_gradients", poisoned)
    out = tmp_path / "run"
    run(char_data, out, max_iters=8, eval_interval=100, grad_clip=0.0)
    skips = records(out, "skip")
    assert [(r["step"], r["in_a_row"]) for r in skips] == [(3, 1)]
    assert [r["step"] for r in records(out, "train")] == [0, 1, 2, 4, 5, 6, 7]
    final = ck.load_checkpoint(str(out / "ckpt.pt"))
    assert final["iter_num"] == 8
    assert all(torch.isfinite(t).all() for t in final["model"].values())
    assert {int(s["step"]) for s in final["optimizer"]["state"].values()} == {7}  # 8 steps, one skipped


def test_diverging_run_stops_after_max_bad_steps_with_the_last_checkpoint_intact(char_data, tmp_path):
    """A learning rate of 1e30 drives the loss to NaN: after max_bad_steps skipped steps in a row the run exits 2
    with a message, and the checkpoint written before is byte-identical and finite."""
    out = tmp_path / "run"
    run(char_data, out, max_iters=10, eval_interval=5)
    before = digest(out)
    r = run_cli(
        "train",
        *tiny_train_args(
            char_data, out, max_iters=40, eval_interval=5, init_from="resume", learning_rate=1e30, max_bad_steps=3
        ),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "not finite 3 steps in a row (--max_bad_steps=3)" in r.stderr and "intact" in r.stderr
    skips = records(out, "skip")
    assert [s["in_a_row"] for s in skips] == [1, 2, 3] and [s["step"] for s in skips] == [11, 12, 13]
    for name in ("ckpt.pt", "ckpt_best.pt"):
        assert digest(out)[name] == before[name]
    assert all(torch.isfinite(t).all() for t in ck.load_checkpoint(str(out / "ckpt.pt"))["model"].values())


def _file_size_limit(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_disk_full_during_a_checkpoint_write_keeps_the_previous_one(char_data, tmp_path):
    """A real process whose files may not grow past 100 kB (the kernel refuses the write, as on a full disk):
    the checkpoint write fails, the run exits 2 naming the file, and ckpt.pt is the previous one, byte for byte."""
    out = tmp_path / "run"
    run(char_data, out, max_iters=10, eval_interval=5)
    assert os.path.getsize(out / "ckpt.pt") > 100_000
    before = digest(out)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptforge",
            "train",
            *tiny_train_args(char_data, out, max_iters=20, eval_interval=5, init_from="resume"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_file_size_limit(100_000),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"cannot write checkpoint {out / 'ckpt.pt'}: File too large; the previous checkpoint is intact" in r.stderr
    after = digest(out)
    assert after["ckpt.pt"] == before["ckpt.pt"] and after["ckpt_best.pt"] == before["ckpt_best.pt"]
    assert not [n for n in after if n.endswith(".tmp")]
    ck.load_checkpoint(str(out / "ckpt.pt"))
    r = run_cli("train", *tiny_train_args(char_data, out, max_iters=20, eval_interval=5, init_from="resume"))
    assert r.returncode == 0, r.stderr  # with room again, the run continues from the kept checkpoint


@pytest.mark.parametrize("torn", ["12 train 2.3", '{"step": 12, "kind": "train", "lo'])
def test_a_line_torn_by_a_crash_is_dropped_on_resume(tmp_path, torn):
    from gptforge.train.metrics import Metrics

    m = Metrics(str(tmp_path), resume_step=None)
    for step in range(12):
        m.log(step, "train", loss=2.0, lr=1e-3, ms_per_iter=1.0)
    m.close()
    for name in ("log.txt", "metrics.jsonl"):
        with open(tmp_path / name, "a") as fh:
            fh.write(torn)  # no newline: the process died inside this write
    Metrics(str(tmp_path), resume_step=20).close()
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert lines[-1] == "11 train 2.000000" and len(lines) == 12
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(range(12))


def test_a_full_disk_under_the_metrics_files_is_a_clear_error(tmp_path):
    """/dev/full refuses every write with ENOSPC, as a full disk does."""
    from gptforge.core.errors import UserError
    from gptforge.train.metrics import Metrics

    m = Metrics(str(tmp_path))
    m.jsonl.close()
    m.jsonl.fh = open("/dev/full", "w")
    with pytest.raises(UserError, match="No space left on device; free space or choose another --out_dir"):
        m.log(3, "train", loss=2.0, lr=1e-3, ms_per_iter=1.0)
    m.close()

"""`--resume=auto`: the same command starts a run and continues it (a requeued or restarted job), through the real
CLI (a run that is only there to be started again is trained in this process): an empty out_dir, a finished run, a
damaged ckpt.pt beside a good step checkpoint, nothing readable; the choice of the newest checkpoint; and the random
streams of a resume on another number of processes."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from conftest import run_cli, tiny_train_args, train_in_process
from gptforge.core.distributed import DistEnv
from gptforge.core.errors import UserError
from gptforge.train.runstate import capture_rng, derived_seed, restore_run_state
from gptforge.weights.checkpoint import load_checkpoint, load_resumable, save_checkpoint

RUN = dict(max_iters=10, lr_decay_iters=20, warmup_iters=5, eval_interval=5, resume="auto")


def digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def weights(path) -> dict[str, torch.Tensor]:
    return load_checkpoint(str(path))["model"]


def test_an_empty_out_dir_starts_a_new_run_as_init_from_says(char_data, tmp_path):
    auto, never = tmp_path / "auto", tmp_path / "never"
    r = run_cli("train", *tiny_train_args(char_data, auto, **RUN), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"resume=auto: no checkpoint in {auto}; a new run (init_from=scratch)"
    r = run_cli("train", *tiny_train_args(char_data, never, **{**RUN, "resume": "never"}), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resume=auto" not in r.stdout
    a, b = weights(auto / "ckpt.pt"), weights(never / "ckpt.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)  # auto on an empty folder is exactly a new run


def test_a_finished_run_is_left_as_it_is(char_data, tmp_path):
    """The requeue of a job whose run had ended: it says so first, trains nothing and leaves every file of the
    folder byte for byte as it was (metrics.jsonl keeps its final evaluation and `end` record, log.txt its last
    val line, config.json is not rewritten)."""
    out = tmp_path / "run"
    args = tiny_train_args(char_data, out, **RUN)
    train_in_process(*args)  # the run that had ended; its requeue below is the real command
    before = digests(out)
    assert {"ckpt.pt", "config.json", "metrics.jsonl", "log.txt"} <= set(before)
    r = run_cli("train", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"resume=auto: the run in {out} is finished (iter 10 of max_iters 10); nothing to do"
    ]
    assert digests(out) == before


def test_a_damaged_ckpt_pt_resumes_from_the_good_step_checkpoint_exactly(char_data, tmp_path):
    """A 20-step job stopped after 10 whose ckpt.pt was then damaged (and its step-10 file lost): the same command
    again continues from model_00005.pt and ends with the weights of an uninterrupted 20-step run."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    full = {**RUN, "max_iters": 20, "ckpt_interval": 5}
    assert run_cli("train", *tiny_train_args(char_data, whole, **full), cwd=tmp_path).returncode == 0
    first = tiny_train_args(char_data, split, **{**full, "max_iters": 10})
    assert run_cli("train", *first, cwd=tmp_path).returncode == 0
    assert sorted(p.name for p in split.glob("*.pt")) == ["ckpt.pt", "ckpt_best.pt", "model_00005.pt", "model_00010.pt"]
    (split / "model_00010.pt").unlink()
    (split / "ckpt_best.pt").unlink()
    (split / "ckpt.pt").write_bytes((split / "ckpt.pt").read_bytes()[:5000])  # torn
    r = run_cli("train", *tiny_train_args(char_data, split, **full), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"cannot read checkpoint {split / 'ckpt.pt'}: the file is truncated" in r.stdout
    assert f"resume=auto: resuming {split} from iter 5 ({split / 'model_00005.pt'})" in r.stdout
    a, b = weights(whole / "ckpt.pt"), weights(split / "ckpt.pt")
    assert load_checkpoint(str(split / "ckpt.pt"))["iter_num"] == 20
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (whole / "log.txt").read_text() == (split / "log.txt").read_text()


def test_nothing_readable_is_an_error_and_nothing_is_overwritten(char_data, tmp_path):
    out = tmp_path / "run"
    train_in_process(*tiny_train_args(char_data, out, **RUN))  # the run whose checkpoints are then damaged
    for name in ("ckpt.pt", "ckpt_best.pt"):
        (out / name).write_bytes(b"not a checkpoint")
    before = digests(out)
    r = run_cli("train", *tiny_train_args(char_data, out, **RUN), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"no other readable checkpoint in {out}: move these files away (or choose another --out_dir)" in r.stderr
    assert digests(out) == before


def fake_checkpoint(path, iter_num: int) -> None:
    save_checkpoint(str(path), {"model": {}, "model_args": {}, "iter_num": iter_num})


def test_auto_takes_the_newest_checkpoint_and_init_from_resume_keeps_ckpt_pt(tmp_path):
    """ckpt.pt is written at evaluations (when val loss improved); a step checkpoint can be newer."""
    fake_checkpoint(tmp_path / "ckpt.pt", 10)
    fake_checkpoint(tmp_path / "ckpt_best.pt", 10)
    fake_checkpoint(tmp_path / "model_00005.pt", 5)
    fake_checkpoint(tmp_path / "model_00015.pt", 15)
    ckpt, path, problems = load_resumable(str(tmp_path), newest=True)
    assert (path, ckpt["iter_num"], problems) == (str(tmp_path / "model_00015.pt"), 15, [])
    ckpt, path, _ = load_resumable(str(tmp_path))
    assert (path, ckpt["iter_num"]) == (str(tmp_path / "ckpt.pt"), 10)
    (tmp_path / "model_00015.pt").write_bytes(b"torn")  # a damaged newer one is passed over, and named
    ckpt, path, problems = load_resumable(str(tmp_path), newest=True)
    assert (path, ckpt["iter_num"]) == (str(tmp_path / "ckpt.pt"), 10)
    assert len(problems) == 1 and "model_00015.pt" in problems[0]
    (tmp_path / "ckpt.pt").unlink()  # a missing ckpt.pt is no problem to report under auto
    ckpt, path, problems = load_resumable(str(tmp_path), newest=True)
    assert (path, ckpt["iter_num"]) == (str(tmp_path / "ckpt_best.pt"), 10)  # newer than model_00005.pt
    assert len(problems) == 1 and "model_00015.pt" in problems[0]
    with pytest.raises(UserError, match="no checkpoint in .*empty: move these files away"):
        load_resumable(str(tmp_path / "empty"), newest=True)


def test_a_last_step_checkpoint_under_its_old_name_is_still_the_newest(tmp_path):
    """Before, the last step checkpoint was named for the step taken (model_00019.pt holding iteration 20); such a
    file beside an older ckpt.pt is still found as the newest."""
    fake_checkpoint(tmp_path / "ckpt.pt", 15)
    fake_checkpoint(tmp_path / "model_00019.pt", 20)
    ckpt, path, problems = load_resumable(str(tmp_path), newest=True)
    assert (path, ckpt["iter_num"], problems) == (str(tmp_path / "model_00019.pt"), 20, [])


def draws() -> tuple[float, float, tuple[float, ...]]:
    return random.random(), float(np.random.rand()), tuple(torch.rand(3).tolist())


def test_another_world_size_re_derives_every_ranks_streams(tmp_path):
    """Same world size: each rank gets its own saved streams back. Another: each rank's streams are seeded from
    (seed, iter, rank): the same on every such resume, different for each rank, and never the saved ones."""
    streams = []
    for seed in (1, 2):
        torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
        streams.append(capture_rng())
    ckpt = {"iter_num": 40, "rng": streams[0], "rng_per_rank": streams}

    saved_draws = []
    for rank in (0, 1):
        assert restore_run_state(ckpt, DistEnv(rank=rank, world_size=2), None, seed=1337) == ""
        saved_draws.append(draws())
    for rank, state in enumerate(streams):  # the reference: the saved state itself
        from gptforge.train.runstate import restore_rng

        restore_rng(state)
        assert draws() == saved_draws[rank]

    derived = {}
    for world in (1, 3):
        for rank in range(world):
            told = restore_run_state(ckpt, DistEnv(rank=rank, world_size=world), None, seed=1337)
            assert told == (
                f"checkpoint written by 2 process(es), resumed on {world}: each rank's random streams (dropout, "
                "the random loader's batches) re-derived from (seed 1337, iter 40, rank)"
            )
            derived[(world, rank)] = draws()
            seed = derived_seed(1337, 40, rank)  # the reference: fresh generators seeded with the derived seed
            gen = torch.Generator().manual_seed(seed)
            assert derived[(world, rank)][2] == tuple(torch.rand(3, generator=gen).tolist())
            assert derived[(world, rank)][0] == random.Random(seed).random()
            assert derived[(world, rank)][1] == float(np.random.RandomState(seed % 2**32).rand())
    assert derived[(1, 0)] == derived[(3, 0)]  # a function of (seed, iter, rank) only
    assert len({derived[(3, r)] for r in range(3)}) == 3
    assert derived[(1, 0)] not in saved_draws
    assert derived_seed(1337, 41, 0) != derived_seed(1337, 40, 0) != derived_seed(1338, 40, 0)

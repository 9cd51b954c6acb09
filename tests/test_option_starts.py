"""Every option either applies, is refused, or is named as not applied, for each way a run can start: from scratch,
resumed (--init_from=resume, --resume=auto with and without a checkpoint) and from Hugging Face weights (a folder
`gptforge export` wrote). One row per (start, options): the exit code, and the words the user reads. Through the
real CLI; a refusal is exit 2 naming the key, with no traceback, and writes nothing. The runs a row starts from are
trained (and exported) in this process: they are not what the row tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli, tiny_train_args, train_in_process

BASE = dict(max_iters=4, lr_decay_iters=8, warmup_iters=1, eval_interval=4, eval_iters=1)


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    """A char dataset, a finished 4-step run (to resume), and its export (Hugging Face weights to start from)."""
    from conftest import SMALL_TEXT
    from gptforge.data.prepare import prepare
    from gptforge.weights.export import export_run

    root = tmp_path_factory.mktemp("starts")
    (root / "tiny.txt").write_text(SMALL_TEXT)
    prepare("text", data_dir=str(root / "data"), files=[str(root / "tiny.txt")], name="tiny", tokenizer="char")
    train_in_process(*tiny_train_args(root / "data", root / "run", **BASE))
    export_run(str(root / "run"), None, str(root / "hf"), "f16", force=False)
    return root


def start(root: Path, how: str, out: Path) -> list[str]:
    """The arguments of one way to start (max_iters 6: a resumed run trains on)."""
    args = tiny_train_args(root / "data", out, **{**BASE, "max_iters": 6})
    if how == "scratch":
        return args
    if how == "resume":
        return [*args, "--init_from=resume"]
    if how.startswith("auto"):
        return [*args, "--resume=auto"]
    return [*args, f"--init_from={root / 'hf'}"]  # "weights"


ROWS = [  # (start, options, exit code, words the output must hold)
    ("scratch", ["--rotary=True", "--optimizer=muon"], 0, ["recipe: model switches on: rotary; optimizer muon"]),
    ("scratch", ["--gelu=tanh"], 0, ["recipe: model switches on: gelu=tanh"]),  # GPT-2's GELU, not nanoGPT's
    ("scratch", ["--gelu=sigmoid"], 2, ["--gelu: gelu must be one of erf, tanh; got 'sigmoid'"]),
    ("resume", ["--gelu=tanh"], 2, ["--gelu=tanh: the run in", "has gelu='erf'", "keeps its shape"]),
    ("resume", ["--n_layer=3"], 2, ["--n_layer=3: the run in", "has n_layer=2"]),
    ("resume", ["--rotary=True"], 2, ["--rotary=True: the run in", "keeps its shape"]),
    ("resume", ["--optimizer=muon"], 2, ["--optimizer=muon:", "holds adamw's optimizer state"]),
    ("scratch", ["--embedding_lr_scale=10.0"], 2, ["--embedding_lr_scale=10.0: the embedding is tied to the output"]),
    (
        "scratch",
        ["--untie_head=True", "--embedding_lr_scale=10.0", "--optimizer=muon", "--muon_split_qkv=True"]
        + ["--normuon=True"],
        0,
        ["untie_head", "optimizer muon", "q, k, v apart, NorMuon; AdamW"],
    ),  # fmt: skip
    (
        "scratch",
        ["--normuon=True", "--muon_lr=0.05"],
        0,
        ["Muon's muon_lr=0.05, normuon=True not applied: the optimizer is adamw"],
    ),
    ("resume", ["--muon_split_qkv=True"], 0, ["Muon's muon_split_qkv=True not applied: the optimizer is adamw"]),
    ("resume", ["--dropout=0.1"], 0, ["changed from the run's config.json: dropout 0.0 -> 0.1"]),
    ("resume", ["--learning_rate=0.001"], 0, ["learning_rate 0.003 -> 0.001"]),
    ("auto, a checkpoint", ["--rmsnorm=True"], 2, ["--rmsnorm=True: the run in", "keeps its shape"]),
    ("auto, none", ["--rmsnorm=True"], 0, ["no checkpoint in", "model switches on: rmsnorm"]),
    ("weights", [], 0, ["hf: bias True (the weights' shape)"]),  # the other shape keys were given as the weights'
    ("weights", ["--n_head=4"], 2, ["--n_head=4 (the weights: 2)"]),
    ("weights", ["--n_layer=3"], 2, ["--n_layer=3 (the weights: 2)", "fix the model's shape"]),
    ("weights", ["--rotary=True"], 2, ["--rotary=True (the weights: False)"]),
    ("weights", ["--gelu=tanh"], 2, ["--gelu='tanh' (the weights: 'erf')"]),  # the export says activation 'gelu'
    ("weights", ["--block_size=16"], 0, ["16 block"]),  # cropped: applies
    ("weights", ["--block_size=64"], 2, ["block_size 64 does not fit", "32 positions"]),
    ("weights", ["--optimizer=muon", "--dropout=0.1"], 0, ["optimizer muon", "dropout 0.1"]),
]


@pytest.mark.parametrize("how,options,code,words", ROWS, ids=[f"{r[0]}: {' '.join(r[1]) or '-'}" for r in ROWS])
def test_an_option_applies_is_refused_or_is_named(starts, tmp_path, how, options, code, words):
    out = tmp_path / "out"
    if how in ("resume", "auto, a checkpoint"):
        train_in_process(*start(starts, "scratch", out), "--max_iters=4")
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()} if out.exists() else {}
    r = run_cli("train", *start(starts, how, out), *options, cwd=tmp_path)
    text = r.stdout + r.stderr
    assert r.returncode == code, text
    assert "Traceback" not in text
    for w in words:
        assert w in " ".join(text.split()), f"{w!r} not in:\n{text}"
    if code == 2:  # refused: nothing written
        assert ({p.name: p.stat().st_mtime_ns for p in out.iterdir()} if out.exists() else {}) == stamps
    else:  # applied: the run's config.json records it
        saved = json.loads((out / "config.json").read_text())
        for option in options:
            key, value = option[2:].split("=")
            assert str(saved[key]) == value, (key, saved[key])


def test_a_resume_that_moves_the_embedding_into_or_out_of_its_own_group_is_refused(starts, tmp_path):
    """embedding_lr_scale 1 and any other value lay the optimizer state out differently (the embedding in a group
    of its own): a resume across them is exit 2 naming the flag, writing nothing; another value than 1 on both
    sides resumes, the new one applied."""
    out = tmp_path / "untied"
    untied = ["--untie_head=True", "--optimizer=muon"]
    train_in_process(*start(starts, "scratch", out), *untied, "--max_iters=4")
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    r = run_cli("train", *start(starts, "resume", out), "--embedding_lr_scale=4.0", cwd=tmp_path)
    text = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and "Traceback" not in text, text
    assert "--embedding_lr_scale=4.0:" in text and "resume with --embedding_lr_scale=1.0" in text, text
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    other = tmp_path / "scaled"
    train_in_process(*start(starts, "scratch", other), *untied, "--embedding_lr_scale=4.0", "--max_iters=4")
    r = run_cli("train", *start(starts, "resume", other), "--embedding_lr_scale=2.0", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "embedding_lr_scale 4.0 -> 2.0" in " ".join(r.stdout.split())
    assert json.loads((other / "config.json").read_text())["embedding_lr_scale"] == 2.0


def test_every_muon_only_setting_is_named_when_not_applied():
    """The settings whose help says they are optimizer='muon''s are the ones the recipe line names as not applied
    to another optimizer (a new Muon setting added to the config and not to MUON_ONLY fails here)."""
    import dataclasses

    from gptforge.core.config import TrainConfig
    from gptforge.train.setup import MUON_ONLY, recipe_line

    muon_only = [f.name for f in dataclasses.fields(TrainConfig) if f.metadata["doc"].startswith("optimizer='muon'")]
    assert sorted(muon_only) == sorted(MUON_ONLY)
    changed = {"muon_lr": 0.5, "muon_momentum": 0.5, "muon_warmup": 7, "muon_dtype": "float32"}
    changed |= {"muon_split_qkv": True, "normuon": True}
    line = recipe_line(dataclasses.replace(TrainConfig(), **changed))
    assert all(f"{k}={v}" in line for k, v in changed.items()) and "the optimizer is adamw" in line, line
    assert recipe_line(TrainConfig()) == ""  # nanoGPT's settings: no line

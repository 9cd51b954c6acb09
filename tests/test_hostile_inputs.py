"""Hostile inputs, end to end: every row drives the real CLI in a subprocess and expects the project's rule.

Bad input gets one clear message naming the flag or file and what to do, exit status 2, no traceback, and
nothing already written is lost. Each row copies a good workspace (a prepared char dataset `data/tiny` and a
finished tiny run `run/`), breaks it, snapshots every file (name and sha256), runs the command there and checks:

    status 2; no "Traceback"; stderr names the flag / file and gives a hint;
    the snapshot is unchanged (no file lost, rewritten or half-written, none added);
    inputs that try to run code (pickles with __reduce__, config files) did not create their marker file.

The rows for config and data are here; those for checkpoints, disk, dashboard and sample are in
test_hostile_inputs_run.py; the workspace, the builders and the check they share are in hostile_tools.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hostile_tools import (
    CKPT,
    Case,
    check_row,
    cut,
    do,
    edit_meta,
    evil_meta_pkl,
    just,
    train,
    workspace_template,  # noqa: F401 (a fixture, used by test_hostile_input)
    write,
)

GRAD_ACCUM_ACROSS_2_RANKS = Case(
    just(train("--backend=gloo", "--gradient_accumulation_steps=3")),
    "gradient_accumulation_steps=3",
    "make it a multiple of 2",
    torchrun=True,
)

ROWS = [
    # --- config ----------------------------------------------------------------------------------------------
    pytest.param(
        Case(just(train("--learning_rat=1e-3")), "'learning_rat'", "did you mean learning_rate"),
        id="config-unknown-key",
    ),
    pytest.param(
        Case(just(train("--batch_size=big")), "--batch_size", "batch_size must be int, got 'big'"),
        id="config-wrong-type-int",
    ),
    pytest.param(
        Case(just(train("--compile=maybe")), "--compile", "True, False or 'auto'"), id="config-wrong-type-bool"
    ),
    pytest.param(
        Case(just(train("--dtype=fp16")), "--dtype", "one of auto, float32, bfloat16, float16"),
        id="config-dtype-not-a-choice",
    ),
    pytest.param(
        Case(just(train("--batch_size")), "--batch_size", "--batch_size=VALUE"), id="config-flag-without-value"
    ),
    pytest.param(
        Case(just(train("--n_embd=33")), "n_embd=33", "change --n_embd or --n_head"),
        id="config-n_embd-not-divisible-by-n_head",
    ),
    pytest.param(
        Case(just(train("--block_size=2000")), "data/tiny/val.bin", "smaller --block_size or more data"),
        id="config-block_size-longer-than-val-split",
    ),
    pytest.param(GRAD_ACCUM_ACROSS_2_RANKS, id="config-grad-accum-not-divisible-across-2-ranks-torchrun"),
    pytest.param(
        # rank 1 meets the mistake first: rank 0 must still be there to say it (a CI failure)
        dataclasses.replace(GRAD_ACCUM_ACROSS_2_RANKS, rank0_late=4.0),
        id="config-grad-accum-not-divisible-torchrun-rank-0-late",
    ),
    pytest.param(
        Case(just(train("--eval_iters=0")), "--eval_iters", "must be a positive integer"), id="config-eval_iters-0"
    ),
    pytest.param(
        Case(just(train("--learning_rate=-1e-3")), "--learning_rate", "must not be negative"),
        id="config-negative-learning-rate",
    ),
    pytest.param(
        Case(just(train("--learning_rate=1e999")), "--learning_rate", "must be a finite number"),
        id="config-infinite-learning-rate",
    ),
    pytest.param(
        Case(just(train("--dashboard_port=70000")), "--dashboard_port", "0-65535"),
        id="config-dashboard_port-out-of-range",
    ),
    pytest.param(
        Case(just(train("--dataset=nope")), "data/nope", "gptforge prepare nope"), id="config-unknown-dataset"
    ),
    pytest.param(
        Case(just(train("--init_from=restart")), "--init_from", "'scratch', 'resume'"), id="config-unknown-init_from"
    ),
    pytest.param(Case(just(train(files=("missing.py",))), "'missing.py'", "check the path"), id="config-file-missing"),
    pytest.param(
        Case(
            write("evil.py", 'import os\nos.system("touch MARKER")\nbatch_size = 4\n', train(files=("evil.py",))),
            "evil.py:2",
            "only `name = value` lines",
            runs_code=True,
        ),
        id="config-file-with-import-and-call",
    ),
    pytest.param(
        Case(
            write("evil.py", 'batch_size = __import__("os").system("touch MARKER")\n', train(files=("evil.py",))),
            "evil.py:1",
            "read as data, never run",
            runs_code=True,
        ),
        id="config-file-value-that-is-code",
    ),
    pytest.param(
        Case(
            write("latin.py", b"batch_size = 4\n# caf\xe9\n", train(files=("latin.py",))),
            "config file latin.py",
            "not UTF-8 text",
        ),
        id="config-file-not-utf8",
    ),
    pytest.param(
        Case(just(train(files=(CKPT,))), f"config file {CKPT}", "was another file given in its place"),
        id="config-file-is-a-checkpoint",
    ),
    pytest.param(
        Case(just(train(files=("data",))), "'data' is a folder", "give a config file in it"),
        id="config-file-is-a-folder",
    ),
    pytest.param(
        Case(just(train("--init_from=resume", "--n_layer=3")), "--n_layer=3", "a resumed model keeps its shape"),
        id="resume-shape-change",
    ),
    pytest.param(
        Case(
            write("run/config.json", "{not json", train("--init_from=resume")), "run/config.json", "not readable JSON"
        ),
        id="resume-config-json-damaged",
    ),
    pytest.param(
        Case(just(train("--n_embd=65536", "--n_head=16")), "available: lower --n_embd", "--batch_size or --block_size"),
        id="config-model-too-big-for-memory",
    ),
    pytest.param(
        Case(just(train("--block_size=100000000")), "GB available: lower", "--batch_size or --block_size"),
        id="config-block_size-too-big-for-memory",
    ),
    # --- data: train from scratch over the finished run, which must survive the failed start ------------------
    pytest.param(
        Case(just(train(data_dir="nodata")), "nodata/tiny", "gptforge prepare tiny"), id="data-missing-dataset-folder"
    ),
    pytest.param(
        Case(
            do(lambda ws: cut(ws / "data/tiny/train.bin", -1), train()),
            "data/tiny/train.bin",
            "not a whole number of uint16 tokens",
        ),
        id="data-bin-not-whole-tokens",
    ),
    pytest.param(
        Case(
            do(lambda ws: cut(ws / "data/tiny/train.bin", 18000), train()),
            "data/tiny/train.bin",
            "records 9,450.*Re-run `gptforge prepare`",
        ),
        id="data-bin-cut-short-by-whole-tokens",
    ),
    pytest.param(
        Case(
            do(lambda ws: edit_meta(ws, vocab_size=20, itos=list("abcdefghijklmnopqrst")), train()),
            "data/tiny/train.bin",
            "vocab_size 20.*Re-run `gptforge prepare`",
        ),
        id="data-token-ids-beyond-meta-vocab_size",
    ),
    pytest.param(
        Case(
            do(lambda ws: cut(ws / "data/tiny/val.bin", 0), train()),
            "data/tiny/val.bin",
            "empty; re-run `gptforge prepare`",
        ),
        id="data-empty-val-split",
    ),
    pytest.param(
        Case(
            do(lambda ws: (ws / "data/tiny/meta.json").unlink(), train()),
            "data/tiny",
            "meta.json is missing.*Put its meta.json back",
        ),
        id="data-meta-missing-in-char-folder",
    ),
    pytest.param(
        Case(
            do(lambda ws: (edit_meta(ws, dtype="uint32"), cut(ws / "data/tiny/train.bin", -2)), train()),
            "data/tiny/",
            "uint32.*(re-run|Re-run) `gptforge prepare`",
        ),
        id="data-meta-says-uint32-files-uint16-odd-count",
    ),
    pytest.param(
        Case(
            do(lambda ws: edit_meta(ws, dtype="uint32"), train()),
            "data/tiny/train.bin",
            "records 9,450.*Re-run `gptforge prepare`",
        ),
        id="data-meta-says-uint32-files-uint16-even-count",
    ),
    pytest.param(
        Case(
            do(lambda ws: edit_meta(ws, itos=list("abc")), train()),
            "data/tiny/meta.json",
            "list of vocab_size=34 chars",
        ),
        id="data-meta-itos-length-not-vocab_size",
    ),
    pytest.param(
        Case(
            write("data/tiny/meta.json", '{"vocab_size": 34, "tokenizer": ', train()),
            "data/tiny/meta.json",
            "not readable JSON.*re-run `gptforge prepare`",
        ),
        id="data-meta-malformed-json",
    ),
    pytest.param(
        Case(do(evil_meta_pkl, train()), "data/tiny/meta.pkl", "refusing to load posix.system", runs_code=True),
        id="data-meta-pkl-that-runs-code",
    ),
]


@pytest.mark.parametrize("case", ROWS)
def test_hostile_input(case: Case, workspace_template: Path, tmp_path: Path):  # noqa: F811
    check_row(case, workspace_template, tmp_path)


def test_every_row_has_a_distinct_readable_id():
    from test_hostile_inputs_run import ROWS as RUN_ROWS

    ids = [p.id for p in ROWS + RUN_ROWS]
    assert len(ids) == len(set(ids)) and all(re.fullmatch(r"[a-z0-9_-]+", i) for i in ids)

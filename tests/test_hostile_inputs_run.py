"""Hostile inputs against the finished run, end to end: damaged or foreign checkpoints (resume and sample), disk
trouble, dashboard, sample and serve options. Same rule and check as test_hostile_inputs.py (hostile_tools.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hostile_tools import (
    CKPT,
    Case,
    check_row,
    cut,
    do,
    edit_checkpoint,
    evil_checkpoint,
    just,
    port_in_use,
    sample,
    serve,
    serve_more_rows_than_memory,
    train,
    unwritable_out_dir,
    wider_dataset,
    workspace_template,  # noqa: F401 (a fixture, used by test_hostile_input)
    write,
)

NOT_A_CHECKPOINT = r"damaged|truncated|not a (gptforge or nanoGPT )?checkpoint|corrupt"
ROWS = [
    # --- checkpoints: resume with train, and sample ----------------------------------------------------------
    pytest.param(
        Case(
            do(lambda ws: (ws / CKPT).unlink(), train(init_from="resume", max_iters=6)), CKPT, "not found; train first"
        ),
        id="ckpt-missing-train-resume",
    ),
    pytest.param(
        Case(do(lambda ws: (ws / CKPT).unlink(), sample()), CKPT, "not found; train first"), id="ckpt-missing-sample"
    ),
    pytest.param(
        Case(
            do(lambda ws: cut(ws / CKPT, (ws / CKPT).stat().st_size // 2), train(init_from="resume", max_iters=6)),
            CKPT,
            NOT_A_CHECKPOINT,
        ),
        id="ckpt-truncated-train-resume",
    ),
    pytest.param(
        Case(do(lambda ws: cut(ws / CKPT, (ws / CKPT).stat().st_size // 2), sample()), CKPT, NOT_A_CHECKPOINT),
        id="ckpt-truncated-sample",
    ),
    pytest.param(Case(do(lambda ws: cut(ws / CKPT, 0), sample()), CKPT, NOT_A_CHECKPOINT), id="ckpt-empty-file-sample"),
    pytest.param(
        Case(
            write(CKPT, random.Random(0).randbytes(5000), train(init_from="resume", max_iters=6)),
            CKPT,
            NOT_A_CHECKPOINT,
            forbid="run code",
        ),
        id="ckpt-random-bytes-train-resume",
    ),
    pytest.param(
        Case(write(CKPT, random.Random(0).randbytes(5000), sample()), CKPT, NOT_A_CHECKPOINT, forbid="run code"),
        id="ckpt-random-bytes-sample",
    ),
    pytest.param(
        Case(
            write(CKPT, "hello, I am not a checkpoint\n", train(init_from="resume", max_iters=6)),
            CKPT,
            NOT_A_CHECKPOINT,
        ),
        id="ckpt-text-file-train-resume",
    ),
    pytest.param(
        Case(write(CKPT, "hello, I am not a checkpoint\n", sample()), CKPT, NOT_A_CHECKPOINT),
        id="ckpt-text-file-sample",
    ),
    pytest.param(
        Case(
            do(lambda ws: edit_checkpoint(ws, n_embd=64), train(init_from="resume", max_iters=6)),
            CKPT,
            "saved with other model settings",
        ),
        id="ckpt-other-model-shape-train-resume",
    ),
    pytest.param(
        Case(do(lambda ws: edit_checkpoint(ws, n_layer=3), sample()), CKPT, "saved with other model settings"),
        id="ckpt-other-model-shape-sample",
    ),
    pytest.param(
        Case(
            do(wider_dataset, train(init_from="resume", max_iters=6, dataset="wide")),
            "'wide'",
            "resume on the dataset the model was trained on",
        ),
        id="ckpt-resume-on-a-dataset-with-a-larger-vocabulary",
    ),
    pytest.param(
        Case(do(evil_checkpoint, train(init_from="resume", max_iters=6)), CKPT, "can run code", runs_code=True),
        id="ckpt-pickle-that-runs-code-train-resume",
    ),
    pytest.param(
        Case(do(evil_checkpoint, sample()), CKPT, "can run code", runs_code=True),
        id="ckpt-pickle-that-runs-code-sample",
    ),
    pytest.param(
        Case(
            just(train("--sample_interval=2", "--sample_prompt=Zebra", init_from="resume", max_iters=6)),
            "--sample_prompt",
            "use only characters from its training text",
        ),
        id="resume-with-sample_prompt-outside-the-vocabulary",
    ),
    # --- disk ------------------------------------------------------------------------------------------------
    pytest.param(
        Case(
            write("afile", "a regular file\n", train(out_dir="afile/run")),
            "--out_dir=afile/run",
            "Not a directory.*choose another folder",
        ),
        id="disk-out_dir-under-a-regular-file",
    ),
    pytest.param(
        Case(unwritable_out_dir, "--out_dir=", "(Permission denied|Operation not permitted).*choose another folder"),
        id="disk-out_dir-parent-not-writable",
    ),
    pytest.param(
        Case(just(["export", "--out_dir=run", "--to=run", "--force"]), "--to=", "choose another folder"),
        id="disk-export-over-the-run-folder",
    ),
    pytest.param(
        Case(write("empty.txt", "", ["prepare", "text", "empty.txt", "--name=tiny"]), "empty.txt", "give more text"),
        id="disk-prepare-empty-text-over-a-dataset",
    ),
    pytest.param(
        Case(write("five.txt", "hello", ["prepare", "text", "five.txt", "--name=tiny"]), "five.txt", "at least 9"),
        id="disk-prepare-five-characters-over-a-dataset",
    ),
    pytest.param(
        Case(
            write("latin1.txt", b"caf\xe9\n" * 50, ["prepare", "text", "latin1.txt", "--name=tiny"]),
            "latin1.txt",
            "convert it to UTF-8",
        ),
        id="disk-prepare-non-utf8-text-over-a-dataset",
    ),
    # --- dashboard -------------------------------------------------------------------------------------------
    pytest.param(
        Case(just(["dashboard", "nowhere", "--port=0"]), "nowhere", "no such folder"), id="dashboard-folder-missing"
    ),
    pytest.param(
        Case(just(["dashboard", "run/log.txt", "--port=0"]), "run/log.txt is a file", r"give its run folder \(run\)"),
        id="dashboard-a-file-given",
    ),
    pytest.param(
        Case(just(["train", "run/ckpt.pt/x.py"]), "run/ckpt.pt/x.py", "not found"), id="config-file-under-a-file"
    ),
    pytest.param(
        Case(
            lambda ws, held: ["dashboard", "run", f"--port={port_in_use(held)}"],
            "--port",
            "Address already in use.*--port 0 picks a free one",
        ),
        id="dashboard-port-in-use",
    ),
    pytest.param(
        Case(just(["dashboard", "run", "--port=70000"]), "--port", "0-65535"), id="dashboard-port-out-of-range"
    ),
    # --- sample ----------------------------------------------------------------------------------------------
    pytest.param(
        Case(just(sample("--start=FILE:missing.txt")), "--start=FILE:missing.txt", "No such file"),
        id="sample-start-file-missing",
    ),
    pytest.param(
        Case(
            write("latin1.txt", b"caf\xe9\n", sample("--start=FILE:latin1.txt")),
            "--start=FILE:latin1.txt",
            "convert it to UTF-8",
        ),
        id="sample-start-file-not-utf8",
    ),
    pytest.param(
        Case(just(sample("--start=Zebra")), "--start", "use only characters from its training text"),
        id="sample-start-outside-the-vocabulary",
    ),
    pytest.param(Case(just(sample("--num_samples=0")), "--num_samples", "positive integer"), id="sample-num_samples-0"),
    pytest.param(
        Case(just(sample("--max_new_tokens=-5")), "--max_new_tokens", "positive integer"),
        id="sample-negative-max_new_tokens",
    ),
    pytest.param(
        Case(just(sample("--temperature=-1")), "--temperature", r">= 0 \(0 = greedy\)"),
        id="sample-negative-temperature",
    ),
    pytest.param(
        Case(just(sample("--temperature=nan")), "--temperature", "finite number"), id="sample-nan-temperature"
    ),
    # --- serve: every option checked before the model loads (hostile_tools.serve), the last two before it compiles --
    pytest.param(
        Case(just(serve("--port=-5")), "--port=-5", "0-65535.*--port 0 picks a free one"), id="serve-port-negative"
    ),
    pytest.param(Case(just(serve("--port=70000")), "--port=70000", "0-65535"), id="serve-port-out-of-range"),
    pytest.param(
        Case(
            lambda ws, held: serve(f"--port={port_in_use(held)}"),
            "--port",
            "Address already in use.*choose another --port.*--port 0 picks a free one",
        ),
        id="serve-port-in-use",
    ),
    pytest.param(Case(just(serve("--host=")), "--host is empty", "127.0.0.1.*0.0.0.0"), id="serve-host-empty"),
    pytest.param(
        Case(just(serve("--host=192.0.2.1")), "--host=192.0.2.1", "not an address of this machine.*give 127.0.0.1"),
        id="serve-host-not-this-machine",  # 192.0.2.0/24: reserved for documentation, never a machine's address
    ),
    pytest.param(
        Case(just(serve("--api_key=")), "--api_key is empty", "leave --api_key out"), id="serve-api_key-empty"
    ),
    pytest.param(Case(just(serve("--api_key=my key")), "--api_key", "visible ASCII"), id="serve-api_key-with-a-space"),
    pytest.param(Case(just(serve("--name= ")), "--name", "leave --name out"), id="serve-name-blank"),
    pytest.param(Case(just(serve("--max_batch=0")), "--max_batch=0", "1 or more"), id="serve-max_batch-0"),
    pytest.param(Case(just(serve("--max_messages=0")), "--max_messages=0", "1 or more"), id="serve-max_messages-0"),
    pytest.param(
        Case(just(serve("--max_tokens=-1")), "--max_tokens=-1", r"or 0 \(the context\)"), id="serve-negative-max_tokens"
    ),
    pytest.param(
        Case(just(serve("--max_body_mb=nan")), "--max_body_mb=nan", "at least 0.001"), id="serve-max_body_mb-nan"
    ),
    pytest.param(
        Case(
            just(serve("--max_tokens=1000", out_dir="run")), "--max_tokens=1000", r"context \(32 tokens\).*at most 32"
        ),
        id="serve-max_tokens-over-the-context",
    ),
    pytest.param(
        Case(serve_more_rows_than_memory, "--max_batch=10000000000", r"KV cache needs .* give --max_batch=\d+ or less"),
        id="serve-max_batch-over-the-memory",
    ),
]


@pytest.mark.parametrize("case", ROWS)
def test_hostile_input(case: Case, workspace_template: Path, tmp_path: Path):  # noqa: F811
    check_row(case, workspace_template, tmp_path)

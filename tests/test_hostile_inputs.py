"""Hostile inputs, end to end: every row drives the real CLI in a subprocess and expects the project's rule.

Bad input gets one clear message naming the flag or file and what to do, exit status 2, no traceback, and
nothing already written is lost. Each row copies a good workspace (a prepared char dataset `data/tiny` and a
finished tiny run `run/`), breaks it, snapshots every file (name and sha256), runs the command there and checks:

    status 2; no "Traceback"; stderr names the flag / file and gives a hint;
    the snapshot is unchanged (no file lost, rewritten or half-written, none added);
    inputs that try to run code (pickles with __reduce__, config files) did not create their marker file.

The rows for config, model shapes, data and chat rows against a model's context (on the workspace with chat data
and models added: chat_template) are here; those for checkpoints, disk, dashboard and sample are in
test_hostile_inputs_run.py; the workspace, the builders and the check they share are in hostile_tools.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from hostile_tools import (
    CKPT,
    Case,
    check_row,
    cut,
    do,
    edit_checkpoint,
    edit_meta,
    evil_meta_pkl,
    just,
    sample,
    train,
    workspace_template,  # noqa: F401 (a fixture, used by test_hostile_input)
    write,
)

ODD_ROTARY = ("--rotary=True", "--n_embd=30", "--n_head=2")  # head size 15: rotary turns channels in pairs
ODD_ROTARY_FIX = "n_embd / n_head = 30 / 2 = 15 is odd; use --n_embd=28, --n_embd=32, --n_head=3 or --rotary=False"
ONE_WIDE_HEADS = "n_embd / n_head = 32 / 32 = 1 is odd: not a model gptforge builds"
ONE_WIDE_CHECKPOINT = partial(edit_checkpoint, rotary=True, n_head=32)  # the run's 32 channels in 32 heads

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
        Case(just(train("--n_embd=33")), "--n_embd=33 must be divisible by n_head=2", "use --n_embd=32, --n_embd=34"),
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
    # --- a model switch on a shape it cannot build (core/shape.py's rules), wherever a model is built ------------
    pytest.param(
        Case(just(train(*ODD_ROTARY)), "--rotary=True", ODD_ROTARY_FIX), id="model-rotary-odd-head-size-train"
    ),
    pytest.param(
        Case(just(["bench", "--device=cpu", "--iters=1", *ODD_ROTARY]), "--rotary=True", ODD_ROTARY_FIX),
        id="model-rotary-odd-head-size-bench",
    ),
    pytest.param(
        Case(do(ONE_WIDE_CHECKPOINT, sample()), CKPT, ONE_WIDE_HEADS), id="model-rotary-odd-head-size-checkpoint-sample"
    ),
    pytest.param(
        Case(do(ONE_WIDE_CHECKPOINT, train(init_from="resume", max_iters=6)), CKPT, ONE_WIDE_HEADS),
        id="model-rotary-odd-head-size-checkpoint-resume",
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


# --- chat data against the model's context: rows longer than it can read, before anything is written ------------
TALK = 256  # the chat rows: `gptforge prepare chat`'s default --block_size
BASE = 64  # the context of the models to fine-tune


def talk_files(root: Path) -> None:
    """200 short conversations: talk.jsonl (OpenAI-style JSONL) and talk.txt (the same lines, the tokenizer's text)."""
    lines = []
    for a, b in np.random.default_rng(0).integers(10, 99, (200, 2)).tolist():
        turns = [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}"}]
        lines.append(json.dumps({"messages": turns}) + "\n")
    for name in ("talk.jsonl", "talk.txt"):
        (root / name).write_text("".join(lines), encoding="utf-8")


@pytest.fixture(scope="module")
def chat_template(workspace_template: Path, tmp_path_factory) -> Path:  # noqa: F811
    """The shared workspace plus: an own 300-token BPE `tk` and its chat data from talk.jsonl, `talk` (rows of 256)
    and `talk64` (rows of 64); models of 64 positions to fine-tune, random, as run folders and their Hugging Face
    exports: `base` / `base-hf` (learned positions, GPT-2's model) and `rope` / `rope-hf` (rotary, NanoChat's);
    and `sft`, a finished SFT run on talk64 to resume."""
    from chat_tools import tiny_model, write_run
    from gptforge.chat.prepare import prepare_chat
    from gptforge.core.shape import model_vocab_size
    from gptforge.data.loader import read_meta
    from gptforge.tokenizer.bpe import load_tokenizer
    from gptforge.tokenizer.train import train_tokenizer
    from gptforge.weights.export import export_hf

    root = tmp_path_factory.mktemp("hostile-chat") / "ws"
    shutil.copytree(workspace_template, root)
    talk_files(root)
    folder = train_tokenizer([str(root / "talk.txt")], 300, "tk", out_root=str(root / "tokenizers"))
    spec = load_tokenizer(folder).spec()
    for name, rows in (("talk", TALK), ("talk64", BASE)):
        prepare_chat([str(root / "talk.jsonl")], name, spec, rows, data_dir=str(root / "data"))
    vocab = model_vocab_size(read_meta(str(root / "data" / "talk")))
    nanochat = dict(rotary=True, rmsnorm=True, qk_norm=True, relu2=True, untie_head=True)
    for name, switches in (("base", {}), ("rope", nanochat)):
        model = tiny_model(vocab, BASE, **switches)
        write_run(root / name, model, spec, chat=False)
        export_hf(model, str(root / f"{name}-hf"), spec)
    r = run_cli(*sft(dataset="talk64", block_size=BASE, out_dir="sft"), cwd=root)
    assert r.returncode == 0, r.stderr
    return root


def sft(*extra: str, **overrides) -> list[str]:
    """`gptforge train --task=sft` on `talk` (rows of 256) into run-s2, with the tiny run's options."""
    return train("--task=sft", *extra, **{"dataset": "talk", "out_dir": "run-s2", **overrides})


def one_wide_heads(ws: Path) -> None:
    """rope-hf's config.json edited to 32 heads of one channel: its weights still load, rotary cannot turn them."""
    path = ws / "rope-hf" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 1}))


AGAIN_64 = r"prepare the chat data again with --block_size 64 \(`gptforge prepare chat FILE\.\.\. --name NAME"
PAST_LEARNED = r"rows of at most 64 fit it: " + AGAIN_64
CHAT_ROWS = [
    pytest.param(
        Case(just(sft(init_from="base", block_size=TALK)), "--init_from=base", PAST_LEARNED, forbid="train with"),
        id="chat-rows-past-a-run-folders-learned-positions-at-their-block_size",  # the issue: exit 1 at the eval
    ),
    pytest.param(
        Case(just(sft(init_from="base-hf", block_size=BASE)), "--init_from=base-hf", PAST_LEARNED, forbid="train with"),
        id="chat-rows-past-hugging-face-learned-positions-at-their-block_size",
    ),
    pytest.param(
        Case(just(sft(block_size=BASE)), "--block_size=64", r"train with --block_size=256, or " + AGAIN_64),
        id="chat-rows-not-the-block_size-scratch",
    ),
    pytest.param(
        Case(
            just(train(init_from="resume", out_dir="sft", dataset="talk", block_size=None, max_iters=8)),
            "the run in sft reads 64 tokens",
            r"resume on the dataset it was trained on, or " + AGAIN_64,
            forbid="train with",
        ),
        id="chat-rows-not-the-resumed-runs-block_size",
    ),
    pytest.param(
        Case(
            just(sft(init_from="rope", block_size=32)),
            "--block_size=32",
            r"train with --block_size=256, or prepare the chat data again with --block_size 32",
        ),
        id="chat-rows-not-the-block_size-rotary-run-folder",  # rotary grows to the rows: --block_size=256 works
    ),
    pytest.param(
        Case(
            do(one_wide_heads, ["sample", "--init_from=rope-hf", "--device=cpu"]), "rope-hf/config.json", ONE_WIDE_HEADS
        ),
        id="model-rotary-odd-head-size-hugging-face-folder-sample",
    ),
]


@pytest.mark.parametrize("case", CHAT_ROWS)
def test_chat_rows_against_the_models_context(case: Case, chat_template: Path, tmp_path: Path):
    check_row(case, chat_template, tmp_path)


def test_the_advice_for_rows_past_learned_positions_works(chat_template: Path, tmp_path: Path):
    """The advised command (the chat data prepared again with the model's 64) then fine-tunes the base run."""
    ws = tmp_path / "ws"
    shutil.copytree(chat_template, ws)
    again = ["prepare", "chat", "talk.jsonl", "--name", "talk-again", "--tokenizer", "tk", "--block_size", "64"]
    assert run_cli(*again, cwd=ws).returncode == 0
    r = run_cli(*sft(init_from="base", block_size=BASE, dataset="talk-again"), cwd=ws)
    assert r.returncode == 0, r.stderr
    assert json.loads((ws / "run-s2" / "config.json").read_text())["block_size"] == BASE


@pytest.mark.parametrize("source", ["rope", "rope-hf"])
def test_a_rotary_model_grows_to_the_rows_it_is_told_to_train_at(chat_template: Path, tmp_path: Path, source: str):
    """Rotary positions are computed: --block_size=256 (the advice) fine-tunes a 64-position model on 256's."""
    ws = tmp_path / "ws"
    shutil.copytree(chat_template, ws)
    r = run_cli(*sft(init_from=source, block_size=TALK), cwd=ws)
    assert r.returncode == 0, r.stderr
    assert "the context grows from the weights' 64 tokens to the rows' 256" in r.stdout
    assert torch.load(ws / "run-s2" / "ckpt.pt", weights_only=True)["model_args"]["block_size"] == TALK


def test_every_row_has_a_distinct_readable_id():
    from test_hostile_inputs_run import ROWS as RUN_ROWS

    ids = [p.id for p in ROWS + CHAT_ROWS + RUN_ROWS]
    assert len(ids) == len(set(ids)) and all(re.fullmatch(r"[a-z0-9_-]+", i) for i in ids)

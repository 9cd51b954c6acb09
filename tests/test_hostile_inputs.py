"""Hostile inputs, end to end: every row drives the real CLI in a subprocess and expects the project's rule.

Bad input gets one clear message naming the flag or file and what to do, exit status 2, no traceback, and
nothing already written is lost. Each row copies a good workspace (a prepared char dataset `data/tiny` and a
finished tiny run `run/`), breaks it, snapshots every file (name and sha256), runs the command there and checks:

    status 2; no "Traceback"; stderr names the flag / file and gives a hint;
    the snapshot is unchanged (no file lost, rewritten or half-written, none added);
    inputs that try to run code (pickles with __reduce__, config files) did not create their marker file.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import SMALL_TEXT, run_cli, tiny_train_args

# A finished 4-step run: seconds on a CPU; the rows resume it or train over it.
RUN = dict(max_iters=4, lr_decay_iters=4, warmup_iters=1, eval_interval=2, eval_iters=2)
CKPT = "run/ckpt.pt"


@pytest.fixture(scope="module")
def workspace_template(tmp_path_factory) -> Path:
    """data/tiny (prepared char dataset) and run/ (a finished training run), shared by every row."""
    from gptforge.data.prepare import prepare

    root = tmp_path_factory.mktemp("hostile-template")
    (root / "tiny.txt").write_text(SMALL_TEXT, encoding="utf-8")
    prepare("text", data_dir=str(root / "data"), files=[str(root / "tiny.txt")], name="tiny", tokenizer="char")
    (root / "tiny.txt").unlink()
    r = run_cli("train", *tiny_train_args("data", "run", **RUN), cwd=root)
    assert r.returncode == 0, r.stderr
    assert {p.name for p in (root / "run").iterdir()} >= {"ckpt.pt", "metrics.jsonl", "log.txt", "config.json"}
    # ckpt.pt alone: a damaged one must stop a resume here (falling back to ckpt_best.pt is test_recovery's)
    (root / "run" / "ckpt_best.pt").unlink()
    return root


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under folder: relative path -> sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() or p.is_symlink()}


# --- building the broken situations --------------------------------------------------------------------------


def train(*extra: str, files: tuple[str, ...] = (), data_dir: str = "data", out_dir: str = "run",
          **overrides) -> list[str]:
    """`gptforge train [FILES] <tiny run options> [EXTRA]`: EXTRA options come last and win."""
    return ["train", *files, *tiny_train_args(data_dir, out_dir, **{**RUN, **overrides}), *extra]


def sample(*extra: str) -> list[str]:
    return ["sample", "--out_dir=run", "--device=cpu", "--num_samples=1", "--max_new_tokens=5", *extra]


def marker(ws: Path) -> Path:
    return ws / "PWNED"


class RunsCode:
    """Unpickling this would call os.system(command)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def touch_marker(ws: Path) -> str:
    return f"touch {shlex.quote(str(marker(ws)))}"


def cut(path: Path, size: int) -> None:
    """Keep the first `size` bytes of path (negative: drop that many from the end)."""
    data = path.read_bytes()
    path.write_bytes(data[:size])


def edit_meta(ws: Path, **changes) -> None:
    path = ws / "data/tiny/meta.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def edit_checkpoint(ws: Path, **model_args) -> None:
    import torch

    ckpt = torch.load(ws / CKPT, weights_only=True)
    ckpt["model_args"].update(model_args)
    torch.save(ckpt, ws / CKPT)


def evil_checkpoint(ws: Path) -> None:
    import torch

    torch.save({"model": RunsCode(touch_marker(ws)), "model_args": {}}, ws / CKPT)


def evil_meta_pkl(ws: Path) -> None:
    (ws / "data/tiny/meta.json").unlink()
    (ws / "data/tiny/meta.pkl").write_bytes(pickle.dumps({"vocab_size": 34, "itos": RunsCode(touch_marker(ws))}))


def wider_dataset(ws: Path) -> None:
    """data/wide: a char dataset with a larger vocabulary than the run's."""
    from gptforge.data.prepare import prepare

    (ws / "wide.txt").write_text(SMALL_TEXT + "".join(map(chr, range(0x3B1, 0x3C9))) * 3, encoding="utf-8")
    prepare("text", data_dir=str(ws / "data"), files=[str(ws / "wide.txt")], name="wide", tokenizer="char")


def unwritable_out_dir(ws: Path, held: list) -> list[str]:
    """out_dir inside a folder made read-only with chmod 500. As root chmod stops nothing: then a folder under
    sysfs, where even root may not create folders (EPERM); else skip (the out_dir-under-a-file row remains)."""
    locked = ws / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        (locked / "probe").write_text("")
    except OSError:
        return train(out_dir="locked/run")
    (locked / "probe").unlink()
    locked.chmod(0o700)
    try:
        os.mkdir("/sys/gptforge-hostile-probe")
    except OSError:
        return train(out_dir="/sys/gptforge-hostile-probe/run")
    os.rmdir("/sys/gptforge-hostile-probe")
    pytest.skip("running as root with a writable /sys: no folder here refuses writes (the out_dir-under-a-file "
                "row covers a failing out_dir)")


def port_in_use(held: list) -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    held.append(sock)
    return sock.getsockname()[1]


@dataclass
class Case:
    build: Callable[[Path, list], list[str]]  # (workspace, resources to keep open) -> command-line arguments
    names: str  # the flag or file the message must name
    hint: str  # regex: the part that says what to do
    runs_code: bool = False  # the input tries to run code: the marker file must not appear
    torchrun: bool = False  # run under torchrun with 2 processes
    forbid: str | None = None  # text that would make the message wrong


def do(change: Callable[[Path], object], args: list[str]) -> Callable[[Path, list], list[str]]:
    """Apply `change` to the workspace, then run `args`."""

    def build(ws: Path, held: list) -> list[str]:
        change(ws)
        return args

    return build


def just(args: list[str]) -> Callable[[Path, list], list[str]]:
    return lambda ws, held: args


def write(rel: str, text: str | bytes, args: list[str]) -> Callable[[Path, list], list[str]]:
    def change(ws: Path) -> None:
        path = ws / rel
        content = text.replace("MARKER", str(marker(ws))) if isinstance(text, str) else text
        path.write_bytes(content.encode() if isinstance(content, str) else content)

    return do(change, args)


NOT_A_CHECKPOINT = r"damaged|truncated|not a (gptforge or nanoGPT )?checkpoint|corrupt"
ROWS = [
    # --- config ----------------------------------------------------------------------------------------------
    pytest.param(Case(just(train("--learning_rat=1e-3")), "'learning_rat'", "did you mean learning_rate"),
                 id="config-unknown-key"),
    pytest.param(Case(just(train("--batch_size=big")), "--batch_size", "batch_size must be int, got 'big'"),
                 id="config-wrong-type-int"),
    pytest.param(Case(just(train("--compile=maybe")), "--compile", "True, False or 'auto'"),
                 id="config-wrong-type-bool"),
    pytest.param(Case(just(train("--dtype=fp16")), "--dtype", "one of auto, float32, bfloat16, float16"),
                 id="config-dtype-not-a-choice"),
    pytest.param(Case(just(train("--batch_size")), "--batch_size", "--batch_size=VALUE"),
                 id="config-flag-without-value"),
    pytest.param(Case(just(train("--n_embd=33")), "n_embd=33", "change --n_embd or --n_head"),
                 id="config-n_embd-not-divisible-by-n_head"),
    pytest.param(Case(just(train("--block_size=2000")), "data/tiny/val.bin", "smaller --block_size or more data"),
                 id="config-block_size-longer-than-val-split"),
    pytest.param(Case(just(train("--backend=gloo", "--gradient_accumulation_steps=3")), "gradient_accumulation_steps=3",
                      "make it a multiple of 2", torchrun=True),
                 id="config-grad-accum-not-divisible-across-2-ranks-torchrun"),
    pytest.param(Case(just(train("--eval_iters=0")), "--eval_iters", "must be a positive integer"),
                 id="config-eval_iters-0"),
    pytest.param(Case(just(train("--learning_rate=-1e-3")), "--learning_rate", "must not be negative"),
                 id="config-negative-learning-rate"),
    pytest.param(Case(just(train("--learning_rate=1e999")), "--learning_rate", "must be a finite number"),
                 id="config-infinite-learning-rate"),
    pytest.param(Case(just(train("--dashboard_port=70000")), "--dashboard_port", "0-65535"),
                 id="config-dashboard_port-out-of-range"),
    pytest.param(Case(just(train("--dataset=nope")), "data/nope", "gptforge prepare nope"),
                 id="config-unknown-dataset"),
    pytest.param(Case(just(train("--init_from=restart")), "--init_from", "'scratch', 'resume'"),
                 id="config-unknown-init_from"),
    pytest.param(Case(just(train(files=("missing.py",))), "'missing.py'", "check the path"),
                 id="config-file-missing"),
    pytest.param(Case(write("evil.py", 'import os\nos.system("touch MARKER")\nbatch_size = 4\n',
                            train(files=("evil.py",))), "evil.py:2", "only `name = value` lines", runs_code=True),
                 id="config-file-with-import-and-call"),
    pytest.param(Case(write("evil.py", 'batch_size = __import__("os").system("touch MARKER")\n',
                            train(files=("evil.py",))), "evil.py:1", "read as data, never run", runs_code=True),
                 id="config-file-value-that-is-code"),
    # --- data: train from scratch over the finished run, which must survive the failed start ------------------
    pytest.param(Case(just(train(data_dir="nodata")), "nodata/tiny", "gptforge prepare tiny"),
                 id="data-missing-dataset-folder"),
    pytest.param(Case(do(lambda ws: cut(ws / "data/tiny/train.bin", -1), train()), "data/tiny/train.bin",
                      "not a whole number of uint16 tokens"),
                 id="data-bin-not-whole-tokens"),
    pytest.param(Case(do(lambda ws: cut(ws / "data/tiny/train.bin", 18000), train()), "data/tiny/train.bin",
                      "records 9,450.*Re-run `gptforge prepare`"),
                 id="data-bin-cut-short-by-whole-tokens"),
    pytest.param(Case(do(lambda ws: edit_meta(ws, vocab_size=20, itos=list("abcdefghijklmnopqrst")),
                         train()), "data/tiny/train.bin", "vocab_size 20.*Re-run `gptforge prepare`"),
                 id="data-token-ids-beyond-meta-vocab_size"),
    pytest.param(Case(do(lambda ws: cut(ws / "data/tiny/val.bin", 0), train()), "data/tiny/val.bin",
                      "empty; re-run `gptforge prepare`"),
                 id="data-empty-val-split"),
    pytest.param(Case(do(lambda ws: (ws / "data/tiny/meta.json").unlink(), train()), "data/tiny",
                      "meta.json is missing.*Put its meta.json back"),
                 id="data-meta-missing-in-char-folder"),
    pytest.param(Case(do(lambda ws: (edit_meta(ws, dtype="uint32"), cut(ws / "data/tiny/train.bin", -2)), train()),
                      "data/tiny/", "uint32.*(re-run|Re-run) `gptforge prepare`"),
                 id="data-meta-says-uint32-files-uint16-odd-count"),
    pytest.param(Case(do(lambda ws: edit_meta(ws, dtype="uint32"), train()), "data/tiny/train.bin",
                      "records 9,450.*Re-run `gptforge prepare`"),
                 id="data-meta-says-uint32-files-uint16-even-count"),
    pytest.param(Case(do(lambda ws: edit_meta(ws, itos=list("abc")), train()), "data/tiny/meta.json",
                      "list of vocab_size=34 chars"),
                 id="data-meta-itos-length-not-vocab_size"),
    pytest.param(Case(write("data/tiny/meta.json", '{"vocab_size": 34, "tokenizer": ', train()),
                      "data/tiny/meta.json", "not readable JSON.*re-run `gptforge prepare`"),
                 id="data-meta-malformed-json"),
    pytest.param(Case(do(evil_meta_pkl, train()), "data/tiny/meta.pkl", "refusing to load posix.system",
                      runs_code=True),
                 id="data-meta-pkl-that-runs-code"),
    # --- checkpoints: resume with train, and sample ----------------------------------------------------------
    pytest.param(Case(do(lambda ws: (ws / CKPT).unlink(), train(init_from="resume", max_iters=6)), CKPT,
                      "not found; train first"),
                 id="ckpt-missing-train-resume"),
    pytest.param(Case(do(lambda ws: (ws / CKPT).unlink(), sample()), CKPT, "not found; train first"),
                 id="ckpt-missing-sample"),
    pytest.param(Case(do(lambda ws: cut(ws / CKPT, (ws / CKPT).stat().st_size // 2),
                         train(init_from="resume", max_iters=6)), CKPT, NOT_A_CHECKPOINT),
                 id="ckpt-truncated-train-resume"),
    pytest.param(Case(do(lambda ws: cut(ws / CKPT, (ws / CKPT).stat().st_size // 2), sample()), CKPT,
                      NOT_A_CHECKPOINT),
                 id="ckpt-truncated-sample"),
    pytest.param(Case(do(lambda ws: cut(ws / CKPT, 0), sample()), CKPT, NOT_A_CHECKPOINT),
                 id="ckpt-empty-file-sample"),
    pytest.param(Case(write(CKPT, random.Random(0).randbytes(5000), train(init_from="resume", max_iters=6)), CKPT,
                      NOT_A_CHECKPOINT, forbid="run code"),
                 id="ckpt-random-bytes-train-resume"),
    pytest.param(Case(write(CKPT, random.Random(0).randbytes(5000), sample()), CKPT, NOT_A_CHECKPOINT,
                      forbid="run code"),
                 id="ckpt-random-bytes-sample"),
    pytest.param(Case(write(CKPT, "hello, I am not a checkpoint\n", train(init_from="resume", max_iters=6)), CKPT,
                      NOT_A_CHECKPOINT),
                 id="ckpt-text-file-train-resume"),
    pytest.param(Case(write(CKPT, "hello, I am not a checkpoint\n", sample()), CKPT, NOT_A_CHECKPOINT),
                 id="ckpt-text-file-sample"),
    pytest.param(Case(do(lambda ws: edit_checkpoint(ws, n_embd=64), train(init_from="resume", max_iters=6)), CKPT,
                      "saved with other model settings"),
                 id="ckpt-other-model-shape-train-resume"),
    pytest.param(Case(do(lambda ws: edit_checkpoint(ws, n_layer=3), sample()), CKPT, "saved with other model settings"),
                 id="ckpt-other-model-shape-sample"),
    pytest.param(Case(do(wider_dataset, train(init_from="resume", max_iters=6, dataset="wide")), "'wide'",
                      "resume on the dataset the model was trained on"),
                 id="ckpt-resume-on-a-dataset-with-a-larger-vocabulary"),
    pytest.param(Case(do(evil_checkpoint, train(init_from="resume", max_iters=6)), CKPT, "can run code",
                      runs_code=True),
                 id="ckpt-pickle-that-runs-code-train-resume"),
    pytest.param(Case(do(evil_checkpoint, sample()), CKPT, "can run code", runs_code=True),
                 id="ckpt-pickle-that-runs-code-sample"),
    pytest.param(Case(just(train("--sample_interval=2", "--sample_prompt=Zebra", init_from="resume", max_iters=6)),
                      "--sample_prompt", "use only characters from its training text"),
                 id="resume-with-sample_prompt-outside-the-vocabulary"),
    # --- disk ------------------------------------------------------------------------------------------------
    pytest.param(Case(write("afile", "a regular file\n", train(out_dir="afile/run")), "--out_dir=afile/run",
                      "Not a directory.*choose another folder"),
                 id="disk-out_dir-under-a-regular-file"),
    pytest.param(Case(unwritable_out_dir, "--out_dir=", "(Permission denied|Operation not permitted).*choose another "
                      "folder"),
                 id="disk-out_dir-parent-not-writable"),
    pytest.param(Case(just(["export", "--out_dir=run", "--to=run", "--force"]), "--to=", "choose another folder"),
                 id="disk-export-over-the-run-folder"),
    pytest.param(Case(write("empty.txt", "", ["prepare", "text", "empty.txt", "--name=tiny"]), "empty.txt",
                      "give more text"),
                 id="disk-prepare-empty-text-over-a-dataset"),
    pytest.param(Case(write("latin1.txt", b"caf\xe9\n" * 50, ["prepare", "text", "latin1.txt", "--name=tiny"]),
                      "latin1.txt", "convert it to UTF-8"),
                 id="disk-prepare-non-utf8-text-over-a-dataset"),
    # --- dashboard -------------------------------------------------------------------------------------------
    pytest.param(Case(just(["dashboard", "nowhere", "--port=0"]), "nowhere", "no such folder"),
                 id="dashboard-folder-missing"),
    pytest.param(Case(lambda ws, held: ["dashboard", "run", f"--port={port_in_use(held)}"], "--port",
                      "Address already in use.*--port 0 picks a free one"),
                 id="dashboard-port-in-use"),
    pytest.param(Case(just(["dashboard", "run", "--port=70000"]), "--port", "0-65535"),
                 id="dashboard-port-out-of-range"),
    # --- sample ----------------------------------------------------------------------------------------------
    pytest.param(Case(just(sample("--start=FILE:missing.txt")), "--start=FILE:missing.txt", "No such file"),
                 id="sample-start-file-missing"),
    pytest.param(Case(write("latin1.txt", b"caf\xe9\n", sample("--start=FILE:latin1.txt")),
                      "--start=FILE:latin1.txt", "convert it to UTF-8"),
                 id="sample-start-file-not-utf8"),
    pytest.param(Case(just(sample("--start=Zebra")), "--start", "use only characters from its training text"),
                 id="sample-start-outside-the-vocabulary"),
    pytest.param(Case(just(sample("--num_samples=0")), "--num_samples", "positive integer"),
                 id="sample-num_samples-0"),
    pytest.param(Case(just(sample("--max_new_tokens=-5")), "--max_new_tokens", "positive integer"),
                 id="sample-negative-max_new_tokens"),
    pytest.param(Case(just(sample("--temperature=-1")), "--temperature", r">= 0 \(0 = greedy\)"),
                 id="sample-negative-temperature"),
    pytest.param(Case(just(sample("--temperature=nan")), "--temperature", "finite number"),
                 id="sample-nan-temperature"),
]


@pytest.mark.parametrize("case", ROWS)
def test_hostile_input(case: Case, workspace_template: Path, tmp_path: Path):
    ws = tmp_path / "ws"
    shutil.copytree(workspace_template, ws)
    held: list = []
    try:
        args = case.build(ws, held)
        before = snapshot(ws)
        if case.torchrun:
            r = torchrun(args, ws)
        else:
            r = run_cli(*args, cwd=ws, timeout=120)
    finally:
        for resource in held:
            resource.close()
        if (ws / "locked").exists():
            (ws / "locked").chmod(0o700)
    err = r.stderr
    if case.torchrun:
        # Each rank prints the message and exits 2; torchrun itself then exits 1 and prints its own summary
        # (a ChildFailedError traceback of torch/distributed/run.py, "exitcode  : 2" per rank). None of ours.
        assert r.returncode == 1, (r.returncode, err[-3000:])
        assert err.count("gptforge: error:") == 2 and "exitcode  : 2" in err, err[-3000:]
        assert not [line for line in err.splitlines() if line.strip().startswith("File ") and "/gptforge/" in line]
    else:
        assert r.returncode == 2, (r.returncode, err[-3000:])
        assert "Traceback" not in err, err[-3000:]
        assert err.startswith("gptforge: error:") and err.count("gptforge: error:") == 1, err
    assert case.names in err, err
    assert re.search(case.hint, err), err
    if case.forbid:
        assert case.forbid not in err, err
    if case.runs_code:
        assert not marker(ws).exists(), "the hostile input ran code"
    after = snapshot(ws)
    assert after == before, {
        "lost": sorted(set(before) - set(after)), "added": sorted(set(after) - set(before)),
        "changed": sorted(k for k in set(before) & set(after) if before[k] != after[k]),
    }


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptforge",
           *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_every_row_has_a_distinct_readable_id():
    ids = [p.id for p in ROWS]
    assert len(ids) == len(set(ids)) and all(re.fullmatch(r"[a-z0-9_-]+", i) for i in ids)

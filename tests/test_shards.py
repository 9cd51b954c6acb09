"""Token shards (data/shards.py): real files, the real GPT-2 tokenizer, real worker processes and real crashes.

Every check decodes the shards back and compares them with the source documents, each preceded by EOT.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import SHARED, need_shared, run_cli
from gptforge.core.errors import UserError
from gptforge.data.loader import read_meta
from gptforge.data.shards import prepare_shards
from gptforge.tokenizer.gpt2 import GPT2Tokenizer

WEBTEXT = SHARED / "webtext-sample"
EOT_TEXT = "<|endoftext|>"


@pytest.fixture
def webtext(tiktoken_cache) -> Path:
    return need_shared(WEBTEXT)


def jsonl_texts(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh if line.strip()]


def check_dataset(folder: Path, docs: list[str]) -> dict:
    """The shards decode to the documents in order, each preceded by EOT; sizes and counts match meta.json."""
    meta = read_meta(str(folder))
    assert meta["format"] == "shards" and meta["tokenizer"] == "gpt2" and meta["eot_token"] == 50256
    size = meta["shard_size"]
    splits = {}
    for split in ("val", "train"):
        names = meta["shards"][split]
        assert names == [f"{folder.name}_{split}_{i:06d}.bin" for i in range(len(names))]
        arrays = [np.fromfile(folder / n, dtype="<u2") for n in names]
        assert all(len(a) == size for a in arrays[:-1]) and 0 < len(arrays[-1]) <= size, [len(a) for a in arrays]
        tokens = np.concatenate(arrays)
        assert len(tokens) == meta["tokens"][split]
        assert tokens[0] == 50256  # a split starts at a document
        assert int((tokens == 50256).sum()) == meta["documents"][split]
        splits[split] = tokens
    assert meta["documents"]["val"] + meta["documents"]["train"] == len(docs)
    text = GPT2Tokenizer().decode(np.concatenate([splits["val"], splits["train"]]).tolist())
    assert text == "".join(EOT_TEXT + d for d in docs)
    assert not list(folder.glob("*.tmp"))
    return meta


def test_jsonl_and_gzip_through_the_cli(webtext, tmp_path):
    files = [
        webtext / n
        for n in (
            "cc_en_head-0091.jsonl",
            "cc_en_head-0174.jsonl.gz",
            "cc_en_head-0174.jsonl",
            "cc_en_head-0091.jsonl.gz",
        )
    ]
    r = run_cli(
        "prepare",
        "files",
        *files,
        "--name",
        "web",
        "--shard_size",
        "10000",
        "--val_tokens",
        "5000",
        "--num_proc",
        "2",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    docs = [d for f in files for d in jsonl_texts(f)]
    assert len(docs) == 40
    meta = check_dataset(tmp_path / "data" / "web", docs)
    assert len(meta["shards"]["train"]) >= 5 and meta["tokens"]["val"] >= 5000
    assert "cc_en_head-0091.jsonl" in meta["source"]


def test_parquet_txt_and_folders(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    rows = [f"Row {i}: naïve café text, {'words ' * (i % 7)}\nsecond line." for i in range(300)]
    pq.write_table(pa.table({"id": list(range(300)), "content": rows}), corpus / "a.parquet", row_group_size=64)
    (corpus / "b.txt").write_text("A whole file is one document.\n\nEven with blank lines. ✓", encoding="utf-8")
    (corpus / "sub" / "c.txt").write_text("Nested " * 50, encoding="utf-8")
    (corpus / "notes.md").write_text("ignored: not a supported extension")
    prepare_shards(
        "files",
        data_dir=str(tmp_path / "data"),
        paths=[str(corpus)],
        name="mix",
        text_field="content",
        shard_size=500,
        val_tokens=300,
        num_proc=1,
    )
    docs = [*rows, (corpus / "b.txt").read_text(), (corpus / "sub" / "c.txt").read_text()]
    meta = check_dataset(tmp_path / "data" / "mix", docs)
    assert len(meta["shards"]["train"]) > 3


def shard_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != ".prepare_state.json"}


# The real CLI in a subprocess, except that the shard writer's atomic_write writes half of shard number N (counting
# val and train shards from 0) into the real temporary file and then SIGKILLs the process: a crash mid-shard.
KILL_MID_SHARD = """
import contextlib, os, signal, sys
import gptforge.data.shards as shards
from gptforge.cli.main import main

real_atomic_write = shards.atomic_write
fatal, seen = int(sys.argv[1]), 0


class HalfThenKill:
    def __init__(self, fh):
        self.fh = fh

    def write(self, data):
        self.fh.write(data[: len(data) // 2])
        self.fh.flush()
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def atomic_write(path, *args, **kwargs):
    global seen
    with real_atomic_write(path, *args, **kwargs) as fh:
        if path.endswith(".bin"):
            seen += 1
            if seen - 1 == fatal:
                fh = HalfThenKill(fh)
        yield fh


shards.atomic_write = atomic_write
main(sys.argv[2:])
"""


def run_cli_killed_mid_shard(n: int, *args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, int]:
    """conftest.run_cli's `gptforge ARGS`, SIGKILLed halfway through writing shard number n; also the pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_MID_SHARD, str(n), *map(str, args)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), proc.pid


def test_crash_mid_shard_then_resume_is_byte_identical(webtext, tmp_path):
    files = [str(webtext / "cc_en_head-0091.jsonl"), str(webtext / "cc_en_head-0174.jsonl.gz")]
    opts = ["--name", "web", "--shard_size", "2000", "--val_tokens", "3000", "--num_proc", "2"]
    reference = tmp_path / "ref"
    prepare_shards(
        "files", data_dir=str(reference), paths=files, name="web", shard_size=2000, val_tokens=3000, num_proc=1
    )
    expected = shard_files(reference / "web")
    n_val = len(read_meta(str(reference / "web"))["shards"]["val"])

    # SIGKILL halfway through writing train's 4th shard
    r, pid = run_cli_killed_mid_shard(n_val + 3, "prepare", "files", *files, *opts, cwd=tmp_path)
    assert r.returncode == -signal.SIGKILL, r.stderr
    folder = tmp_path / "data" / "web"
    left = sorted(p.name for p in folder.iterdir())
    partial = f".web_train_000003.bin.{pid}.tmp"  # files.temp_path
    assert "meta.json" not in left and partial in left and "web_train_000003.bin" not in left
    for name in left:
        if name.endswith(".bin"):  # whatever has a final name is whole
            assert (folder / name).read_bytes() == expected[name], name
    assert os.path.getsize(folder / partial) < 4000
    first = (folder / "web_val_000000.bin").stat().st_ino

    r = run_cli("prepare", "files", *files, *opts, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stderr and f"{n_val} val and 3 train shards done" in r.stderr
    assert (folder / "web_val_000000.bin").stat().st_ino == first  # kept, not rewritten
    assert shard_files(folder) == expected  # meta.json included
    check_dataset(folder, [d for f in files for d in jsonl_texts(Path(f))])

    r = run_cli("prepare", "files", *files, *opts, cwd=tmp_path)
    assert r.returncode == 0 and "nothing to do" in r.stderr
    r = run_cli("prepare", "files", *files, *opts[:-2], "--shard_size", "3000", cwd=tmp_path)
    assert r.returncode == 0 and "starting over" in r.stderr and "shard_size" in r.stderr
    meta = check_dataset(folder, [d for f in files for d in jsonl_texts(Path(f))])
    assert meta["shard_size"] == 3000 and not (folder / "web_train_000013.bin").exists()


def test_sigkill_from_outside_then_resume(webtext, tmp_path):
    files = [str(webtext / "cc_en_head-0091.jsonl")] * 3
    args = [
        "prepare",
        "files",
        *files,
        "--name",
        "web",
        "--shard_size",
        "500",
        "--val_tokens",
        "2000",
        "--num_proc",
        "2",
    ]
    proc = subprocess.Popen([sys.executable, "-m", "gptforge", *args], cwd=tmp_path, stderr=subprocess.DEVNULL)
    folder = tmp_path / "data" / "web"
    deadline = time.monotonic() + 60
    while not list(folder.glob("web_val_*.bin")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed = proc.returncode == -signal.SIGKILL  # else it finished before the kill, which is fine too
    assert not killed or not (folder / "meta.json").exists()
    r = run_cli(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "starting over" not in r.stderr  # the state left by the kill is valid: kept shards are reused
    prepare_shards(
        "files", data_dir=str(tmp_path / "ref"), paths=files, name="web", shard_size=500, val_tokens=2000, num_proc=1
    )
    assert shard_files(folder) == shard_files(tmp_path / "ref" / "web")


@pytest.fixture
def hub_docs() -> list[str]:
    return [f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * (i % 9 + 1) for i in range(120)]


def test_openwebtext_from_a_saved_dataset(tmp_path, tiktoken_cache, hub_docs):
    saved = tmp_path / "owt"
    datasets.Dataset.from_dict({"text": hub_docs, "n": list(range(len(hub_docs)))}).save_to_disk(str(saved))
    r = run_cli(
        "prepare",
        "openwebtext",
        "--input",
        saved,
        "--shard_size",
        "1000",
        "--val_tokens",
        "500",
        "--num_proc",
        "2",
        cwd=tmp_path,
        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr
    meta = check_dataset(tmp_path / "data" / "openwebtext", hub_docs)
    assert meta["source"] == f"openwebtext from {saved}"


def test_fineweb_edu_from_a_saved_datasetdict_and_from_files(tmp_path, tiktoken_cache, hub_docs):
    saved = tmp_path / "fw"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": hub_docs})}).save_to_disk(str(saved))
    sizes = dict(shard_size=700, val_tokens=400, num_proc=1)
    prepare_shards("fineweb_edu", data_dir=str(tmp_path / "data"), input_path=str(saved), **sizes)
    check_dataset(tmp_path / "data" / "fineweb_edu", hub_docs)
    jsonl = tmp_path / "fw.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in hub_docs), encoding="utf-8")
    prepare_shards("fineweb_edu", data_dir=str(tmp_path / "data2"), input_path=str(jsonl), **sizes)
    from_files, from_disk = (shard_files(tmp_path / d / "fineweb_edu") for d in ("data2", "data"))
    assert json.loads(from_files.pop("meta.json"))["source"] == f"fineweb_edu from {jsonl}"
    assert from_files == {k: v for k, v in from_disk.items() if k != "meta.json"}


@pytest.mark.parametrize("recipe", ["openwebtext", "fineweb_edu"])
def test_hub_recipes_offline_name_input(tmp_path, recipe):
    r = run_cli("prepare", recipe, cwd=tmp_path, env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stderr
    assert "--input PATH" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "data" / recipe / "meta.json").exists()


def test_cli_missing_file_exits_2(tmp_path):
    r = run_cli("prepare", "files", "nowhere.jsonl", "--name", "x", cwd=tmp_path)
    assert r.returncode == 2 and "input 'nowhere.jsonl' not found" in r.stderr and "Traceback" not in r.stderr


def write(path: Path, data: bytes | str) -> str:
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return str(path)


@pytest.mark.parametrize(
    "name, data, extra, message",
    [
        ("a.csv", "text\nhello\n", {}, "a.csv: unsupported file type"),
        (
            "a.jsonl",
            '{"content": "hi"}\n',
            {},
            "a.jsonl:1: no string field 'text' (found: content); choose the field with --text_field",
        ),
        ("a.jsonl", '{"text": "ok"}\nnot json\n', {}, "a.jsonl:2: not a JSON object per line"),
        ("a.jsonl.gz", b"not gzip at all", {}, "a.jsonl.gz: not a whole gzip file"),
        ("a.parquet", b"PAR1 but not really", {}, "a.parquet: not a readable parquet file"),
        ("a.txt", b"\xff\xfe bad utf-8", {}, "a.txt: not UTF-8 text"),
        ("a.jsonl", '{"text": "short"}\n', {"val_tokens": 10**6}, "went to the val split; lower --val_tokens"),
        ("a.jsonl", '{"text": "short"}\n', {"shard_size": 0}, "--shard_size must be a positive"),
    ],
)
def test_bad_inputs_name_the_file_or_flag(tmp_path, tiktoken_cache, name, data, extra, message):
    path = write(tmp_path / name, data)
    with pytest.raises(UserError) as err:
        prepare_shards(
            "files", data_dir=str(tmp_path / "data"), paths=[path], name="x", num_proc=1, **{"val_tokens": 1, **extra}
        )
    assert message in str(err.value)
    assert not (tmp_path / "data" / "x" / "meta.json").exists()


def test_parquet_without_the_text_column(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(UserError, match="no column 'text' \\(found: body\\); choose one with --text_field"):
        prepare_shards("files", paths=[str(tmp_path / "a.parquet")], name="x", data_dir=str(tmp_path), num_proc=1)


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no .jsonl"):
        prepare_shards("files", paths=[str(tmp_path / "empty")], name="x", data_dir=str(tmp_path), num_proc=1)

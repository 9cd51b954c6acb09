"""`gptforge tokenizer train|stats|encode|decode` and `gptforge prepare ... --tokenizer NAME` through the real CLI
(issue 26): the results on stdout, meta.json recording the tokenizer (its spec builds it back), <|bos|> before each
document, and every bad input a clear exit 2 naming the flag or file with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import SMALL_TEXT, run_cli
from gptforge.data.loader import read_meta
from gptforge.data.prepare import token_dtype
from gptforge.tokenizer.bpe import load_tokenizer
from gptforge.tokenizer.spec import from_spec, tokenizer_spec
from gptforge.tokenizer.specials import BOS

TEXT = SMALL_TEXT + "Ünïcödé café — naïve façade, 日本語のテキスト 🎉\n" * 20


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder with text files and an own tokenizer `small` (300 ids) trained on them through the CLI."""
    root = tmp_path_factory.mktemp("tokcli")
    (root / "a.txt").write_text(TEXT, encoding="utf-8")
    (root / "b.txt").write_text(SMALL_TEXT[:3000], encoding="utf-8")
    r = run_cli("tokenizer", "train", "a.txt", "--vocab_size", "300", "--name", "small", cwd=root)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(Path("tokenizers") / "small")
    return root


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_train_writes_a_tokenizer_folder_that_stats_encode_and_decode_read(work):
    tok = load_tokenizer(str(work / "tokenizers" / "small"))
    assert tok.vocab_size == 300 and tok.name == "small"
    r = run_cli("tokenizer", "stats", "--tokenizer", "small", "b.txt", cwd=work)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "b.txt: 3,000 bytes, 3,000 characters"
    assert lines[1].split()[:3] == ["small", "(300", "tokens)"] and lines[1].endswith("bytes/token")
    assert lines[2].startswith("  gpt2 (50,257 tokens)") and lines[3].split()[-2] == "1.000"  # char: ASCII

    text = f"First Citizen: {BOS} café 🎉"
    r = run_cli("tokenizer", "encode", "--tokenizer", "small", text, cwd=work)
    assert r.returncode == 0, r.stderr
    ids = [int(i) for i in r.stdout.split()]
    assert ids == tok.encode(text) and tok.special_id(BOS) not in ids  # the special's string stays text
    assert f"{len(ids)} tokens for {len(text.encode())} bytes" in r.stderr
    r = run_cli("tokenizer", "decode", "--tokenizer", str(work / "tokenizers" / "small"), *map(str, ids), cwd=work)
    assert r.returncode == 0 and r.stdout == text + "\n", r.stderr
    r = run_cli("tokenizer", "encode", "--tokenizer", "gpt2", "Hello world", cwd=work)
    assert r.returncode == 0 and r.stdout.split() == ["15496", "995"], r.stderr


def test_train_again_with_force_replaces_it(work, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    args = ("tokenizer", "train", "t.txt", "--vocab_size", "280", "--name", "again")
    assert run_cli(*args, cwd=tmp_path).returncode == 0
    r = run_cli(*args[:4], "290", *args[5:], "--force", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert load_tokenizer(str(tmp_path / "tokenizers" / "again")).vocab_size == 290


@pytest.mark.parametrize(
    "args,message",
    [
        (["empty.txt", "--vocab_size", "300", "--name", "x"], "the input holds no text"),
        (["a.txt", "--vocab_size", "100", "--name", "x"], "--vocab_size 100: a byte-level BPE needs at least 267"),
        (["latin1.txt", "--vocab_size", "300", "--name", "x"], "latin1.txt: not UTF-8 text (near byte 3"),
        (["a.txt", "--vocab_size", "300", "--name", "small"], "pass --force to replace it"),
        (["missing.txt", "--vocab_size", "300", "--name", "x"], "input 'missing.txt' not found"),
        (["a.txt", "--vocab_size", "300", "--name", "gpt2"], "--name gpt2: 'gpt2' means the built-in tokenizer"),
        (["a.txt", "--vocab_size", "300", "--name", "x", "--max_chars", "0"], "--max_chars 0: give a positive"),
        (["a.txt", "--vocab_size", "100000", "--name", "x"], "--vocab_size 100000: the input"),
    ],
    ids=["empty", "vocab-too-small", "not-utf8", "exists", "missing", "reserved-name", "max-chars", "vocab-too-big"],
)
def test_bad_training_inputs_exit_2_naming_the_flag_or_file_and_write_nothing(work, args, message):
    (work / "empty.txt").write_text("")
    (work / "latin1.txt").write_bytes("caf\xe9 na\xefve".encode("latin-1"))
    before = snapshot(work)
    r = run_cli("tokenizer", "train", *args, cwd=work)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert snapshot(work) == before


@pytest.mark.parametrize(
    "args,message",
    [
        (["tokenizer", "stats", "--tokenizer", "nope", "b.txt"], "--tokenizer nope: tokenizer 'nope' not found"),
        (["tokenizer", "stats", "--tokenizer", "small", "none.txt"], "FILE 'none.txt' not found"),
        (["tokenizer", "stats", "--tokenizer", "gpt2", "b.txt"], "--tokenizer gpt2: give an own tokenizer"),
        (["tokenizer", "encode", "--tokenizer", "nope", "hi"], "--tokenizer nope: tokenizer 'nope' not found"),
        (["tokenizer", "decode", "--tokenizer", "small", "299", "300"], "IDS: 300 not an id of --tokenizer small"),
        (["prepare", "text", "b.txt", "--name", "d", "--tokenizer", "nope"], "--tokenizer nope: tokenizer 'nope'"),
        (["prepare", "files", "b.txt", "--name", "d", "--tokenizer", "char"], "--tokenizer char: a character"),
        (["prepare", "shakespeare_char", "--tokenizer", "small"], "--tokenizer applies to recipe(s) text, shakespeare"),
    ],
)
def test_bad_tokenizer_names_and_ids_exit_2_and_write_nothing(work, args, message):
    before = snapshot(work)
    r = run_cli(*args, cwd=work)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert snapshot(work) == before


def test_prepare_text_records_the_tokenizer_and_starts_each_file_with_bos(work, tmp_path):
    r = run_cli("prepare", "text", "a.txt", "b.txt", "--name", "own", "--tokenizer", "small", cwd=work)
    assert r.returncode == 0, r.stderr
    meta = read_meta(str(work / "data" / "own"))
    tok = load_tokenizer(str(work / "tokenizers" / "small"))
    assert from_spec(tokenizer_spec(meta)).spec() == tok.spec() == tokenizer_spec(meta)
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16" and meta["eot_token"] == tok.special_id(BOS)
    ids = np.concatenate([np.fromfile(work / "data" / "own" / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    a, b = tok.encode(TEXT), tok.encode(SMALL_TEXT[:3000])
    assert ids.tolist() == [tok.eot_token, *a, tok.eot_token, *b]
    assert (token_dtype(2**16), token_dtype(2**16 + 1)) == ("uint16", "uint32")  # ids up to 65,535 fit 16 bits


def test_prepare_shakespeare_and_the_sharded_recipes_take_an_own_tokenizer(work, tmp_path, shakespeare_path):
    tok_folder = str(work / "tokenizers" / "small")
    tok = load_tokenizer(tok_folder)
    r = run_cli(
        "prepare",
        "shakespeare",
        f"--input={shakespeare_path}",
        "--name=shk_own",
        f"--tokenizer={tok_folder}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    meta = read_meta(str(tmp_path / "data" / "shk_own"))
    assert meta["tokenizer"] == "bpe" and meta["eot_token"] == tok.eot_token
    text = shakespeare_path.read_text(encoding="utf-8")
    train = np.fromfile(tmp_path / "data" / "shk_own" / "train.bin", dtype=np.uint16)
    assert train.tolist() == tok.encode(text[: int(len(text) * 0.9)])

    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(json.dumps({"text": f"Document {i}: {TEXT[i * 50 : i * 50 + 400]}"}) + "\n" for i in range(60))
    )
    metas = {}
    for procs in (1, 2):  # workers rebuild the tokenizer from its spec: the same shards as in-process
        name = f"sh{procs}"
        r = run_cli(
            "prepare",
            "files",
            str(docs),
            f"--name={name}",
            f"--tokenizer={tok_folder}",
            "--shard_size=2000",
            "--val_tokens=500",
            f"--num_proc={procs}",
            cwd=tmp_path,
        )
        assert r.returncode == 0, r.stderr
        metas[procs] = read_meta(str(tmp_path / "data" / name))
    one, two = metas[1], metas[2]
    assert one["tokenizer"] == "bpe" and one["eot_token"] == tok.eot_token and one["tokens"] == two["tokens"]
    for split in ("val", "train"):
        for a, b in zip(one["shards"][split], two["shards"][split], strict=True):
            assert (tmp_path / "data" / "sh1" / a).read_bytes() == (tmp_path / "data" / "sh2" / b).read_bytes()
    first = np.fromfile(tmp_path / "data" / "sh1" / one["shards"]["val"][0], dtype=np.uint16)
    doc0 = json.loads(docs.read_text().splitlines()[0])["text"]
    assert first[: 1 + len(tok.encode(doc0))].tolist() == [tok.eot_token, *tok.encode(doc0)]  # <|bos|> first
    assert int((first == tok.eot_token).sum()) > 1

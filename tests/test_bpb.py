"""Bits per byte (issue 26): the summed loss in nats over ln 2 times the bytes of text the target tokens stand for,
against a float64 computation by hand for each tokenizer kind (char on ASCII: loss / ln 2; char beyond ASCII; GPT-2
BPE; an own BPE), in training's records and console line, `gptforge eval loss` and `bench --target_bpb`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL_TEXT, run_cli, tiny_train_args
from gptforge.core.shape import model_vocab_size
from gptforge.data.loader import make_batches, read_meta
from gptforge.data.prepare import prepare
from gptforge.evaluate.loss import byte_table, estimate_loss
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokenizer.spec import from_spec, tokenizer_spec
from gptforge.tokenizer.train import train_tokenizer
from test_time_to_loss import config_file

NON_ASCII = "Ünïcödé café — naïve façade, «quotes», 日本語のテキスト 🎉 and plain words.\n" * 120


def hand_bytes(tok, i: int) -> int:
    """The bytes of text id i stands for, computed apart from the tokenizers' own tables."""
    if tok.kind == "char":
        return len(tok.itos[i].encode("utf-8"))
    if tok.kind == "gpt2":
        return 0 if i == 50256 else len(tok.enc.decode_bytes([i]))
    return 0 if i in tok.specials.values() else len(tok.enc.decode_bytes([i]))


def by_hand(model, folder: str, meta: dict, iters: int, seed: int) -> tuple[float, float]:
    """(mean loss, bpb) of the same seeded batches, the logits scored in float64."""
    tok = from_spec(tokenizer_spec(meta))
    loader = make_batches(folder, meta, "val", "random", 4, 16, model.config.vocab_size, "cpu", seed)
    nats = n_bytes = mean = 0.0
    with torch.no_grad():
        for _ in range(iters):
            x, y = loader.next_batch()
            logits = model.logits(model.hidden_states(x)).double()
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            nats, mean = nats + loss, mean + loss / y.numel() / iters
            n_bytes += sum(hand_bytes(tok, i) for i in y.flatten().tolist())
    return mean, nats / (math.log(2) * n_bytes)


def dataset(tmp_path: Path, kind: str) -> tuple[str, dict]:
    text = NON_ASCII if kind == "char-utf8" else SMALL_TEXT
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    tokenizer = {"char-ascii": "char", "char-utf8": "char", "gpt2": "gpt2"}.get(kind)
    if tokenizer is None:  # an own BPE of 333 ids: the model's vocabulary is padded to 384 rows
        (tmp_path / "train.txt").write_text(SMALL_TEXT + NON_ASCII, encoding="utf-8")
        tokenizer = train_tokenizer([str(tmp_path / "train.txt")], 333, "own", out_root=str(tmp_path / "tok"))
    prepare("text", str(tmp_path / "data"), files=[str(tmp_path / "t.txt")], name="d", tokenizer=tokenizer)
    folder = str(tmp_path / "data" / "d")
    return folder, read_meta(folder)


@pytest.mark.parametrize("kind", ["char-ascii", "char-utf8", "gpt2", "bpe"])
def test_bits_per_byte_equals_a_float64_hand_computation(tmp_path, kind, request):
    if kind == "gpt2":
        request.getfixturevalue("tiktoken_cache")
    folder, meta = dataset(tmp_path, kind)
    torch.manual_seed(0)
    rows = model_vocab_size(meta)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=rows, dropout=0.0)).eval()
    tok = from_spec(tokenizer_spec(meta))
    table = byte_table(tok, rows, "cpu")
    assert table.shape == (rows,) and int(table[tok.vocab_size :].sum()) == 0  # padding rows stand for no text
    loaders = {"val": make_batches(folder, meta, "val", "random", 4, 16, rows, "cpu", seed=5)}
    ours = estimate_loss(model, loaders, 3, token_bytes=table)
    loss, bpb = by_hand(model, folder, meta, 3, seed=5)
    assert ours["val"] == pytest.approx(loss, rel=1e-5)
    assert ours["val_bpb"] == pytest.approx(bpb, rel=1e-5)
    if kind == "char-ascii":  # one byte per character: bits per byte is the loss in bits
        assert ours["val_bpb"] == pytest.approx(ours["val"] / math.log(2), rel=1e-6)
    else:  # several bytes per token: fewer bits per byte than per token
        assert ours["val_bpb"] < ours["val"] / math.log(2) * 0.9
    assert set(estimate_loss(model, loaders, 1)) == {"val"}  # without a table: the loss alone


def test_training_records_eval_loss_prints_and_bench_races_bits_per_byte(char_data, tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", *tiny_train_args(char_data, out, max_iters=10, eval_interval=5), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert [e["step"] for e in evals] == [0, 5, 10]
    for e in evals:  # ASCII char data: one byte per token
        assert list(e)[2:8] == ["train_loss", "train_ppl", "val_loss", "val_ppl", "train_bpb", "val_bpb"]
        assert e["val_bpb"] == pytest.approx(e["val_loss"] / math.log(2), rel=1e-6)
        line = f"val loss {e['val_loss']:.4f} (ppl {e['val_ppl']:.2f}), train bpb {e['train_bpb']:.4f}, "
        assert line + f"val bpb {e['val_bpb']:.4f}" in r.stdout
    assert [x for x in (out / "log.txt").read_text().splitlines() if " val " in x][-1] == f"10 val {e['val_loss']:.4f}"
    train = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert "train_bpb" not in train[0]  # a train step's record: the batch's loss only

    r = run_cli("eval", "loss", f"--out_dir={out}", "--eval_iters=2", "--device=cpu", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    loss, bpb = float(r.stdout.split()[2]), float(r.stdout.split()[-1])
    assert (
        r.stdout.startswith("val loss ") and ", bpb " in r.stdout and bpb == pytest.approx(loss / math.log(2), abs=2e-4)
    )

    cfg = config_file(tmp_path / "c.py", char_data, max_iters=40, lr_decay_iters=40, learning_rate=1e-2)
    r = run_cli("bench", str(cfg), "--target_bpb=3.9", "--eval_every=5", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    (run,) = result["runs"]
    assert result["metric"] == "bpb" and result["target_bpb"] == 3.9 and run["reached"]
    assert run["val_bpb"] <= 3.9 and run["val_bpb"] == pytest.approx(run["val_loss"] / math.log(2), rel=1e-9)
    assert run["eval_bytes"] == run["eval_tokens"] and run["steps"] % 5 == 0
    assert all(c["val_bpb"] > 3.9 for c in run["curve"][:-1] if c["se"] is not None)
    r = run_cli("bench", str(cfg), "--target_bpb=3.9", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("c: reached val bpb ") and " bytes)" in r.stdout, r.stderr
    for args, message in [
        (["--target_bpb=0"], "--target_bpb must be a positive number"),
        (["--target_bpb=2", "--target_loss=2"], "give one of them"),
    ]:
        r = run_cli("bench", str(cfg), *args, cwd=tmp_path)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_gpt2_data_trains_without_tiktokens_files_and_says_bpb_is_left_out(bpe_data, tmp_path):
    """Training on GPT-2 token ids never needed tiktoken's files; bits per byte does, so offline without them the
    run goes on with the loss alone (said once), and only --target_bpb is refused."""
    offline = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-cache"), "HTTPS_PROXY": "http://127.0.0.1:9"}
    run = dict(dataset="bpe", max_iters=4, lr_decay_iters=4, eval_interval=2, eval_iters=2)
    r = run_cli("train", *tiny_train_args(bpe_data, tmp_path / "run", **run), cwd=tmp_path, env=offline)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("bits per byte left out: could not load GPT-2's BPE files") == 1
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert len(evals) == 3 and all("val_loss" in e and "val_bpb" not in e for e in evals)
    cfg = config_file(tmp_path / "g.py", bpe_data, **run)
    r = run_cli("bench", str(cfg), "--target_bpb=3", cwd=tmp_path, env=offline)
    assert r.returncode == 2 and "--target_bpb needs the bytes each token stands for" in r.stderr, r.stderr
    r = run_cli("bench", str(cfg), "--target_loss=1", cwd=tmp_path, env=offline)
    assert r.returncode == 0 and r.stdout.startswith("g: NOT reached"), r.stderr


def test_bench_compare_races_two_tokenizers_to_the_same_bits_per_byte(char_data, tmp_path):
    """The same text char-level and as an own BPE: each config is measured on its own held-out windows, which hold
    about the same bytes of text, and the result compares them in bits per byte."""
    (tmp_path / "t.txt").write_text(SMALL_TEXT, encoding="utf-8")
    tok = train_tokenizer([str(tmp_path / "t.txt")], 320, "small", out_root=str(tmp_path / "tokenizers"))
    prepare("text", str(char_data), files=[str(tmp_path / "t.txt")], name="tinybpe", tokenizer=tok)
    run = dict(max_iters=10, lr_decay_iters=10, learning_rate=1e-2)
    char_cfg = config_file(tmp_path / "char.py", char_data, **run)
    bpe_cfg = config_file(tmp_path / "bpe.py", char_data, dataset="tinybpe", **run)
    r = run_cli("bench", str(char_cfg), "--target_bpb=0.5", f"--compare={bpe_cfg}", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    char, bpe = out["runs"]
    assert (char["name"], bpe["name"], out["metric"]) == ("char", "bpe", "bpb") and "bpe" in out["ratios"]
    assert char["eval_bytes"] == char["eval_tokens"] and bpe["eval_bytes"] > 1.5 * bpe["eval_tokens"]
    assert abs(bpe["eval_bytes"] - char["eval_bytes"]) < 0.15 * char["eval_bytes"]  # about the same text
    for result in (char, bpe):
        assert not result["reached"] and math.isfinite(result["val_bpb"]) and result["steps"] == 10
        assert result["best_val_bpb"] == min(c["val_bpb"] for c in result["curve"] if c["se"] is not None)

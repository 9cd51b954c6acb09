"""GGUF export (weights/gguf_file.py, gguf_vocab.py): the file read back by gptforge computes what the run computes
(float32 bit for bit, the smaller types within their rounding), `--init_from=NAME.gguf` works where a model is
read, and what cannot be expressed is refused with exit 2 and nothing written. llama.cpp itself reading the files:
tests/test_gguf_llama.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from chat_tools import ONE_THREAD, base_run, chat_run, tiny_model, write_run
from conftest import run_cli
from gptforge.core.errors import UserError
from gptforge.weights.export import export_run
from gptforge.weights.gguf_file import gguf_tensors, read_gguf
from gptforge.weights.load import load_checkpoint_model

pytest.importorskip("gguf")

# The largest |logit| change of each type on the tiny models here, against the float32 logits (measured ~2e-4,
# 2e-3 and 6e-3 on a random model, logits ~1 in size): bounds with room, not figures.
TOLERANCE = {"f32": 0.0, "f16": 2e-3, "bf16": 2e-2, "q8_0": 3e-2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {"base": base_run(root / "base", block_size=64), "chat": chat_run(root / "chat")}


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(model.hidden_states(torch.tensor([ids])))[0]


@pytest.mark.parametrize("outtype", list(TOLERANCE))
def test_read_back_computes_the_runs_logits(runs, tmp_path, outtype, capsys):
    export_run(str(runs["base"]), None, str(tmp_path / "m.gguf"), outtype, False)
    assert "wrote" in capsys.readouterr().out
    model, tok, _ = load_checkpoint_model(str(runs["base"] / "ckpt.pt"), "cpu")
    back, tok_back, chat = read_gguf(str(tmp_path / "m.gguf"))
    ids = tok.encode("The GGUF file holds the same model, row for row.")
    want, got = _logits(model, ids)[:, :50257], _logits(back, ids)
    assert got.shape == want.shape and tok_back.kind == "gpt2" and not chat
    assert (got - want).abs().max().item() <= TOLERANCE[outtype]
    modelfile = (tmp_path / "m.Modelfile").read_text()
    assert "FROM ./m.gguf" in modelfile and "PARAMETER num_ctx 64" in modelfile


def test_tensor_names_are_llama_cpps_gpt2(runs):
    model, _, _ = load_checkpoint_model(str(runs["base"] / "ckpt.pt"), "cpu")
    names = set(gguf_tensors(model, 50257))
    assert {"token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias"} <= names
    assert "output.weight" not in names  # a tied head: llama.cpp reads token_embd again
    per_block = {n.split(".", 2)[2] for n in names if n.startswith("blk.1.")}
    assert per_block == {
        f"{t}.{k}"
        for t in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
        for k in ("weight", "bias")
    }


def test_a_chat_run_keeps_its_template_and_answers_through_init_from(runs, tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "chat.gguf"
    export_run(str(runs["chat"]), None, str(path), "f32", False)
    fields = gguf.GGUFReader(str(path)).fields
    template = fields["tokenizer.chat_template"].contents()
    assert "<|assistant_start|>" in template and "{%- generation -%}" not in template
    eos = fields["tokenizer.ggml.eos_token_id"].contents()
    assert fields["tokenizer.ggml.tokens"].contents(eos) == "<|assistant_end|>"
    assert 'PARAMETER stop "<|assistant_end|>"' in (tmp_path / "chat.Modelfile").read_text()
    args = ("chat", "--device=cpu", "--temperature=0", "--max_new_tokens=30", "-p", "what is 2+3?")
    from_run = run_cli(*args, f"--out_dir={runs['chat']}", env=ONE_THREAD)
    from_file = run_cli(*args, f"--init_from={path}", env=ONE_THREAD)
    assert from_run.returncode == 0 and from_file.returncode == 0, from_file.stderr
    assert from_file.stdout == from_run.stdout and "5" in from_run.stdout


def test_sample_and_eval_read_a_gguf_file(runs, tmp_path, bpe_data):
    path = tmp_path / "m.gguf"
    export_run(str(runs["base"]), None, str(path), "q8_0", False)
    r = run_cli(
        "sample",
        f"--init_from={path}",
        "--device=cpu",
        "--num_samples=1",
        "--max_new_tokens=5",
        "--start=Hello",
        env=ONE_THREAD,
    )
    assert r.returncode == 0 and r.stdout.startswith("Hello"), r.stderr
    r = run_cli(
        "eval",
        "loss",
        f"--init_from={path}",
        f"--data_dir={bpe_data}",
        "--dataset=bpe",
        "--eval_iters=2",
        "--batch_size=2",
        "--block_size=32",
        "--device=cpu",
        env=ONE_THREAD,
    )
    assert r.returncode == 0, r.stderr


def _nothing_written(folder: Path) -> bool:
    return not any(p.suffix in (".gguf", ".Modelfile") or ".tmp-" in p.name for p in folder.iterdir())


@pytest.mark.parametrize(
    "change, words",
    [
        ({"rotary": True}, "rotary=True"),
        ({"relu2": True}, "relu2=True"),
        ({"logit_softcap": 15.0}, "logit_softcap=15.0"),
    ],
)
def test_a_modern_switch_is_refused_naming_it(tmp_path, change, words):
    run = write_run(tmp_path / "run", tiny_model(block_size=32, **change), {"tokenizer": "gpt2"}, chat=False)
    r = run_cli("export", f"--out_dir={run}", f"--to={tmp_path / 'm.gguf'}")
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
    assert "Hugging Face folder" in r.stderr and _nothing_written(tmp_path)


def test_a_character_vocabulary_and_a_two_digit_bpe_are_refused(tmp_path):
    char = write_run(
        tmp_path / "char",
        tiny_model(vocab_size=65, block_size=32),
        {"tokenizer": "char", "itos": [chr(32 + i) for i in range(65)]},
        chat=False,
    )
    with pytest.raises(UserError, match="character vocabulary"):
        export_run(str(char), None, str(tmp_path / "c.gguf"), "f16", False)
    from gptforge.tokenizer.bpe import BPETokenizer, split_pattern

    tok = BPETokenizer([bytes([b]) for b in range(256)], "two", split_pattern(2))
    two = write_run(tmp_path / "two", tiny_model(vocab_size=tok.vocab_size, block_size=32), tok.spec(), chat=False)
    with pytest.raises(UserError, match="--max_digits 1"):
        export_run(str(two), None, str(tmp_path / "t.gguf"), "f16", False)
    assert _nothing_written(tmp_path)


def test_an_existing_file_needs_force_and_an_unknown_type_exits_2(runs, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"keep me")
    r = run_cli("export", f"--out_dir={runs['base']}", f"--to={path}")
    assert r.returncode == 2 and "--force" in r.stderr and path.read_bytes() == b"keep me"
    r = run_cli("export", f"--out_dir={runs['base']}", f"--to={tmp_path / 'n.gguf'}", "--outtype=q4_k")
    assert r.returncode == 2 and "--outtype" in r.stderr and not (tmp_path / "n.gguf").exists()
    r = run_cli("export", f"--out_dir={runs['base']}", f"--to={path}", "--force", "--outtype=f32")
    assert r.returncode == 0 and read_gguf(str(path))[0].config.n_layer == 2


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    r = run_cli("sample", f"--init_from={bad}", "--device=cpu", "--max_new_tokens=2")
    assert r.returncode == 2 and "bad.gguf" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("sample", f"--init_from={tmp_path / 'none.gguf'}", "--device=cpu")
    assert r.returncode == 2 and "no such file" in r.stderr


def test_model_args_and_tokenizer_are_recorded(runs, tmp_path):
    gguf = pytest.importorskip("gguf")
    export_run(str(runs["base"]), None, str(tmp_path / "m.gguf"), "f16", False)
    fields = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields
    assert json.loads(fields["gptforge.tokenizer"].contents()) == {"tokenizer": "gpt2"}
    assert json.loads(fields["gptforge.model_args"].contents())["n_embd"] == 32
    assert fields["gpt2.context_length"].contents() == 64 and fields["tokenizer.ggml.pre"].contents() == "gpt-2"

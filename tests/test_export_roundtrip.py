"""An exported character-level run round-trips: the Hugging Face folder carries its vocabulary (tokenizer.json that
AutoTokenizer loads, and gptforge_tokenizer.json), every gptforge command that reads a folder uses it (sample,
eval loss, fine-tuning from it), and transformers' greedy generation on the folder equals `gptforge sample
--temperature=0`, in both export formats (GPT-2 and NanoChat). Before, sampling such a folder crashed with an
IndexError: it was read as GPT-2 BPE. The runs exported are trained in this process; every command after is the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli, tiny_train_args, train_in_process
from gptforge.tokenizer.char import CharTokenizer

NANOCHAT = dict(rotary=True, rmsnorm=True, qk_norm=True, relu2=True, untie_head=True, bias=False)
PROMPT = "First Citizen:\n"  # 15 characters: with 16 new ones, within block_size 32 (HF has no window)


def greedy(cwd, source: list[str], tokens: int = 16) -> str:
    options = [f"--start={PROMPT}", "--temperature=0", f"--max_new_tokens={tokens}", "--num_samples=1"]
    r = run_cli("sample", *source, *options, "--device=cpu", cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\n---------------")[0]


@pytest.mark.parametrize("switches", [{}, NANOCHAT], ids=["gpt2", "nanochat"])
def test_an_exported_char_model_samples_evaluates_and_generates_as_its_run(char_data, tmp_path, switches):
    transformers = pytest.importorskip("transformers")
    run, hf = tmp_path / "run", tmp_path / "hf"
    train_in_process(*tiny_train_args(char_data, run, max_iters=30, lr_decay_iters=30, eval_interval=30, **switches))
    r = run_cli("export", f"--out_dir={run}", f"--to={hf}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "tokens: one per character (34 characters; tokenizer.json" in r.stdout
    assert json.loads((hf / "gptforge_tokenizer.json").read_text())["tokenizer"] == "char"

    ours = greedy(tmp_path, [f"--out_dir={run}"])
    assert greedy(tmp_path, [f"--init_from={hf}"]) == ours  # the folder reads as the run did
    meta = json.loads((char_data / "tiny" / "meta.json").read_text())
    chars = CharTokenizer(meta["itos"])
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    assert tok(PROMPT)["input_ids"] == chars.encode(PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([chars.encode(PROMPT)]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert tok.decode(out[0]) == ours

    common = ["--dataset=tiny", f"--data_dir={char_data}", "--eval_iters=2", "--batch_size=4", "--device=cpu"]
    from_run = run_cli("eval", "loss", f"--out_dir={run}", *common, cwd=tmp_path)
    from_folder = run_cli("eval", "loss", f"--init_from={hf}", *common, cwd=tmp_path)
    assert from_run.returncode == from_folder.returncode == 0, from_folder.stderr
    assert from_folder.stdout == from_run.stdout  # the same seeded batches: the same figure


def test_fine_tuning_from_an_exported_char_folder_needs_the_same_vocabulary(char_data, bpe_data, tmp_path):
    run, hf = tmp_path / "run", tmp_path / "hf"
    train_in_process(*tiny_train_args(char_data, run, max_iters=4, lr_decay_iters=4, eval_interval=4))
    assert run_cli("export", f"--out_dir={run}", f"--to={hf}", cwd=tmp_path).returncode == 0
    tuned = tiny_train_args(char_data, tmp_path / "tuned", max_iters=2, lr_decay_iters=2, eval_interval=2)
    r = run_cli("train", *tuned, f"--init_from={hf}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    wrong = tiny_train_args(bpe_data, tmp_path / "wrong", dataset="bpe", max_iters=2, eval_interval=2)
    r = run_cli("train", *wrong, f"--init_from={hf}", cwd=tmp_path)
    assert r.returncode == 2 and "weights that read char tokens" in r.stderr and "Traceback" not in r.stderr

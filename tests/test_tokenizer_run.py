"""A run on an own BPE tokenizer end to end (issue 26): `tokenizer train` -> `prepare text --tokenizer` -> train ->
sample -> eval loss -> export, then transformers: AutoTokenizer gives our ids and greedy `generate` on the exported
folder equals `gptforge sample --temperature=0`, token for token; lm-eval's model reads the run (its <|bos|> as the
end-of-text token, the padded vocabulary cut back); HellaSwag refuses it, naming GPT-2's BPE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import SMALL_TEXT, run_cli, tiny_train_args
from gptforge.tokenizer.bpe import load_tokenizer
from gptforge.tokenizer.specials import BOS

PROMPT = "First Citizen:\nYou are"  # a few tokens: with 12 new ones within block_size 32 (HF has no window)
VOCAB = 300  # 267 + 33 merges; the model pads it to 320 rows, the export cuts it back to 300


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bperun")
    (root / "t.txt").write_text(SMALL_TEXT + "Ünïcödé café 日本 🎉\n" * 10, encoding="utf-8")
    r = run_cli("tokenizer", "train", "t.txt", f"--vocab_size={VOCAB}", "--name=own", cwd=root)
    assert r.returncode == 0, r.stderr
    r = run_cli("prepare", "text", "t.txt", "--name=tiny", "--tokenizer=own", cwd=root)
    assert r.returncode == 0, r.stderr
    run = root / "run"
    args = tiny_train_args(root / "data", run, max_iters=40, lr_decay_iters=40, eval_interval=20, learning_rate=1e-2)
    r = run_cli("train", *args, cwd=root)
    assert r.returncode == 0, r.stderr
    assert "val bpb" in r.stdout
    r = run_cli("export", f"--out_dir={run}", f"--to={root / 'hf'}", cwd=root)
    assert r.returncode == 0, r.stderr
    assert f"own byte-level BPE 'own' ({VOCAB} tokens" in r.stdout
    assert f"vocabulary cut from 320 (padded) to the tokenizer's {VOCAB} tokens" in r.stderr
    return {"root": root, "run": run, "hf": root / "hf", "tok": root / "tokenizers" / "own"}


def greedy(cwd: Path, source: str, tokens: int = 12) -> str:
    options = [f"--start={PROMPT}", "--temperature=0", f"--max_new_tokens={tokens}", "--num_samples=1"]
    r = run_cli("sample", source, *options, "--device=cpu", cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\n---------------")[0]


def test_transformers_generates_what_gptforge_samples_token_for_token(bpe_run):
    transformers = pytest.importorskip("transformers")
    root, hf = bpe_run["root"], bpe_run["hf"]
    ours = greedy(root, f"--out_dir={bpe_run['run']}")
    assert greedy(root, f"--init_from={hf}") == ours  # the folder reads as the run did
    tok = load_tokenizer(str(bpe_run["tok"]))
    assert json.loads((hf / "gptforge_tokenizer.json").read_text())["tokenizer"] == "bpe"
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    for text in (PROMPT, "café 日本 🎉 x", SMALL_TEXT[:500]):  # (Hugging Face reads special strings as specials)
        assert hf_tok(text)["input_ids"] == tok.encode(text)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    assert model.config.vocab_size == VOCAB and model.config.bos_token_id == tok.special_id(BOS)
    prompt = tok.encode(PROMPT)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert len(out[0]) == len(prompt) + 12
    assert tok.decode(out[0].tolist()) == ours == hf_tok.decode(out[0])

    common = ["--dataset=tiny", f"--data_dir={root / 'data'}", "--eval_iters=2", "--batch_size=4", "--device=cpu"]
    from_run = run_cli("eval", "loss", f"--out_dir={bpe_run['run']}", *common, cwd=root)
    from_folder = run_cli("eval", "loss", f"--init_from={hf}", *common, cwd=root)
    assert from_run.returncode == from_folder.returncode == 0, from_folder.stderr
    assert ", bpb " in from_run.stdout and ", bpb " in from_folder.stdout
    # the run's softmax spans its 320 rows (nanoGPT's padded vocabulary); the export's, the tokenizer's 300
    assert float(from_folder.stdout.split()[2]) == pytest.approx(cut_loss(bpe_run, VOCAB), abs=1e-4)
    assert float(from_run.stdout.split()[2]) == pytest.approx(cut_loss(bpe_run, 320), abs=1e-4)


def cut_loss(bpe_run: dict[str, Path], rows: int) -> float:
    """The run's val loss on `eval loss`'s batches (seed 1337) with the softmax over its first `rows` logits."""
    from gptforge.data.loader import make_batches, read_meta
    from gptforge.weights.load import load_checkpoint_model

    model, _, _ = load_checkpoint_model(str(bpe_run["run"] / "ckpt.pt"), "cpu")
    folder = str(bpe_run["root"] / "data" / "tiny")
    batches = make_batches(folder, read_meta(folder), "val", "random", 4, 32, 320, "cpu", 1337)
    total = 0.0
    with torch.no_grad():
        for _ in range(2):
            x, y = batches.next_batch()
            logits = model.logits(model.hidden_states(x))[..., :rows].double()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item() / 2
    return total


def test_hellaswag_refuses_and_lm_eval_reads_the_run(bpe_run):
    root = bpe_run["root"]
    r = run_cli("eval", "hellaswag", f"--out_dir={bpe_run['run']}", "--device=cpu", cwd=root)
    assert r.returncode == 2 and "HellaSwag needs a model trained with GPT-2's BPE" in r.stderr, r.stderr
    assert "'bpe'" in r.stderr and "Traceback" not in r.stderr
    pytest.importorskip("lm_eval")
    transformers = pytest.importorskip("transformers")
    from gptforge.evaluate.harness_model import GPTForgeLM

    lm = GPTForgeLM(ckpt=str(bpe_run["run"] / "ckpt.pt"), device="cpu")
    tok = load_tokenizer(str(bpe_run["tok"]))
    assert lm.eot_token_id == tok.special_id(BOS) and lm.tok_encode(PROMPT) == tok.encode(PROMPT)

    class Request:  # what lm-eval hands a model: the arguments of one request
        args = (PROMPT,)

    (ours,) = lm.loglikelihood_rolling([Request()], disable_tqdm=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(bpe_run["hf"]), dtype=torch.float32).eval()
    ids = [tok.special_id(BOS), *tok.encode(PROMPT)]  # <|bos|> first, as lm-eval's rolling windows put it
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    assert ours == pytest.approx(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item(), abs=1e-3)

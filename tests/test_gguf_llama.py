"""gptforge's GGUF files in llama.cpp itself (llama-cpp-python, built from its source distribution by the [test]
extra): the logits on 20 prompts, 50 greedy tokens, the tokenizer on random text (GPT-2 BPE, and an own BPE under
each pre-tokenizer it maps to), and a chat model's answer through llama.cpp's chat completion with the file's own
template against `gptforge chat -p`. Where llama.cpp computes differently the tolerance says why."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from chat_tools import ONE_THREAD, chat_run, tiny_model, write_run
from conftest import run_cli
from gptforge.infer.engine import generate
from gptforge.weights.export import export_run
from gptforge.weights.load import load_checkpoint_model

pytest.importorskip("gguf")
if os.environ.get("GPTFORGE_REQUIRE_LLAMA_CPP") != "1":
    pytest.importorskip("llama_cpp")  # CI sets GPTFORGE_REQUIRE_LLAMA_CPP=1: a missing llama.cpp fails there
import llama_cpp  # noqa: E402

# llama.cpp's GELU is GPT-2's tanh form read from a float16 table (its input rounded to float16): the float32
# file's logits therefore differ from ours by more than float32 rounding; measured at most ~1e-3 on these models
# (logits ~1). Stored float16 / Q8_0 weights add their own rounding.
TOLERANCE = {"f32": 5e-3, "f16": 1e-2, "q8_0": 5e-2}
PROMPTS = [
    f"Prompt {i}: "
    + " ".join(
        random.Random(i).choice(["the", "model", "runs", "in", "llama.cpp", "42", "héllo", "\n", "  "])
        for _ in range(3 + i // 2)
    )
    for i in range(20)
]


def _llama(path, n_ctx):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, n_threads=1, verbose=False, seed=0)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-llama")
    run = write_run(root / "run", tiny_model(block_size=64, gelu="tanh"), {"tokenizer": "gpt2"}, chat=False)
    files = {}
    for outtype in TOLERANCE:
        export_run(str(run), None, str(root / f"{outtype}.gguf"), outtype, False)
        files[outtype] = root / f"{outtype}.gguf"
    model, tok, _ = load_checkpoint_model(str(run / "ckpt.pt"), "cpu")
    return model, tok, files


@pytest.mark.parametrize("outtype", list(TOLERANCE))
def test_logits_on_20_prompts_match_llama_cpps(base, outtype):
    model, tok, files = base
    llm = _llama(files[outtype], 64)
    worst = 0.0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert llm.tokenize(prompt.encode(), add_bos=False, special=False) == ids
        llm.reset()
        llm.eval(ids)
        theirs = np.asarray(llm.scores[: len(ids)])
        with torch.no_grad():
            ours = model.logits(model.hidden_states(torch.tensor([ids])))[0, :, :50257].numpy()
        worst = max(worst, float(np.abs(theirs - ours).max()))
    assert worst <= TOLERANCE[outtype], worst


def test_50_greedy_tokens_are_llama_cpps(base):
    model, tok, files = base
    llm = _llama(files["f32"], 64)
    ids = tok.encode("Once upon a time")
    theirs = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        theirs.append(token)
        if len(theirs) == 50:
            break
    with torch.no_grad():
        ours = generate(model, torch.tensor([ids]), 50, temperature=0.0)[0, len(ids) :].tolist()
    assert theirs == ours


def test_a_chat_answer_through_llama_cpps_chat_completion_is_gptforge_chats(tmp_path):
    run = chat_run(tmp_path / "chat")
    path = tmp_path / "chat.gguf"
    export_run(str(run), None, str(path), "f32", False)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, verbose=False, seed=0)
    for question in ("hi", "what is 2+3?"):
        reply = llm.create_chat_completion(
            [{"role": "user", "content": question}], temperature=0.0, top_k=1, max_tokens=40
        )
        r = run_cli(
            "chat",
            f"--out_dir={run}",
            "--device=cpu",
            "--temperature=0",
            "--max_new_tokens=40",
            "-p",
            question,
            env=ONE_THREAD,
        )
        assert r.returncode == 0, r.stderr
        assert reply["choices"][0]["message"]["content"] == r.stdout.rstrip("\n")


ALPHABET = [
    "a",
    "Z",
    "é",
    "ß",
    "日本",
    "🙂",
    "👩‍👩‍👧",
    "0",
    "7",
    "123456",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "'s",
    "'LL",
    ".",
    ",",
    "!?",
    "<|endoftext|>",
    "<|bos|>",
    "ü",
    "ℕ",
    "\u00a0",
    "x" * 30,
]


def _random_texts(n=300, seed=0):
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 25))) for _ in range(n)]


def test_llama_cpps_tokenizer_gives_gpt2_bpes_ids(base):
    _, tok, files = base
    llm = llama_cpp.Llama(model_path=str(files["f16"]), n_ctx=64, vocab_only=True, verbose=False)
    for text in _random_texts():
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text), repr(text)


@pytest.mark.parametrize("digits", [1, 3])
def test_llama_cpps_tokenizer_gives_an_own_bpes_ids(tmp_path, shakespeare_path, digits):
    from gptforge.tokenizer.spec import folder_tokenizer
    from gptforge.tokenizer.train import train_tokenizer

    sample = tmp_path / "text.txt"
    sample.write_text(shakespeare_path.read_text()[:200_000] + " 2024 3.14159 😀 naïve café 日本語 ")
    folder = train_tokenizer([str(sample)], 700, f"d{digits}", out_root=str(tmp_path / "tok"), max_digits=digits)
    tok = folder_tokenizer(folder)
    run = write_run(tmp_path / "run", tiny_model(vocab_size=tok.vocab_size, block_size=32), tok.spec(), chat=False)
    export_run(str(run), None, str(tmp_path / "m.gguf"), "f16", False)
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=32, vocab_only=True, verbose=False)
    for text in [*_random_texts(seed=digits), "Thou art 1234 fathoms deep,\n\n  my lord."]:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text), repr(text)

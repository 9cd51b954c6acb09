"""Continuous batching in-process (infer/batcher.py): rows that join and leave between steps get the tokens they get
alone, a cancelled request frees its row, and the API's in-process edges (a character the vocabulary lacks, a chat
request to a base model, the tokenizer routes) through FastAPI's test client."""

from __future__ import annotations

import threading

import pytest
import torch

from chat_tools import one_thread, tiny_model, write_run  # noqa: F401
from conftest import TIKTOKEN_CACHE, need_shared
from gptforge.infer.batcher import Batcher, Request
from gptforge.infer.chat_model import load_for_inference
from gptforge.infer.sampling import SamplingParams
from gptforge.infer.session import Session
from gptforge.tokenizer.char import CharTokenizer


@pytest.fixture(scope="module", params=[False, True], ids=["learned positions", "rotary"])
def lm(request, tmp_path_factory):
    """A random GPT-2 BPE base model: GPT-2's shape, or with rotary positions (NanoChat's), each row at its own."""
    need_shared(TIKTOKEN_CACHE)
    model = tiny_model(block_size=128, rotary=request.param)
    folder = write_run(tmp_path_factory.mktemp("base") / "run", model, {"tokenizer": "gpt2"}, chat=False)
    return load_for_inference(str(folder), None, "resume", "cpu", "float32")


def collect(request_tokens: dict, done: threading.Event, count: int):
    finished = []

    def emit(event):
        if event.kind == "token" and event.token is not None:
            request_tokens.setdefault(event.index, []).append(event.token)
        elif event.kind == "done":
            finished.append(event.finish)
            if len(finished) == count:
                done.set()

    return emit


def test_rows_that_join_and_leave_between_steps_get_their_solo_tokens(lm):
    prompts = [lm.encode(f"A story number {i}:" + " and" * i) for i in range(5)]
    budgets = [30, 5, 20, 12, 25]
    alone = []
    for prompt, budget in zip(prompts, budgets, strict=True):
        session = Session(lm)
        "".join(session.answer(lm.tokenizer.decode(prompt), SamplingParams(temperature=0), budget))
        alone.append(session.ids[len(prompt) :])
    batcher = Batcher(lm, max_batch=3)  # 5 requests, 3 rows: later ones join as earlier ones leave
    got, events = [{} for _ in prompts], [threading.Event() for _ in prompts]
    try:
        for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
            emit = collect(got[i], events[i], 1)
            batcher.submit(Request([prompt], SamplingParams(temperature=0), budget, emit))
            if i == 1:
                events[1].wait(30)  # the second one finishes before the third is even submitted
        assert all(e.wait(60) for e in events)
    finally:
        batcher.close()
    assert [g[0] for g in got] == alone
    stats = batcher.snapshot()
    assert stats["steps"] < stats["step_tokens"] and stats["max_rows"] == 3 and stats["rows"] == 0


def test_a_cancelled_request_frees_its_row_at_the_next_step(lm):
    batcher = Batcher(lm, max_batch=2)
    started = threading.Event()
    request = Request(
        [lm.encode("go")],
        SamplingParams(temperature=1.0, seed=0),
        120,
        lambda e: started.set() if e.kind == "token" else None,
        ignore_eos=True,
    )
    try:
        batcher.submit(request)
        assert started.wait(30)
        batcher.cancel(request)
        for _ in range(200):
            if not batcher.snapshot()["rows"]:
                break
            threading.Event().wait(0.01)
        assert batcher.snapshot()["rows"] == 0 and batcher.snapshot()["step_tokens"] < 119
    finally:
        batcher.close()


def test_the_apis_edges_in_process(lm, tmp_path):
    testclient = pytest.importorskip("fastapi.testclient")
    from gptforge.infer.openai_api import Limits
    from gptforge.infer.serve import build_app

    chars = CharTokenizer(list(" abcdefghijklmnopqrstuvwxyz"))
    folder = write_run(tmp_path / "char", tiny_model(vocab_size=chars.vocab_size, block_size=32), chars.spec(), False)
    char_lm = load_for_inference(str(folder), None, "resume", "cpu", "float32")
    with testclient.TestClient(build_app(char_lm, Limits()), base_url="http://127.0.0.1") as client:
        r = client.post("/v1/completions", json={"model": "char", "prompt": "Hello 42", "max_tokens": 3})
        assert r.status_code == 400 and "character 'H'" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": "char", "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
        }
        r = client.post("/v1/chat/completions", json={"model": "char", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "not_a_chat_model"
    with testclient.TestClient(build_app(lm, Limits()), base_url="http://localhost") as client:
        info = client.get("/tokenizer_info").json()
        assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 128
        tokens = client.post("/tokenize", json={"prompt": "<|endoftext|>Hello"}).json()["tokens"]
        assert tokens == [50256, *lm.encode("Hello")]
        assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "<|endoftext|>Hello"
        r = client.post("/v1/completions", json={"model": "run", "prompt": [[1, 2], [3]], "max_tokens": 2, "n": 20})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert torch.get_num_threads() == 1

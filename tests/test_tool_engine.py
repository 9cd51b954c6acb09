"""The engine runs the built-in calculator while a chat model answers (infer/toolcalls.py, infer/session.py): a tiny
model that has memorised a call (and, on purpose, a wrong output after it) gets the calculator's output fed
instead; the conversation's tokens equal what the renderer makes of its messages; --tools none answers the call
with an error text; `gptforge chat -p` shows the call on stderr and the answer on stdout."""

from __future__ import annotations

import json

import pytest

from chat_tools import memorise, one_thread, tiny_model, write_run  # noqa: F401  (one_thread: a fixture)
from conftest import run_cli
from gptforge.chat.render import chat_special_ids, render
from gptforge.chat.synthetic import generate
from gptforge.evaluate.chat import task_accuracy
from gptforge.infer.chat_model import load_for_inference
from gptforge.infer.sampling import SamplingParams
from gptforge.infer.session import Session
from gptforge.tokenizer.spec import from_spec

GREEDY = SamplingParams(temperature=0.0)
QUESTION = "what is 12*34?"
CALL = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'}}
LEARNED = [  # the memorised answer writes the call, then reads a wrong output: the engine's must replace it
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "999"},
    {"role": "assistant", "content": "It is that."},
]


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    tok = from_spec({"tokenizer": "gpt2"})
    rows = [render(LEARNED, tok, chat_special_ids(tok))]
    model = memorise(tiny_model(block_size=128), rows, steps=200)
    return write_run(tmp_path_factory.mktemp("tool-run"), model, tok.spec(), chat=True)


def test_the_calculator_runs_and_its_output_is_fed(tool_run):
    lm = load_for_inference(str(tool_run), None, "resume", "cpu", "float32")
    seen = []
    session = Session(lm, notify=lambda message: None)
    text = "".join(session.answer(QUESTION, GREEDY, 60, on_tool=seen.append))
    (call,) = session.last.calls
    assert (call.name, call.arguments, call.output) == ("calculator", '{"expression": "12*34"}', "408")
    assert seen == [call] and text == "It is that." and session.last.finish_reason == "stop"
    assert session.messages[1]["tool_calls"][0]["function"]["name"] == "calculator"
    assert session.messages[2] == {"role": "tool", "tool_call_id": "call_0", "content": "408"}
    ids, _ = render(session.messages, lm.tokenizer, lm.special_ids)
    assert session.ids == ids  # what the model read is what the renderer makes of the messages


def test_tools_none_answers_the_call_with_an_error(tool_run):
    lm = load_for_inference(str(tool_run), None, "resume", "cpu", "float32")
    session = Session(lm, notify=lambda message: None, tools=frozenset())
    "".join(session.answer(QUESTION, GREEDY, 60))
    assert session.last.calls[0].output == "error: there is no tool named 'calculator'"


def test_chat_p_shows_the_call_on_stderr(tool_run, tmp_path):
    r = run_cli("chat", f"--out_dir={tool_run}", "--device=cpu", "--temperature=0", "-p", QUESTION)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "It is that.\n"
    assert '[calculator {"expression": "12*34"} -> 408]' in r.stderr
    r = run_cli("chat", f"--out_dir={tool_run}", "--tools=abacus", "-p", QUESTION)
    assert r.returncode == 2 and "--tools" in r.stderr and "calculator" in r.stderr, r.stderr
    saved = tmp_path / "talk.jsonl"
    session = Session(load_for_inference(str(tool_run), None, "resume", "cpu", "float32"), notify=lambda m: None)
    "".join(session.answer(QUESTION, GREEDY, 60))
    session.save(str(saved))
    assert json.loads(saved.read_text())["messages"][2]["content"] == "408"
    again = Session(load_for_inference(str(tool_run), None, "resume", "cpu", "float32"), notify=lambda m: None)
    again.load(str(saved))
    assert again.ids == session.ids  # a saved conversation with a tool call loads back to the same tokens


def test_eval_chat_runs_the_calculator_and_counts_the_calls(tmp_path):
    """A model that memorised held-out multiplications with their calculator calls: with the engine running the
    calculator every answer is right and called; with plain generation (no calls watched) the call's text is the
    answer, and wrong."""
    tok = from_spec({"tokenizer": "gpt2"})
    problems = generate(2, 3, "held_out", kinds=["mul", "spell"], tools="calculator")
    assert [p.calls for p in problems] == [True, False]
    rows = [render(p.messages, tok, chat_special_ids(tok)) for p in problems]
    model = memorise(tiny_model(block_size=128, seed=2), rows, steps=300)
    result = task_accuracy(model, tok, problems, "cpu", tools=frozenset({"calculator"}))
    assert (result["acc_mul"], result["calls_mul"], result["acc_spell"], result["calls_spell"]) == (1.0, 1.0, 1.0, 0.0)
    plain = task_accuracy(model, tok, problems, "cpu")
    assert (plain["acc_mul"], plain["acc_spell"]) == (0.0, 1.0) and "calls_mul" not in plain


def test_eval_chat_runs_the_synthetic_function_as_the_client_would():
    tok = from_spec({"tokenizer": "gpt2"})
    problems = generate(2, 4, "held_out", kinds=["convert"])
    rows = [render(p.conversation(), tok, chat_special_ids(tok)) for p in problems]
    model = memorise(tiny_model(block_size=256, seed=5), rows, steps=300)
    result = task_accuracy(model, tok, problems, "cpu", tools=frozenset({"calculator"}))
    assert (result["acc_convert"], result["calls_convert"]) == (1.0, 1.0)

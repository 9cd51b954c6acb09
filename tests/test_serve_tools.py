"""OpenAI function calling through `gptforge serve` (infer/function_calling.py), with the official `openai` client and
LangChain's ChatOpenAI(...).bind_tools: a tiny model that has memorised a weather lookup writes the call, the
response ends with finish_reason "tool_calls" and message.tool_calls (streamed as delta.tool_calls with the
arguments in pieces), the client sends the tool's answer back, and the final answer uses it. The calculator stays
server-side. tool_choice none / required / a named function; bad tools, tool messages and tool_choice get 400s
with OpenAI's error JSON, and the server lives on."""

from __future__ import annotations

import json

import pytest

from chat_tools import Server, memorise, tiny_model, write_run
from conftest import TIKTOKEN_CACHE, need_shared
from gptforge.chat.render import chat_special_ids, render
from gptforge.tokenizer.spec import from_spec

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")

WEATHER = {
    "type": "function",
    "function": {
        "name": "lookup_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = "What is the weather in Paris?"
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup_weather", "arguments": '{"city": "Paris"}'}}
ANSWER = "It is 18 C in Paris."
CALC = {"id": "c2", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'}}
MEMORISED = [  # (messages, tools)
    ([{"role": "user", "content": ASK}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "c1", "content": "18 C"}, {"role": "assistant", "content": ANSWER}], [WEATHER]),
    ([{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}], [WEATHER]),
    ([{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": None, "tool_calls": [CALC]},
      {"role": "tool", "tool_call_id": "c2", "content": "408"}, {"role": "assistant", "content": "It is 408."}], []),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_shared(TIKTOKEN_CACHE)
    from gptforge.chat.conversations import parse_record

    tok = from_spec({"tokenizer": "gpt2"})
    rows = [
        render(parse_record({"messages": m, "tools": t}, "memorised"), tok, chat_special_ids(tok)) for m, t in MEMORISED
    ]
    model = memorise(tiny_model(block_size=128, seed=3), rows, steps=200)
    folder = write_run(tmp_path_factory.mktemp("tools") / "run", model, tok.spec(), chat=True)
    server = Server(f"--out_dir={folder}", "--name=tiny-tools")
    yield server
    assert server.stop() == 0, "".join(server.log)


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def ask(server, messages, **more):
    return client(server).chat.completions.create(
        model="tiny-tools", messages=messages, temperature=0, max_tokens=60, **more
    )


def test_a_call_and_its_answer_round_trip_with_the_official_client(server):
    first = ask(server, [{"role": "user", "content": ASK}], tools=[WEATHER])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "lookup_weather",
        {"city": "Paris"},
    )
    assert call.id.startswith("call_")
    followed = [
        {"role": "user", "content": ASK},
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    final = ask(server, followed, tools=[WEATHER])
    assert final.choices[0].message.content == ANSWER and final.choices[0].finish_reason == "stop"
    health = server.health()
    assert health["tool_calls"] >= 1 and health["tool_calls_invalid"] == 0


def test_a_streamed_call_comes_as_delta_tool_calls(server):
    stream = ask(server, [{"role": "user", "content": ASK}], tools=[WEATHER], stream=True)
    pieces, finish, name, ids = [], None, None, set()
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            ids.add(delta.id) if delta.id else None
            name = delta.function.name or name
            pieces.append(delta.function.arguments or "")
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and name == "lookup_weather" and len(ids) == 1
    assert "".join(pieces) == '{"city": "Paris"}' and len([p for p in pieces if p]) >= 2  # in pieces


def test_tool_choice_none_required_and_named(server):
    none = ask(server, [{"role": "user", "content": "Say hi."}], tools=[WEATHER], tool_choice="none")
    assert none.choices[0].finish_reason == "stop" and not none.choices[0].message.tool_calls
    for choice in ("required", {"type": "function", "function": {"name": "lookup_weather"}}):
        forced = ask(server, [{"role": "user", "content": ASK}], tools=[WEATHER], tool_choice=choice)
        assert forced.choices[0].message.tool_calls, (choice, forced)
        (call,) = forced.choices[0].message.tool_calls
        assert call.function.name == "lookup_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    plain = ask(server, [{"role": "user", "content": "Say hi."}], tools=[WEATHER])
    assert plain.choices[0].message.content == "Hi!" and plain.choices[0].finish_reason == "stop"


def test_the_calculator_stays_on_the_server(server):
    r = ask(server, [{"role": "user", "content": "What is 12*34?"}])
    assert r.choices[0].message.content == "It is 408." and not r.choices[0].message.tool_calls


def test_a_row_reading_the_calculators_output_leaves_the_others_their_solo_answers(server):
    """Rows that call the calculator (n=2, temperature 0) and rows that do not, in flight together: each gets the
    answer it gets alone."""
    import concurrent.futures

    questions = ["What is 12*34?", "Say hi.", ASK, "What is 12*34?"]
    alone = [
        ask(server, [{"role": "user", "content": q}], n=2, tools=[WEATHER] if q == ASK else None) for q in questions
    ]
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda q: ask(server, [{"role": "user", "content": q}], n=2,
                                               tools=[WEATHER] if q == ASK else None), questions))  # fmt: skip

    def shape(response):  # each choice's text, calls (ids are fresh each time) and finish reason
        return [
            (c.message.content, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
             c.finish_reason)
            for c in response.choices
        ]  # fmt: skip

    for a, b in zip(alone, together, strict=True):
        assert shape(a) == shape(b)
    assert alone[0].choices[1].message.content == "It is 408."


def test_langchain_bind_tools_round_trip(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="none", model="tiny-tools", temperature=0, max_tokens=60, max_retries=0
    ).bind_tools([WEATHER])
    messages = [HumanMessage(ASK)]
    reply = llm.invoke(messages)
    (call,) = reply.tool_calls
    assert (call["name"], call["args"]) == ("lookup_weather", {"city": "Paris"})
    messages += [reply, ToolMessage("18 C", tool_call_id=call["id"])]
    assert llm.invoke(messages).content == ANSWER


BAD = [  # (body changes, param, words)
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "needs a function name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs functions"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be 'auto'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "a", "content": "1"}]},
     "messages", "a tool message after 'user'"),
    ({"tools": [WEATHER], "messages": [{"role": "user", "content": ASK},
      {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "other", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "1"}]}, "messages", "a call to 'other'"),
]  # fmt: skip


@pytest.mark.parametrize("change, param, words", BAD)
def test_bad_tools_get_a_400_with_openais_error_json(server, change, param, words):
    body = {"model": "tiny-tools", "messages": [{"role": "user", "content": ASK}], "max_tokens": 5, **change}
    r = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and words in error["message"], r.text
    assert error["type"] == "invalid_request_error" and server.health()["status"] == "ok"

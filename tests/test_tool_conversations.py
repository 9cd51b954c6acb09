"""Conversations with tools (chat/tools.py): OpenAI's tool_calls and tool messages read, checked and rendered in one
assistant turn (the calls trained, the outputs never), by hand count and against apply_chat_template(...,
tools=...) on the exported tokenizer; a written conversation reads back the same; bad data named by FILE:LINE."""

from __future__ import annotations

import json
import random

import pytest

import test_chat_render as chat_render
from conftest import run_cli
from gptforge.chat.conversations import parse_record, read_file
from gptforge.chat.render import encode, render, render_prompt
from gptforge.chat.tools import call_text, tools_text
from gptforge.core.errors import UserError
from gptforge.tokenizer.specials import gpt2_special_ids

IDS = gpt2_special_ids()
tok, hf_tokenizer, random_text = chat_render.tok, chat_render.hf_tokenizer, chat_render.random_text  # fixtures
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "description": "Convert a length between units",
        "parameters": {"type": "object", "properties": {"value": {"type": "number"}, "to": {"type": "string"}}},
    },
}


def call(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


ASKED = [
    {"role": "user", "content": "What is 12*34?"},
    {"role": "assistant", "content": None, "tool_calls": [call("c1", "calculator", '{"expression": "12*34"}')]},
    {"role": "tool", "tool_call_id": "c1", "content": "408"},
    {"role": "assistant", "content": "It is 408."},
]


def test_one_turn_by_hand_the_call_is_trained_the_output_is_not(tok):
    ids, mask = render(parse_record({"messages": ASKED}, "t:1"), tok, IDS)
    written = call_text("calculator", '{"expression": "12*34"}')
    parts = [  # (ids, trained)
        ([IDS["<|bos|>"], IDS["<|user_start|>"], *tok.encode("What is 12*34?"), IDS["<|user_end|>"]], 0),
        ([IDS["<|assistant_start|>"]], 0),
        ([IDS["<|tool_call_start|>"], *tok.encode(written), IDS["<|tool_call_end|>"]], 1),
        ([IDS["<|tool_output_start|>"], *tok.encode("408"), IDS["<|tool_output_end|>"]], 0),
        ([*tok.encode("It is 408."), IDS["<|assistant_end|>"]], 1),
    ]
    assert ids == [i for part, _ in parts for i in part]
    assert mask == [t for part, t in parts for _ in part]
    assert written == '{"name": "calculator", "arguments": {"expression": "12*34"}}'
    encoded = encode(parse_record({"messages": ASKED}, "t:1"), tok)
    assert encoded.header + sum(encoded.exchange_lengths()) == len(ids)  # what the packer counts


def test_the_prompt_goes_on_after_a_tool_output_and_tools_sit_in_the_system_turn(tok):
    conversation = parse_record({"messages": ASKED[:3], "tools": [CONVERT]}, "t:1", training=False)
    prompt = render_prompt(conversation, tok, IDS)
    assert prompt[-1] == IDS["<|tool_output_end|>"]  # no <|assistant_start|>: the turn goes on
    system = tools_text([CONVERT["function"]])
    assert prompt[:3] == [IDS["<|bos|>"], IDS["<|system_start|>"], *tok.encode(system)[:1]]
    assert system.splitlines()[1] == json.dumps(CONVERT["function"])


def some_text(rng: random.Random) -> str:
    """Random text with something in it besides white space (the reader's rule for a message)."""
    while not (text := random_text(rng, False)).strip():
        pass
    return text


def random_tool_conversation(rng: random.Random) -> tuple[list[dict], list[dict]]:
    tools = [CONVERT] if rng.random() < 0.6 else []
    names = ["calculator"] + [t["function"]["name"] for t in tools]
    messages = [{"role": "system", "content": some_text(rng)}] if rng.random() < 0.4 else []
    for turn in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": some_text(rng)})
        for round_ in range(rng.choice([0, 1, 1, 2])):
            calls = [
                call(f"c{turn}{round_}{k}", rng.choice(names), rng.choice(['{"expression": "1+2"}', {"value": 3}]))
                for k in range(rng.choice([1, 1, 2]))
            ]
            text = some_text(rng) if rng.random() < 0.5 else None
            messages.append({"role": "assistant", "content": text, "tool_calls": calls})
            for c in reversed(calls) if rng.random() < 0.3 else calls:
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": some_text(rng)})
        answer = {"role": "assistant", "content": some_text(rng)}
        if rng.random() < 0.15:
            answer["train"] = False
        messages.append(answer)
    return messages, tools


def test_template_parity_on_100_generated_conversations_with_tools(hf_tokenizer, tok):
    rng = random.Random(60)
    for n in range(100):
        messages, tools = random_tool_conversation(rng)
        conversation = parse_record({"messages": messages, "tools": tools}, f"generated:{n}")
        out = hf_tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = render(conversation, tok, IDS)
        assert list(out["input_ids"]) == ids, f"conversation {n}: ids differ: {messages}"
        assert list(out["assistant_masks"]) == mask, f"conversation {n}: masks differ: {messages}"
        cut = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool")) + 1
        prompt = parse_record({"messages": messages[:cut], "tools": tools}, f"generated:{n}", training=False)
        hf_prompt = hf_tokenizer.apply_chat_template(
            messages[:cut], tools=tools or None, tokenize=True, return_dict=True, add_generation_prompt=True
        )
        assert list(hf_prompt["input_ids"]) == render_prompt(prompt, tok, IDS), f"conversation {n}: prompts differ"
        again = parse_record(json.loads(json.dumps(conversation.to_openai())), "again")
        assert again.messages == conversation.messages and again.tools == conversation.tools


def tool(call_id: str, content: str = "1") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def calls(*pairs) -> dict:
    return {"role": "assistant", "tool_calls": [call(i, name, arguments) for i, name, arguments in pairs]}


TWO_CALLS = calls(("a", "calculator", "{}"), ("b", "calculator", "{}"))
NOT_OFFERED = [ASKED[0], calls(("c1", "weather", "{}")), ASKED[2], ASKED[3]]
BAD = [  # (messages, tools, words of the error)
    ([ASKED[0], tool("x")], None, "a tool message after 'user'"),
    ([*ASKED[:2], tool("c9"), ASKED[3]], None, "answers call id 'c9'"),
    ([*ASKED[:2], ASKED[3]], None, "message 3 is 'assistant' after a tool call"),
    ([ASKED[0], TWO_CALLS, tool("a"), calls(("c", "calculator", "{}"))], None, "message 5: 1 tool call(s) before it"),
    ([*ASKED[:3], tool("c1", "2"), ASKED[3]], None, "more tool messages than calls"),
    ([ASKED[0], calls(("c1", "calculator", "{'expression': 1}"))], None, "arguments are not valid JSON"),
    ([ASKED[0], calls(("c1", "calculator", "[1]"))], None, "arguments must be a JSON object"),
    (NOT_OFFERED, [CONVERT], "a call to 'weather', which is not in the conversation's tools (calculator, convert)"),
    (ASKED, [{"type": "function", "function": {"name": "has space"}}], "tool 1 needs a function name"),
    (ASKED, [{"type": "retrieval"}], 'only "function" tools exist'),
    (ASKED, [CONVERT, CONVERT], "the function 'convert' is listed twice"),
    (ASKED, {"convert": {}}, '"tools" must be a list'),
    (ASKED[:3], None, "the last message is a tool message, with no answer"),
]


@pytest.mark.parametrize("messages, tools, words", BAD)
def test_bad_tool_data_is_named_by_file_and_line(tmp_path, messages, tools, words):
    path = tmp_path / "talk.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    record = {"messages": messages, **({"tools": tools} if tools is not None else {})}
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError) as caught:
        read_file(str(path))
    assert str(caught.value).startswith(f"{path}:2:") and words in str(caught.value), str(caught.value)


def test_prepare_chat_takes_tool_conversations_and_names_a_bad_line(tmp_path, tiktoken_cache):
    rng = random.Random(1)
    lines = [json.dumps({"messages": random_tool_conversation(rng)[0], "tools": [CONVERT]}) for _ in range(40)]
    (tmp_path / "tools.jsonl").write_text("\n".join(lines) + "\n")
    r = run_cli("prepare", "chat", "tools.jsonl", "--name=tools", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    bad = {"messages": [ASKED[0], {"role": "tool", "tool_call_id": "c1", "content": "408"}]}
    (tmp_path / "bad.jsonl").write_text("\n".join([*lines[:3], json.dumps(bad)]) + "\n")
    r = run_cli("prepare", "chat", "bad.jsonl", "--name=bad", cwd=tmp_path)
    assert r.returncode == 2 and "bad.jsonl:4: message 2 is a tool message" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "data" / "bad").exists()


def test_synthetic_arithmetic_calls_the_calculator_in_every_wording():
    from gptforge.chat.calculator import calculate
    from gptforge.chat.conversations import check_conversation
    from gptforge.chat.synthetic import generate

    plain = generate(400, 5, "train")
    tooled = generate(400, 5, "train", tools="calculator")
    for a, b in zip(plain, tooled, strict=True):
        assert (a.key, a.answer) == (b.key, b.answer)  # the same problems
        assert b.prompt == a.prompt or b.kind == "recall"  # asked the same (a recall's earlier sums used the tool)
        check_conversation(b.conversation())
        arithmetic = sum(m.role == "user" and m.content[0] in "WC0123456789" for m in a.messages)
        outputs = [m.content for m in b.messages if m.role == "tool_output"]
        if b.kind in ("add3", "add", "sub", "mul"):
            assert b.calls and outputs[-1] == b.answer
        else:
            assert not b.calls
        calls = [json.loads(m.content)["arguments"]["expression"] for m in b.messages if m.role == "tool_call"]
        assert [calculate(c) for c in calls] == outputs and len(calls) <= arithmetic


def test_prepare_chat_with_calculator_tasks_records_it(tmp_path, tiktoken_cache):
    from gptforge.chat.prepare import prepare_chat

    meta = prepare_chat([], "calc", {"tokenizer": "gpt2"}, 256, data_dir=str(tmp_path), recipes=["synthetic"],
                        synthetic_examples=200, synthetic_tools="calculator")  # fmt: skip
    assert meta["synthetic_tools"] == "calculator" and meta["sources"] == {"synthetic": 200}
    r = run_cli("prepare", "chat", "--include=chitchat", "--synthetic_tools=calculator", "--name=x", cwd=tmp_path)
    assert r.returncode == 2 and "--include synthetic" in r.stderr, r.stderr


def test_the_convert_kind_offers_its_function_and_checks_out(tok):
    from gptforge.chat.synthetic import generate
    from gptforge.chat.tools import EXAMPLE_FUNCTIONS, convert_length

    examples = generate(50, 2, "held_out", kinds=["convert"])
    schema = EXAMPLE_FUNCTIONS["convert_length"][0]
    for e in examples:
        assert e.calls and e.tools == [schema]
        call = json.loads(e.messages[1].content)["arguments"]
        value, unit, to = call["value"], call["from"], call["to"]
        expected = (
            value
            * {"mm": 1, "cm": 10, "m": 1000, "km": 1_000_000}[unit]
            / {"mm": 1, "cm": 10, "m": 1000, "km": 1_000_000}[to]
        )
        assert abs(float(e.messages[2].content) - expected) <= 1e-9 * max(1.0, expected)  # a float64 reference
        assert e.answer == f"{e.messages[2].content} {to}"
        ids = render_prompt(e.conversation(), tok, IDS)
        assert tok.decode(ids[2 : 2 + len(tok.encode(tools_text([schema])))]) == tools_text([schema])
    assert convert_length(True, "m", "cm").startswith("error:") and convert_length(3, "m", "yd").startswith("error:")

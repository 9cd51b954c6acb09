"""Function calling end to end, measured: held-out `convert` questions (chat/synthetic.py: a length to convert with
the made-up function convert_length) asked through `gptforge serve` with the official `openai` client, as an
application would: the request offers the function in `tools`; the model must answer with a tool call; the script
runs the function on the call's arguments, sends the result back as a `tool` message, and scores the final answer
(exact match, as `gptforge eval chat` scores). Not a test: its figures go to docs/RECIPES.md.

    python scripts/function_calling_roundtrip.py --out_dir out-chat-sft [--examples 200] [--seed 7] [--stream]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # chat_tools: the tests' own helpers
from chat_tools import Server  # noqa: E402
from gptforge.chat.synthetic import generate, score  # noqa: E402
from gptforge.chat.tools import EXAMPLE_FUNCTIONS  # noqa: E402


def ask(client, messages, tools, stream):
    """(content, tool calls as [(id, name, arguments text)], finish reason) of one request, streamed or not."""
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        tools=tools,
        temperature=0,
        max_tokens=128,
        stream=stream,
    )
    if not stream:
        choice = reply.choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in reply:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, ["", "", ""])
            entry[0] = piece.id or entry[0]
            entry[1] += (piece.function.name or "") if piece.function else ""
            entry[2] += (piece.function.arguments or "") if piece.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(v) for _, v in sorted(calls.items())], finish


def round_trip(client, example, stream) -> dict:
    tools = [{"type": "function", "function": schema} for schema in example.tools]
    messages = [{"role": m.role, "content": m.content} for m in example.prompt]
    _, calls, finish = ask(client, messages, tools, stream)
    out = {"called": finish == "tool_calls" and bool(calls), "valid": False, "right": False}
    if not out["called"]:
        return out
    call_id, name, arguments = calls[0]
    try:
        parsed = json.loads(arguments)
        out["valid"] = name in EXAMPLE_FUNCTIONS and isinstance(parsed, dict)
    except ValueError:
        parsed = None
    result = EXAMPLE_FUNCTIONS[name][1](parsed) if out["valid"] else "error: arguments are not a JSON object"
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
    }
    messages += [assistant, {"role": "tool", "tool_call_id": call_id, "content": result}]
    content, _, _ = ask(client, messages, tools, stream)
    out["right"] = score(example, content or "")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--stream", action="store_true", help="stream both requests (delta.tool_calls)")
    args = parser.parse_args()
    import openai

    server = Server(f"--out_dir={args.out_dir}", env={})
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        problems = generate(args.examples, args.seed, "held_out", kinds=["convert"])
        start, rows = time.monotonic(), []
        for i, example in enumerate(problems, 1):
            rows.append(round_trip(client, example, args.stream))
            if i % 20 == 0:
                print(f"{i}/{len(problems)} ({time.monotonic() - start:.0f} s)", file=sys.stderr)
    finally:
        server.stop()
    n = len(rows)
    for key, what in (
        ("called", "answered with a tool call"),
        ("valid", "arguments valid JSON for the function"),
        ("right", "final answer exact match"),
    ):
        p = sum(r[key] for r in rows) / n
        print(f"{what:<40} {p:.3f} ± {math.sqrt(p * (1 - p) / n):.3f} ({n} held-out questions)")


if __name__ == "__main__":
    main()

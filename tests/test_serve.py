"""`gptforge serve` through the official `openai` client and raw HTTP, on loopback: the answers equal `gptforge chat
-p`'s (greedy), streamed or not; concurrent requests share model steps and each gets its solo answer; malformed
requests, and parameters gptforge does not apply (response_format, logit_bias, ...), get OpenAI-shaped 4xx errors;
a client that leaves frees its row; Ctrl-C drains. Function calling: tests/test_serve_tools.py."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import time
from urllib.parse import urlparse

import pytest

from chat_tools import MEMORISED, ONE_THREAD, SYSTEM, Server, base_run, chat_run, tiny_model, write_run
from conftest import TIKTOKEN_CACHE, need_shared, popen_cli, run_cli

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")
KEY = "sk-test-key"
SYSTEM_TOKENS = [1639, 389, 1059, 325, 13]  # "You are terse." in GPT-2 BPE


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    need_shared(TIKTOKEN_CACHE)
    folder = chat_run(tmp_path_factory.mktemp("chat") / "run")
    server = Server(f"--out_dir={folder}", f"--api_key={KEY}", "--name=tiny-chat")
    server.folder = folder
    yield server
    assert server.stop() == 0, "".join(server.log)


@pytest.fixture(scope="module")
def base_server(tmp_path_factory):
    """A random base model with a long context: its answers run to max_tokens."""
    need_shared(TIKTOKEN_CACHE)
    folder = write_run(
        tmp_path_factory.mktemp("base") / "run", tiny_model(block_size=1024, seed=2), {"tokenizer": "gpt2"}, chat=False
    )
    server = Server(f"--out_dir={folder}", "--max_batch=8")
    server.folder = folder
    yield server
    server.stop()


def client(server, key=KEY):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def chat_p(folder, text, *more):
    r = run_cli("chat", f"--out_dir={folder}", "--device=cpu", "--temperature=0", "-p", text, *more, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    return r.stdout.removesuffix("\n")


@pytest.mark.parametrize("system", [None, SYSTEM])
def test_chat_completions_equal_chat_p_streamed_or_not(chat_server, system):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hi"}]
    c = client(chat_server)
    r = c.chat.completions.create(model="tiny-chat", messages=messages, temperature=0, max_tokens=60)
    assert r.choices[0].message.content == MEMORISED["hi"] and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 5 + (2 + len(SYSTEM_TOKENS) if system else 0)  # bos, user turn, answer start
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = c.chat.completions.create(
        model="tiny-chat",
        messages=messages,
        temperature=0,
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    more = ("--system", system) if system else ()
    assert chat_p(chat_server.folder, "hi", "--max_new_tokens=60", *more) == r.choices[0].message.content


def test_completions_equal_chat_p_on_a_base_model(base_server):
    c = client(base_server)
    r = c.completions.create(model="run", prompt="Once upon a time", temperature=0, max_tokens=30)
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="run", prompt="Once upon a time", temperature=0, max_tokens=30, stream=True
        )
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 30
    assert streamed == r.choices[0].text == chat_p(base_server.folder, "Once upon a time", "--max_new_tokens=30")
    seeded = [
        c.completions.create(model="run", prompt="x", max_tokens=10, seed=5, temperature=1.0).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_echo_and_logprobs_give_every_prompt_tokens_log_probability(chat_server):
    c = client(chat_server)
    r = c.completions.create(
        model="tiny-chat", prompt=[15496, 995, 0], max_tokens=1, temperature=0, logprobs=2, echo=True
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("Hello world!") and len(lp.tokens) == 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # greedy: the chosen one is the top one


def test_concurrent_requests_share_model_steps_and_each_gets_its_solo_answer(base_server):
    c = client(base_server)
    prompts = [f"prompt number {i} " * (i + 1) for i in range(6)]

    def ask(prompt):
        return c.completions.create(model="run", prompt=prompt, temperature=0, max_tokens=40).choices[0].text

    solo = [ask(p) for p in prompts]
    before = base_server.health()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, prompts))
    after = base_server.health()
    steps, tokens = after["steps"] - before["steps"], after["step_tokens"] - before["step_tokens"]
    assert tokens == 6 * 39  # the first token of each comes from its prefill
    assert steps < tokens / 2, (steps, tokens)  # rows shared steps
    assert after["max_rows"] >= 3 and after["rows"] == 0
    assert together == solo


def test_n_choices_and_prompt_lists(base_server):
    c = client(base_server)
    r = c.completions.create(model="run", prompt=["a b", "c d"], n=2, max_tokens=5, seed=1, temperature=1.0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 20
    alone = c.completions.create(model="run", prompt="c d", n=2, max_tokens=5, seed=1, temperature=1.0)
    assert [ch.text for ch in r.choices[2:]] == [ch.text for ch in alone.choices]


def raw(server, method, path, body=b"", headers=None):
    """(status, parsed JSON) of a request sent over a plain socket connection."""
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    except (BrokenPipeError, ConnectionResetError):
        return None, None
    finally:
        conn.close()


CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
MALFORMED = [
    ("bad JSON", b'{"model": "tiny-chat", "messages": [', {}, 400, "invalid_json"),
    ("unknown model", json.dumps({**CHAT, "model": "gpt-4"}).encode(), {}, 404, "model_not_found"),
    ("max_tokens 10^9", json.dumps({**CHAT, "max_tokens": 10**9}).encode(), {}, 400, "invalid_value"),
    ("10 MB body", json.dumps({**CHAT, "pad": "x" * 10_000_000}).encode(), {}, 413, "request_too_large"),
    ("wrong key", json.dumps(CHAT).encode(), {"Authorization": "Bearer nope"}, 401, "invalid_api_key"),
    ("no messages", json.dumps({"model": "tiny-chat", "messages": []}).encode(), {}, 400, "invalid_value"),
    (
        "too many messages",
        json.dumps({**CHAT, "messages": CHAT["messages"] * 300}).encode(),
        {},
        400,
        "too_many_messages",
    ),
    ("temperature as text", json.dumps({**CHAT, "temperature": "hot"}).encode(), {}, 400, "invalid_type"),
    (
        "unknown role",
        json.dumps({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
        {},
        400,
        "invalid_value",
    ),
    ("not an object", b"[1, 2]", {}, 400, "invalid_body"),
]


@pytest.mark.parametrize("name,body,headers,status,code", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests_get_openai_shaped_4xx(chat_server, name, body, headers, status, code):
    got, answer = raw(
        chat_server, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **headers}
    )
    assert got == status, (got, answer)
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["code"] == code and answer["error"]["message"]
    assert chat_server.health()["rows"] == 0


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
UNAPPLIED = [  # (route, parameters that change a correct answer and are not applied, the param named)
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"response_format": SCHEMA}, "response_format"),
    ("chat", {"functions": [TOOL["function"]]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("chat", {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"min_p": 0.1}, "min_p"),
    ("chat", {"guided_json": {"type": "object"}}, "guided_json"),
    ("text", {"response_format": {"type": "json_object"}}, "response_format"),
    ("text", {"suffix": " the end."}, "suffix"),
    ("text", {"best_of": 3}, "best_of"),
    ("text", {"logit_bias": {"13": 5}}, "logit_bias"),
    ("text", {"stop_token_ids": [13]}, "stop_token_ids"),
]
ROUTES = {
    "chat": ("/v1/chat/completions", CHAT),
    "text": ("/v1/completions", {"model": "tiny-chat", "prompt": "Hello", "max_tokens": 3}),
}


@pytest.mark.parametrize("route,extra,param", UNAPPLIED, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(UNAPPLIED)])
def test_parameters_gptforge_does_not_apply_are_refused_naming_them(chat_server, route, extra, param):
    path, body = ROUTES[route]
    status, answer = raw(chat_server, "POST", path, json.dumps({**body, **extra}).encode())
    assert status == 400, (status, answer)
    error = answer["error"]
    assert (error["param"], error["code"], error["type"]) == (param, "unsupported_parameter", "invalid_request_error")
    assert error["message"].startswith(f"'{param}' is not supported: gptforge ")
    if param == "response_format":
        assert "does not constrain output to JSON" in error["message"]
    assert chat_server.health()["status"] == "ok" and chat_server.health()["rows"] == 0


def test_top_logprobs_without_logprobs_is_refused(chat_server):
    status, answer = raw(chat_server, "POST", "/v1/chat/completions", json.dumps({**CHAT, "top_logprobs": 2}).encode())
    assert status == 400 and answer["error"]["param"] == "top_logprobs", answer


def test_what_asks_for_nothing_or_does_not_change_the_answer_is_accepted(chat_server):
    """Plain text, no tools, an empty bias, best_of 1 (what clients such as LangChain send by default) and the
    parameters that do not change an answer: the answer is the one asked for without them."""
    c = client(chat_server)
    harmless = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "logit_bias": {}, "min_p": 0}
    harmless |= {"modalities": ["text"], "web_search_options": None, "user": "u-1", "metadata": {"team": "x"}}
    harmless |= {"store": False, "service_tier": "auto", "parallel_tool_calls": False, "reasoning_effort": "low"}
    ask = dict(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=60)
    r = c.chat.completions.create(**ask, extra_body=harmless)
    assert r.choices[0].message.content == MEMORISED["hi"]
    plain = dict(model="tiny-chat", prompt=[15496, 995, 0], max_tokens=4, temperature=0, logprobs=1, echo=True, seed=3)
    nothing = {"best_of": 1, "suffix": None, "logit_bias": {}, "user": "u-1", "stop_token_ids": []}
    with_nothing = c.completions.create(**plain, extra_body=nothing)
    assert with_nothing.choices[0].text == c.completions.create(**plain).choices[0].text


def test_the_official_client_gets_response_format_refused_as_a_bad_request(chat_server):
    with pytest.raises(openai.BadRequestError, match="does not constrain output to JSON") as caught:
        client(chat_server).chat.completions.create(
            model="tiny-chat", messages=CHAT["messages"], response_format={"type": "json_object"}
        )
    assert caught.value.status_code == 400 and caught.value.body["param"] == "response_format"
    assert [m.id for m in client(chat_server).models.list()] == ["tiny-chat"]  # the server goes on


def test_the_official_client_raises_its_own_errors(chat_server):
    with pytest.raises(openai.AuthenticationError):
        client(chat_server, key="wrong").models.list()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(chat_server).chat.completions.create(model="nope", messages=CHAT["messages"])
    with pytest.raises(openai.BadRequestError, match="context"):
        client(chat_server).completions.create(model="tiny-chat", prompt="word " * 200)
    assert [m.id for m in client(chat_server).models.list()] == ["tiny-chat"]


def test_health_and_page_need_no_key_but_the_api_does_and_only_loopback_hosts_are_answered(chat_server):
    assert requests.get(f"{chat_server.url}/health", timeout=10).json()["status"] == "ok"
    page = requests.get(f"{chat_server.url}/", timeout=10)
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    assert requests.get(f"{chat_server.url}/v1/models", timeout=10).status_code == 401
    status, answer = raw(chat_server, "GET", "/v1/models", headers={"Host": "evil.example:80"})
    assert status == 403 and answer["error"]["code"] == "forbidden_host"
    assert raw(chat_server, "GET", "/nowhere")[1]["error"]["code"] == "not_found"


def wait_rows_free(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = server.health()
        if health["rows"] == 0 and health["waiting"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"rows still busy: {server.health()}")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_row(base_server, stream):
    before = base_server.health()
    url = urlparse(base_server.url)
    sock = socket.create_connection((url.hostname, url.port))
    body = json.dumps({"model": "run", "prompt": "go", "max_tokens": 1000, "stream": stream, "temperature": 1.0})
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    if stream:
        received = b""
        while b"data:" not in received:  # the stream is flowing
            received += sock.recv(4096)
    else:
        deadline = time.monotonic() + 10
        while base_server.health()["rows"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    sock.close()
    after = wait_rows_free(base_server)
    assert after["step_tokens"] - before["step_tokens"] < 900  # stopped long before its 1000 tokens


def test_ctrl_c_drains_the_requests_in_flight_then_exits(tmp_path):
    need_shared(TIKTOKEN_CACHE)
    folder = base_run(tmp_path / "run", block_size=512)
    server = Server(f"--out_dir={folder}")
    c = client(server)
    stream = c.completions.create(model="run", prompt="go", max_tokens=200, stream=True, temperature=1.0)
    first = next(iter(stream))
    server.proc.send_signal(signal.SIGINT)
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "length"
    assert sum(1 for ch in [first, *rest] if ch.choices[0].text) >= 150  # every token arrived
    assert server.proc.wait(60) == 0
    assert "stopped after 1 request" in "".join(server.log)
    with pytest.raises(openai.APIConnectionError):
        c.models.list()
    assert not os.path.exists(folder / "serve.lock")


def test_ctrl_c_while_the_decode_step_compiles_stops_the_server(tmp_path):
    """torch.compile's tracing can swallow a KeyboardInterrupt; Ctrl-C during the start-up compile must still stop
    `serve` (before decode.ctrl_c_kept it went on to serve, every time)."""
    from gptforge.infer.decode import compiler_missing

    if compiler_missing("cpu"):
        pytest.skip("no C++ compiler")
    need_shared(TIKTOKEN_CACHE)
    folder = base_run(tmp_path / "run")
    proc = popen_cli("serve", "--port=0", "--device=cpu", "--compile=on", f"--out_dir={folder}", env=ONE_THREAD)
    log = []
    for line in proc.stderr:
        log.append(line)
        if "decode: compiling the one-token step" in line:
            time.sleep(0.5)  # inside the compile (seconds long); at 0.5 s the interrupt was lost 3 times of 3
            proc.send_signal(signal.SIGINT)
            break
    try:
        log += proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"serve went on after Ctrl-C: {''.join(log)}") from None
    text = "".join(log)
    assert proc.returncode == 130, text
    assert "gptforge: interrupted" in text and "serving on" not in text, text


def test_a_compiled_server_answers_as_chat_p_does_alone_and_together(chat_server):
    """--compile=on (the one-token step compiled, rows read over the whole cache): the memorised chat model's greedy
    answers equal `chat -p`'s, eager and compiled, alone and with every question asked at once."""
    from gptforge.infer.decode import compiler_missing

    if compiler_missing("cpu"):
        pytest.skip("no C++ compiler")
    server = Server(f"--out_dir={chat_server.folder}", "--name=tiny-chat", "--compile=on")
    try:
        assert "decode: compiling the one-token step" in "".join(server.log)
        c = client(server, key="unused")

        def ask(text):
            messages = [{"role": "user", "content": text}]
            r = c.chat.completions.create(model="tiny-chat", messages=messages, temperature=0, max_tokens=60)
            return r.choices[0].message.content

        questions = list(MEMORISED)
        alone = [ask(q) for q in questions]
        with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
            together = list(pool.map(ask, questions))
        assert alone == together == list(MEMORISED.values())
        assert chat_p(chat_server.folder, "hi", "--max_new_tokens=60", "--compile=on") == MEMORISED["hi"]
    finally:
        assert server.stop() == 0, "".join(server.log)

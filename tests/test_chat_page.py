"""The chat page `gptforge serve` serves at /, in real Chromium (playwright; skips without it, fails with
GPTFORGE_REQUIRE_BROWSER=1): send and stream, markdown drawn safely (a model answer holding <script> is text),
reload keeps the conversation, edit a message and regenerate, new conversation, system prompt, stop mid-answer."""

from __future__ import annotations

import json
import time

import pytest

from chat_tools import MEMORISED, SYSTEM, Server, chat_run, tiny_model, write_run
from conftest import TIKTOKEN_CACHE, need_shared
from test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, need_browser

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def browser():
    sync_playwright = need_browser()
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    """A fresh page (its own localStorage); no script or console error may happen on it, and no dialog open."""
    context = browser.new_context(viewport={"width": 1200, "height": 850})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
    yield page
    context.close()
    assert not problems, problems


@pytest.fixture(scope="module")
def memorised(tmp_path_factory):
    need_shared(TIKTOKEN_CACHE)
    server = Server(f"--out_dir={chat_run(tmp_path_factory.mktemp('chat') / 'run')}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """An untrained chat model large enough that a 1,000-token answer takes seconds (~5 s on one thread; at 2
    layers of 32 it took 1.4 s, and under a loaded CI machine the page could draw its first 20 characters after the
    answer had ended): time to press Stop."""
    need_shared(TIKTOKEN_CACHE)
    model = tiny_model(block_size=1024, seed=3, n_layer=4, n_embd=256)
    folder = write_run(tmp_path_factory.mktemp("slow") / "run", model, {"tokenizer": "gpt2"}, chat=True)
    server = Server(f"--out_dir={folder}")
    yield server
    server.stop()


def answers(page) -> list[str]:
    return page.locator(".message.assistant .body").all_inner_texts()


def set_setting(page, name: str, value) -> None:
    page.evaluate(
        "([id, v]) => { const e = document.getElementById(id); e.value = v; "
        "e.dispatchEvent(new Event(id === 'max_tokens' ? 'change' : 'input')); }",
        [name, str(value)],
    )


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_idle(page) -> None:
    page.wait_for_selector("#send:not([hidden])", timeout=30_000)


def test_send_streams_markdown_safely_and_reload_keeps_it(page, memorised):
    page.goto(memorised.url)
    page.wait_for_selector("#model:has-text('context')")
    set_setting(page, "temperature", 0)
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.method == "POST" else None)
    send(page, "hi")
    wait_idle(page)
    text = answers(page)[0]
    assert "<script>alert(1)</script>" in text and text.startswith("Hello! I am a tiny model.")
    assert page.locator("#messages script").count() == 0  # the tag is text, not an element
    assert page.locator("#messages strong").inner_text() == "bold"
    assert page.locator("#messages code").inner_text() == "code"
    assert bodies[-1]["stream"] is True and bodies[-1]["temperature"] == 0
    page.reload()
    page.wait_for_selector(".message.assistant")
    assert page.locator(".message.user .body").inner_text() == "hi"
    assert answers(page) == [text]


def test_edit_and_regenerate_then_a_new_conversation_with_a_system_prompt(page, memorised):
    page.goto(memorised.url)
    page.wait_for_selector("#model:has-text('context')")
    set_setting(page, "temperature", 0)
    send(page, "tell me a story")
    wait_idle(page)
    assert answers(page) == [MEMORISED["tell me a story"]]
    page.click(".message.user .edit")
    page.fill(".edit-box", "what is 2+3?")
    page.click(".save-edit")
    wait_idle(page)
    assert answers(page) == [MEMORISED["what is 2+3?"]]
    assert page.locator(".message.user .body").inner_text() == "what is 2+3?"
    page.click("#regenerate")
    wait_idle(page)
    assert answers(page) == [MEMORISED["what is 2+3?"]] and page.locator(".message").count() == 2
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.method == "POST" else None)
    page.click("#new-chat")
    assert page.locator(".message").count() == 0 and page.locator("#conversations li").count() == 2
    page.fill("#system", SYSTEM)
    send(page, "hi")
    wait_idle(page)
    assert bodies[-1]["messages"][0] == {"role": "system", "content": SYSTEM}
    assert answers(page) == [MEMORISED["hi"].replace("**", "").replace("`", "")]  # as drawn: bold, code
    page.reload()
    page.wait_for_selector(".message.assistant")
    assert page.locator("#conversations li").count() == 2 and page.input_value("#system") == SYSTEM
    page.click("#conversations li:nth-child(2) button.open")  # the first conversation is still there
    assert answers(page) == [MEMORISED["what is 2+3?"]]


def test_stop_keeps_the_partial_answer_and_frees_the_servers_row(page, slow):
    page.goto(slow.url)
    page.wait_for_selector("#model:has-text('context')")
    set_setting(page, "max_tokens", 1000)
    send(page, "write forever")
    deadline = time.monotonic() + 30  # polled from here: the page's CSP forbids the eval wait_for_function uses
    while len(page.locator(".message.assistant .body").inner_text()) <= 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    drawn = page.locator(".message.assistant .body").inner_text()
    assert page.is_visible("#stop"), f"the answer ended before Stop could be pressed ({len(drawn)} characters drawn)"
    page.click("#stop")
    wait_idle(page)
    partial = answers(page)[0]
    assert len(partial) > 20 and page.locator(".message.assistant .note").inner_text() == "stopped"
    deadline = time.monotonic() + 10
    while slow.health()["rows"] and time.monotonic() < deadline:
        time.sleep(0.05)
    health = slow.health()
    assert health["rows"] == 0 and health["step_tokens"] < 900, health
    page.reload()
    page.wait_for_selector(".message.assistant .note")
    assert answers(page) == [partial]

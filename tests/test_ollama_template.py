"""The Ollama Modelfile's TEMPLATE beside a chat GGUF (weights/gguf_vocab.py modelfile) run by Go's text/template,
the engine Ollama reads it with (tests/ollama_template/main.go, built here with Debian's `go`): on plain
conversations the prompt it writes tokenizes to the ids gptforge's renderer gives the model. Ollama itself does not
install from the registries this project can reach, so its template engine is what is checked."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from chat_tools import gpt2_chat_hf_tokenizer
from gptforge.chat.render import chat_special_ids, render_prompt
from gptforge.tokenizer.gpt2 import GPT2Tokenizer
from gptforge.weights.gguf_vocab import gguf_vocab, modelfile

HERE = Path(__file__).parent / "ollama_template"


@pytest.fixture(scope="module")
def ollama_template(tmp_path_factory) -> Path:
    if shutil.which("go") is None:
        if os.environ.get("GPTFORGE_REQUIRE_GO"):
            pytest.fail("Go is needed to check the Ollama template: `make golang` installs Debian's golang-go")
        pytest.skip("no Go toolchain (make golang installs it)")
    out = tmp_path_factory.mktemp("go") / "ollama_template"
    subprocess.run(["go", "build", "-o", str(out), "."], cwd=HERE, check=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    return gpt2_chat_hf_tokenizer(tmp_path_factory.mktemp("gpt2-chat"))


def conversations(n: int, seed: int) -> list[list[dict]]:
    """Plain chats ending with the user's turn: an optional system message, then user and assistant in turn, their
    text drawn from words, digits, punctuation, newlines, runs of spaces, accents and emoji."""
    rng = random.Random(seed)
    pieces = ["hello", "What is", "12+30", "?", "\n", "  ", "naïve", "café", "🙂", "<b>", '"quoted"', "{{ x }}"]
    text = lambda: "".join(rng.choice(pieces) + rng.choice(["", " "]) for _ in range(rng.randint(1, 8)))  # noqa: E731
    out = []
    for _ in range(n):
        chat = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(0, 3)):
            chat += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        out.append([*chat, {"role": "user", "content": text()}])
    return out


def test_ollamas_template_engine_gives_the_renderers_prompt(ollama_template, hf_tokenizer):
    tok = GPT2Tokenizer()
    ids = chat_special_ids(tok)
    written = modelfile("chat.gguf", gguf_vocab(tok, ids, 50267), chat=True, context=256)
    (template,) = re.findall(r'^TEMPLATE """(.*?)"""$', written, flags=re.M | re.S)
    for n, messages in enumerate(conversations(40, seed=3)):
        run = subprocess.run(
            [str(ollama_template)], input=json.dumps({"template": template, "messages": messages}),
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        got = hf_tokenizer(run.stdout, add_special_tokens=False)["input_ids"]
        assert got == render_prompt(messages, tok, ids), f"conversation {n}: {messages}\n{run.stdout!r}"


def test_the_modelfile_names_its_file_stop_and_context():
    tok = GPT2Tokenizer()
    written = modelfile("chat.gguf", gguf_vocab(tok, chat_special_ids(tok), 50267), chat=True, context=256)
    lines = [x for x in written.splitlines() if x and not x.startswith("#")]
    assert lines[0] == "FROM ./chat.gguf" and lines[1].startswith('TEMPLATE """<|endoftext|>')
    assert lines[2:] == ['PARAMETER stop "<|assistant_end|>"', "PARAMETER num_ctx 256"]

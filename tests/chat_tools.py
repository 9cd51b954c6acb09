"""Tiny models to talk to in the chat and serve tests: a random model, or one that has memorised a few answers
(a few hundred steps on its own conversations, a couple of seconds), written as a run folder that `--out_dir`
reads. Tests assert the protocol and equality between routes, never quality."""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import popen_cli
from gptforge.chat.render import chat_special_ids, render
from gptforge.core.shape import MODEL_ARGS
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokenizer.spec import from_spec

MEMORISED = {
    "hi": "Hello! I am a tiny model. <script>alert(1)</script> **bold** and `code`.",
    "what is 2+3?": "5",
    "tell me a story": "Once upon a time there was a small model that knew three answers. The end.",
}
SYSTEM = "You are terse."


def tiny_model(
    vocab_size: int = 50304, block_size: int = 128, seed: int = 0, n_layer: int = 2, n_embd: int = 32, **switches
) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(
        block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=2, n_embd=n_embd, **switches
    )
    return GPT(config).eval()


def write_run(folder: Path, model: GPT, tokenizer_spec: dict, chat: bool) -> Path:
    os.makedirs(folder, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "model_args": {k: getattr(model.config, k) for k in MODEL_ARGS},
        "config": {"task": "sft" if chat else "pretrain", "block_size": model.config.block_size},
        "tokenizer": tokenizer_spec,
        "iter_num": 0,
    }
    torch.save(state, folder / "ckpt.pt")
    return folder


def memorise(
    model: GPT, rows: list[tuple[list[int], list[int]]], steps: int = 300, lr: float = 1e-2, margin: float = 5.0
) -> GPT:
    """Train on (ids, mask) rows until the model repeats them: targets outside the mask are not scored. Stops once
    every scored target's logit leads the runner-up by `margin` (checked every 10 steps; at most `steps` steps): a
    lead that float rounding (a batch of rows against one row, a cache against none) cannot overturn."""
    width = max(len(ids) for ids, _ in rows)
    x = torch.zeros(len(rows), width - 1, dtype=torch.long)
    y = torch.full((len(rows), width - 1), -1, dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        x[i, : len(ids) - 1] = torch.tensor(ids[:-1])
        y[i, : len(ids) - 1] = torch.tensor([t if m else -1 for t, m in zip(ids[1:], mask[1:], strict=True)])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    scored = y != -1
    for step in range(steps):
        logits = model.logits(model.hidden_states(x)[scored])  # only where a target is scored: the head is costly
        if step % 10 == 0 and _leads_by(logits.detach(), y[scored], margin):
            break
        loss = torch.nn.functional.cross_entropy(logits, y[scored])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def _leads_by(logits: torch.Tensor, targets: torch.Tensor, margin: float) -> bool:
    """Whether each row's target logit exceeds every other logit of its row by at least `margin`."""
    target = logits.gather(1, targets[:, None])
    others = logits.scatter(1, targets[:, None], float("-inf"))
    return bool((target[:, 0] - others.max(dim=1).values >= margin).all())


def chat_run(folder: Path, block_size: int = 128, steps: int = 150) -> Path:
    """A GPT-2 BPE chat model that answers MEMORISED's questions (with or without SYSTEM) and ends its answers.
    Trained once per version of this file and kept in the temporary folder; copied to `folder`."""
    cached = Path(tempfile.gettempdir()) / f"gptforge-chat-model-{_fingerprint(block_size, steps)}" / "ckpt.pt"
    if not cached.exists():  # trained under a temporary name, renamed: tests in parallel never read half a file
        scratch = _train_chat(cached.parent / f".{os.getpid()}", block_size, steps)
        os.replace(scratch / "ckpt.pt", cached)
    os.makedirs(folder, exist_ok=True)
    shutil.copyfile(cached, folder / "ckpt.pt")
    return folder


def _fingerprint(*values) -> str:
    code = "".join(inspect.getsource(f) for f in (tiny_model, write_run, memorise, _leads_by, _train_chat))
    text = code + repr((MEMORISED, SYSTEM, values)) + torch.__version__
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _train_chat(folder: Path, block_size: int, steps: int) -> Path:
    tok = from_spec({"tokenizer": "gpt2"})
    ids = chat_special_ids(tok)
    rows = []
    for question, answer in MEMORISED.items():
        for system in ([], [{"role": "system", "content": SYSTEM}]):
            messages = [*system, {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            rows.append(render(messages, tok, ids))
    return write_run(folder, memorise(tiny_model(block_size=block_size), rows, steps), tok.spec(), chat=True)


def base_run(folder: Path, block_size: int = 64, tokenizer: dict | None = None, vocab_size: int = 50304) -> Path:
    """A random base model (not chat-tuned)."""
    spec = tokenizer or {"tokenizer": "gpt2"}
    return write_run(folder, tiny_model(vocab_size, block_size), spec, chat=False)


def gpt2_chat_hf_tokenizer(folder: Path):
    """GPT-2's tokenizer saved as a Hugging Face folder with the chat tokens and template added, loaded back by
    AutoTokenizer (the tokenizer `gptforge export` gives a GPT-2 chat model)."""
    transformers = pytest.importorskip("transformers")
    from gptforge.chat.template import add_chat_tokens_to_hf_folder
    from gptforge.tokenizer.gpt2 import GPT2Tokenizer

    GPT2Tokenizer().save(str(folder))
    add_chat_tokens_to_hf_folder(str(folder))
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and far faster than on two when other work keeps the cores busy
    (an OpenMP barrier then waits for a descheduled thread: a 50k-way multinomial took 45 ms instead of 3.5)."""
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # configure_backends (which loading a model calls) leaves it then
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS")
    else:
        os.environ["OMP_NUM_THREADS"] = env


ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the same for the CLI in a subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`gptforge serve ARGS --port 0` in a process of its own (conftest.popen_cli), on one thread unless `env` says
    otherwise, decoding eagerly (as `chat -p` does) unless ARGS give --compile; `url` once it listens, its stderr
    kept in `log`."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 120):
        args = tuple(map(str, args))
        eager = () if any(a.startswith("--compile") for a in args) else ("--compile=off",)
        self.proc = popen_cli(
            "serve", "--port=0", "--device=cpu", *eager, *args, env=ONE_THREAD if env is None else env
        )
        self.log: list[str] = []
        deadline, self.url = time.monotonic() + timeout, None
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"serve did not start: {''.join(self.log)}")
            self.log.append(line)
            found = re.search(r"serving on (http://\S+)", line)
            self.url = found.group(1) if found else None
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def health(self) -> dict:
        import requests

        return requests.get(f"{self.url}/health", timeout=10).json()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

"""`gptforge chat` in a real terminal (a pty): a conversation, /system, /temperature, Ctrl-C mid-answer (the answer
stops, the program goes on), /save then /load, /quit; and its mistakes (exit 2, the flag named)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from chat_tools import MEMORISED, ONE_THREAD, SYSTEM, base_run, chat_run, tiny_model, write_run
from conftest import TIKTOKEN_CACHE, need_shared, run_cli


class Terminal:
    """A command on a pseudo-terminal: `expect(regex)` reads until the output matches, `send(text)` types."""

    def __init__(self, *args: str, sigint: signal.Handlers = signal.SIG_DFL):
        env = {**os.environ, **ONE_THREAD, "TERM": "dumb"}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, with the pty as its terminal
            signal.signal(signal.SIGINT, sigint)  # what the command inherits (SIG_IGN: a background job's)
            os.execvpe(sys.executable, [sys.executable, "-m", "gptforge", *args], env)
        self.output, self.seen = "", 0

    def expect(self, pattern: str, timeout: float = 90) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            found = re.compile(pattern).search(self.output, self.seen)
            if found:
                self.seen = found.end()
                return found
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {pattern!r} in:\n{self.output[-3000:]}")
            try:
                data = os.read(self.fd, 4096)
            except OSError:  # the child closed the terminal
                data = b""
            if not data:
                raise AssertionError(f"the program ended before {pattern!r}:\n{self.output[-3000:]}")
            self.output += data.decode("utf-8", errors="replace").replace("\r\n", "\n")

    def signal_state(self) -> str:
        """The program's signal masks and what it waits in (for a failure message)."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text().splitlines()
            wchan = Path(f"/proc/{self.pid}/wchan").read_text()
        except OSError as e:
            return f"(no /proc state: {e})"
        return " ".join(line for line in status if line.startswith("Sig")) + f" wchan={wchan}"

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait_for_a_key(self, timeout: float = 15) -> None:
        """Until the program sleeps in a read or a wait on its terminal (its prompt's), so that a key pressed next
        lands there rather than before the prompt reads (on a busy machine, that one is seen at the next key only).
        Returns early where /proc does not say (another OS, no permission to read the program's system call)."""
        waits = {"0", "7", "23", "270", "271"}  # x86-64's read, poll, select, pselect6, ppoll
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                call = Path(f"/proc/{self.pid}/syscall").read_text().split()[0]
            except (OSError, IndexError):
                return
            if call in waits:
                return
            time.sleep(0.01)

    def wait(self, timeout: float = 60) -> int:
        status = self.exited(timeout)
        if status is None:
            os.kill(self.pid, signal.SIGKILL)
            raise AssertionError("the program did not exit")
        return status

    def exited(self, timeout: float) -> int | None:
        """The program's exit code once it has ended, or None if it is still running after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            with_output = select.select([self.fd], [], [], 0.1)[0]
            if with_output:
                try:
                    self.output += os.read(self.fd, 4096).decode("utf-8", errors="replace")
                except OSError:
                    pass
        return None


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    need_shared(TIKTOKEN_CACHE)
    return chat_run(tmp_path_factory.mktemp("chat") / "run")


def test_a_conversation_with_system_save_and_load(chat_folder, tmp_path):
    t = Terminal("chat", f"--out_dir={chat_folder}", "--device=cpu", "--temperature=0")
    t.expect(r"chat model; .* context 128 tokens")
    t.expect("you> ")
    t.send("hi\n")
    t.expect(re.escape("model> " + MEMORISED["hi"]) + "\n")
    t.expect("you> ")
    t.send(f"/system {SYSTEM}\n")
    t.expect(r"\[system message set")
    t.send("/system\n")
    t.expect(re.escape(f"system message: {SYSTEM!r}"))
    t.send("/clear\n")
    t.expect(r"\[new conversation\]")
    t.send("what is 2+3?\n")
    t.expect(r"model> 5\n")
    t.send("/temperature 0.5\n")
    t.expect(r"\[temperature = 0.5\]")
    t.send("/temperature hot\n")
    t.expect(r"error: /temperature hot: give a number")
    t.send(f"/save {tmp_path / 'c.jsonl'}\n")
    t.expect(r"\[saved 3 messages")
    saved = json.loads((tmp_path / "c.jsonl").read_text())["messages"]
    assert saved == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "what is 2+3?"},
        {"role": "assistant", "content": "5"},
    ]
    t.send("/clear\n/temperature 0\n")
    t.send(f"/load {tmp_path / 'c.jsonl'}\n")
    t.expect(r"\[loaded 3 messages")
    t.send("/load /nowhere.jsonl\n")
    t.expect(r"error: chat file '/nowhere.jsonl' not found")
    t.send("/bogus\n")
    t.expect(r"unknown command /bogus")
    t.send("/quit\n")
    assert t.wait() == 0


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["sigint-default", "sigint-ignored"])
def test_ctrl_c_stops_the_answer_not_the_program(tmp_path, inherited):
    """Also when the program inherits SIGINT ignored (started as a background job by a shell without job
    control): Ctrl-C at the prompt must still give the hint."""
    need_shared(TIKTOKEN_CACHE)
    folder = write_run(tmp_path / "slow", tiny_model(block_size=1024, seed=3), {"tokenizer": "gpt2"}, chat=True)
    t = Terminal("chat", f"--out_dir={folder}", "--device=cpu", "--max_new_tokens=1000", sigint=inherited)
    t.expect("you> ")
    t.send("talk forever\n")
    t.expect(r"model> \S+ \S+ \S+")  # the answer is streaming
    t.send("\x03")  # Ctrl-C, as the terminal sends it: SIGINT to the program
    t.expect(r"\[stopped; the answer so far is kept")
    t.expect("you> ")
    for _ in range(6):  # at the prompt: a hint, not an exit
        t.wait_for_a_key()
        t.send("\x03")  # (one that lands before readline waits for a key is seen at the next key: pressed again)
        with contextlib.suppress(AssertionError):
            t.expect(r"Ctrl-D leaves", timeout=15)
            break
    else:
        raise AssertionError(f"no hint after 6 Ctrl-C at the prompt:\n{t.output[-3000:]}\n{t.signal_state()}")
    for _ in range(3):  # a Ctrl-C pressed twice above and seen late costs one line (a hint instead): typed again
        t.send(f"/save {tmp_path / 'c.jsonl'}\n")
        with contextlib.suppress(AssertionError):
            t.expect(r"\[saved 2 messages", timeout=30)
            break
    else:
        raise AssertionError(f"/save did not answer:\n{t.output[-3000:]}")
    answer = json.loads((tmp_path / "c.jsonl").read_text())["messages"][1]["content"]
    assert 0 < len(answer.split()) and "stopped" not in answer
    for _ in range(3):  # Ctrl-D leaves (a Ctrl-C above seen this late takes the key for its hint: pressed again)
        t.send("\x04")
        status = t.exited(timeout=20)
        if status is not None:
            break
    else:
        os.kill(t.pid, signal.SIGKILL)
        raise AssertionError(f"the program did not exit after 3 Ctrl-D:\n{t.output[-3000:]}")
    assert status == 0


def test_mistakes_exit_2_naming_the_flag(tmp_path):
    need_shared(TIKTOKEN_CACHE)
    base = base_run(tmp_path / "base")
    r = run_cli("chat", f"--out_dir={base}", "--device=cpu", "--system=Be brief.", "-p", "hi", env=ONE_THREAD)
    assert r.returncode == 2 and "--system" in r.stderr and "base model" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("chat", f"--out_dir={tmp_path / 'none'}", "-p", "hi", env=ONE_THREAD)
    assert r.returncode == 2 and "ckpt.pt not found" in r.stderr
    r = run_cli("chat", f"--out_dir={base}", "--top_p=0", "-p", "hi", env=ONE_THREAD)
    assert r.returncode == 2 and "top_p" in r.stderr
    r = run_cli(
        "chat", f"--out_dir={base}", "--device=cpu", "--temperature=0", "--max_new_tokens=5", "-p", "Hi", env=ONE_THREAD
    )
    assert r.returncode == 0 and r.stdout.endswith("\n") and "completion mode" not in r.stdout

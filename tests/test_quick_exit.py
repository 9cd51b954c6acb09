"""The `gptforge` script ends without Python's teardown (core/quick_exit.py) and loses nothing on the way: the
command's exit status, everything it printed through a pipe, its atexit handlers, the threads Python waits for;
GPTFORGE_QUICK_EXIT=0 restores the normal exit. Each case is a real `python -m gptforge` process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import run_cli, tiny_train_args
from gptforge.core.quick_exit import SWITCH, exit_status

# A program that runs the real entry point after leaving behind what an exit must take care of: an atexit handler,
# a (non-daemon) thread still writing, a thread pool left open (`gptforge serve` leaves one: its idle workers wait
# for work until Python's exit tells them to stop) and an object whose finaliser only the interpreter's teardown
# runs.
PROGRAM = r"""
import atexit, sys, threading, time

out = sys.argv[1]

def late_line(text):
    with open(out, "a") as fh:
        fh.write(text + "\n")

atexit.register(late_line, "atexit ran")

def writer():
    time.sleep(0.5)
    late_line("thread finished")

threading.Thread(target=writer).start()

from concurrent.futures import ThreadPoolExecutor

pool = ThreadPoolExecutor(2)  # left open, as a server's pool is: its idle workers must be told to stop
pool.submit(time.sleep, 0.1)

class TornDown:
    def __init__(self):
        self.path, self.opener = out, open  # the module's globals may be gone by the time it runs

    def __del__(self):
        with self.opener(self.path, "a") as fh:
            fh.write("teardown ran\n")

kept = TornDown()  # a module global: only the teardown of the interpreter ends it
print("x" * 200_000)  # more than a pipe's buffer: must all arrive
sys.argv = ["gptforge", *sys.argv[2:]]
from gptforge.cli.main import entry
entry()
"""


def run_program(tmp_path, args, env_extra=None):
    out = tmp_path / "late.txt"
    env = {**os.environ, **(env_extra or {})}
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(out), *args], capture_output=True, text=True, env=env, timeout=60
    )
    return proc, (out.read_text().splitlines() if out.exists() else [])


@pytest.mark.parametrize("switch", ["", "0"])
def test_exit_keeps_status_output_atexit_and_threads(tmp_path, switch):
    proc, late = run_program(tmp_path, ["--help"], {SWITCH: switch})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("x" * 200_000 + "\n") and "usage: gptforge" in proc.stdout
    assert late[:2] == ["thread finished", "atexit ran"], late  # Python's order: threads, then atexit
    # the teardown is what the quick exit leaves out, and only that; switched off, it runs as before
    assert ("teardown ran" in late) == (switch == "0"), late


def test_user_error_keeps_status_2_and_its_message(tmp_path):
    proc, late = run_program(tmp_path, ["train", "--no_such_key=1"])
    assert proc.returncode == 2
    assert "gptforge: error: --no_such_key: unknown config key 'no_such_key'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert late == ["thread finished", "atexit ran"]


def test_a_training_run_ends_quickly_with_its_files_whole(tmp_path, char_data):
    """A real training run through the script: status 0, the checkpoint loads, the metrics log ends in its `end`
    record: nothing it wrote rested on the teardown."""
    out_dir = tmp_path / "out"
    proc = run_cli("train", *tiny_train_args(char_data, out_dir, max_iters=4, eval_interval=2))
    assert proc.returncode == 0, proc.stderr
    assert "step 4: done" in proc.stdout
    import torch

    ckpt = torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=False)
    assert ckpt["iter_num"] == 4
    last = (out_dir / "metrics.jsonl").read_text().splitlines()[-1]
    assert '"kind": "end"' in last, last


def test_exit_status_reads_sys_exit_codes(capsys):
    assert exit_status(None) == 0
    assert exit_status(2) == 2
    assert exit_status(130) == 130
    assert exit_status("stopped: disk full") == 1
    assert capsys.readouterr().err == "stopped: disk full\n"

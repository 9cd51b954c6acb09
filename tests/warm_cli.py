"""`python -m gptforge ARGS` without paying for the interpreter's start each time: the runner behind conftest.run_cli.

Most of a test's CLI run is the new interpreter importing torch (about 2 of its 2.5 seconds on the 2-core
machines), not the command. This module keeps one process (the *warm* process) that has imported torch, numpy
and gptforge's CLI module, and nothing else: no torch operation runs in it, so no thread pool exists when it
forks. For each command it forks a *waiter*, which forks the *command process* and reports its exit status.
The command process is a real, separate process running `python -m gptforge` as a fresh one would: the test's
working directory and environment, sys.path[0] the working directory, sys.argv as `-m` sets it, stdin from
/dev/null, stdout and stderr to files the test reads, the module run as __main__ (cli.main.entry: quick exit,
exit codes, tracebacks as a fresh interpreter prints them); SIGKILL on timeout, as subprocess.run does.
A command that runs until it is stopped (serve) is started with `popen` instead (conftest.popen_cli): its stderr
a pipe whose writing end is passed to the command process over the socket, its pid there for signals, its exit
status from the waiter when it ends.

What it shares with its siblings: the modules imported before the fork, and Python's hash seed. The tests that
compare whole processes started apart (kill -9 campaigns, torchrun, resume across processes in test_faults.py,
test_distributed.py) start fresh interpreters, so a result that hung on string hash order would still be seen
there. A run with environment variables of its own (read at import time, maybe) also gets a fresh interpreter,
as does every run under GPTFORGE_TEST_FRESH_CLI=1 (conftest.run_cli).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def _send(conn: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def _receive(conn: socket.socket):
    def exactly(n: int) -> bytes:
        chunks = b""
        while len(chunks) < n:
            chunk = conn.recv(n - len(chunks))
            if not chunk:
                raise ConnectionError("the warm process closed the connection")
            chunks += chunk
        return chunks

    (size,) = struct.unpack("!I", exactly(4))
    return json.loads(exactly(size))


def _command_process(request: dict) -> None:
    """In the forked command process: become `python -m gptforge ARGS` in the request's directory; never returns."""
    import atexit
    import random
    import runpy
    import traceback

    import numpy as np

    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if path else request["stderr_fd"], fd)
        sys.path[0] = request["cwd"]  # what `python -m` puts first
        sys.argv = ["-m", *request["args"]]  # runpy sets argv[0] to the module's file, as -m does
        random.seed()
        np.random.seed()
        runpy.run_module("gptforge", run_name="__main__", alter_sys=True)
        code = 0  # entry() ends the process itself (quick exit); reaching here means it returned
    except SystemExit as done:
        from gptforge.core.quick_exit import exit_status

        code = exit_status(done.code)
    except BaseException:  # as the interpreter would: the traceback, then exit status 1
        traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _waiter(conn: socket.socket, request: dict) -> None:
    """In the forked waiter: start the command process, say its pid, then its exit status; never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _command_process(request)
    if request.get("stderr_fd") is not None:
        os.close(request["stderr_fd"])  # the command's copy alone: its end is the pipe's end
    try:
        _send(conn, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
    finally:
        os._exit(0)


def serve(address: str) -> None:
    """The warm process: import what every command imports, then fork a waiter per connection."""
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import gptforge.cli.main  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        request = _receive(conn)
        if request["stderr"] is None:  # a pipe's writing end follows, for the command's stderr
            request["stderr_fd"] = socket.recv_fds(conn, 1, 1)[1][0]
        if os.fork() == 0:
            listener.close()
            _waiter(conn, request)
        conn.close()
        if request["stderr"] is None:
            os.close(request["stderr_fd"])


class WarmCli:
    """The test side: starts the warm process on first use; run(...) is subprocess.run's CompletedProcess."""

    def __init__(self, env: dict):
        self.env = env  # the warm process's environment, as the test session started
        self.process: subprocess.Popen | None = None
        self.folder = Path(tempfile.mkdtemp(prefix="gptforge-warm-cli-"))
        self.address = str(self.folder / "socket")
        self.count = 0

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=self.env,
        )
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the warm gptforge process did not start (exit {self.process.poll()})")

    def run(self, args: list[str], cwd: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
        out, err = self._files()
        argv = [sys.executable, "-m", "gptforge", *args]
        conn, pid = self._command({"args": args, "cwd": cwd, "env": env, "stdout": str(out), "stderr": str(err)})
        with conn:
            conn.settimeout(timeout)
            try:
                returncode = _receive(conn)["returncode"]
            except TimeoutError:
                os.kill(pid, 9)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
        stdout, stderr = out.read_text(), err.read_text()
        out.unlink()
        err.unlink()
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)

    def popen(self, args: list[str], cwd: str, env: dict) -> WarmProcess:
        """The command started, not awaited: subprocess.Popen(..., stderr=PIPE, text=True)'s part the tests use."""
        read_end, write_end = os.pipe()
        request = {"args": args, "cwd": cwd, "env": env, "stdout": str(self._files()[0]), "stderr": None}
        conn, pid = self._command(request, write_end)
        os.close(write_end)
        return WarmProcess([sys.executable, "-m", "gptforge", *args], pid, conn, os.fdopen(read_end))

    def _files(self) -> tuple[Path, Path]:
        """This command's stdout and stderr files in the session's folder."""
        self.count += 1
        return self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"

    def _command(self, request: dict, stderr_fd: int | None = None) -> tuple[socket.socket, int]:
        """The request sent to the warm process (started first if it is not running), with the pipe's writing end
        for the command's stderr when given; the open connection and the command process's pid."""
        if self.process is None or self.process.poll() is not None:
            self.start()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.address)
        _send(conn, request)
        if stderr_fd is not None:
            socket.send_fds(conn, [b"\0"], [stderr_fd])
        conn.settimeout(60)
        return conn, _receive(conn)["pid"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for path in self.folder.iterdir():
            path.unlink()
        self.folder.rmdir()


class WarmProcess:
    """A command process forked by the warm process, as a test drives a subprocess.Popen: pid, stderr (a pipe, text),
    poll, wait, send_signal, kill, communicate. Its exit status comes from its waiter over `conn`."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, stderr):
        self.args, self.pid, self.conn, self.stderr = args, pid, conn, stderr
        self.returncode: int | None = None

    def _collect(self, timeout: float | None) -> None:
        self.conn.settimeout(timeout)
        try:
            self.returncode = _receive(self.conn)["returncode"]
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        self.conn.close()

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.conn], [], [], 0)[0]:
            self._collect(None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._collect(timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        """(None, the rest of stderr) once the command has ended; TimeoutExpired if it has not after `timeout` s."""
        rest: list[str] = []
        reader = threading.Thread(target=lambda: rest.append(self.stderr.read()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        return None, rest[0]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1])

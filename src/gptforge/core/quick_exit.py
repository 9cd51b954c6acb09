"""Ending the `gptforge` process without the interpreter's teardown.

When a command has finished, Python's own exit still tears down every module and object it loaded: torch's ~2,000
modules, the model, the optimizer's state, the allocator's caches. After a training run that took ~0.5 s (and
~0.2 s after a bare `import torch`) on the 2-core machines, every time, for nothing the user keeps
(docs/lab/2026-11-26-zen5.md, "Sixth session"). `quick_exit` does the part of the exit that matters and skips the rest:
it waits for the threads Python would wait for (after telling thread pools' idle workers to stop, as Python
does), runs the atexit handlers (logging's flush, multiprocessing's children, temporary directories), flushes
stdout and stderr, and ends the process with the command's status.

Only the `gptforge` script and `python -m gptforge` end this way (cli.main.entry): code that calls
`gptforge.cli.main.main` itself (tests, notebooks) gets a normal SystemExit. Every file gptforge writes is closed
or flushed when written (checkpoints by files.atomic_write, the metrics log a flush a line), so nothing rests on
the teardown. Off with GPTFORGE_QUICK_EXIT=0 (a normal exit). Standard library only."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

from gptforge.core.allocator import switched_off

SWITCH = "GPTFORGE_QUICK_EXIT"  # 0 / off / false: end through Python's normal exit


def exit_status(code: object) -> int:
    """The process's exit status for sys.exit(code): None is 0, an int itself, anything else (a message) 1 after
    printing it to stderr, as Python does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def quick_exit(code: object = 0) -> NoReturn:
    if switched_off(SWITCH):
        sys.exit(code)
    status = exit_status(code)
    _wait_for_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a reader that left (`gptforge sample | head`) or a closed stream
            pass
    os._exit(status)


def _wait_for_threads() -> None:
    """What the interpreter's exit does first: threading's own exit callbacks (they tell thread pools'
    idle workers to stop: concurrent.futures' executors, left open, would otherwise wait for work forever), then
    wait for every thread not marked daemon. threading._shutdown is that step of CPython's exit; where it is
    missing, the threads are joined one by one."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()

"""What the hostile-input tests share: the workspace they break, the builders that break it, and the check
every row must pass (status 2, one clear message naming the flag or file, no traceback, nothing lost)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import SMALL_TEXT, run_cli, tiny_train_args

# A finished 4-step run: seconds on a CPU; the rows resume it or train over it.
RUN = dict(max_iters=4, lr_decay_iters=4, warmup_iters=1, eval_interval=2, eval_iters=2)
CKPT = "run/ckpt.pt"


@pytest.fixture(scope="module")
def workspace_template(tmp_path_factory) -> Path:
    """data/tiny (prepared char dataset) and run/ (a finished training run), shared by every row."""
    from gptforge.data.prepare import prepare

    root = tmp_path_factory.mktemp("hostile-template")
    (root / "tiny.txt").write_text(SMALL_TEXT, encoding="utf-8")
    prepare("text", data_dir=str(root / "data"), files=[str(root / "tiny.txt")], name="tiny", tokenizer="char")
    (root / "tiny.txt").unlink()
    r = run_cli("train", *tiny_train_args("data", "run", **RUN), cwd=root)
    assert r.returncode == 0, r.stderr
    assert {p.name for p in (root / "run").iterdir()} >= {"ckpt.pt", "metrics.jsonl", "log.txt", "config.json"}
    # ckpt.pt alone: a damaged one must stop a resume here (falling back to ckpt_best.pt is test_recovery's)
    (root / "run" / "ckpt_best.pt").unlink()
    return root


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under folder: relative path -> sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


# --- building the broken situations --------------------------------------------------------------------------


def train(
    *extra: str, files: tuple[str, ...] = (), data_dir: str = "data", out_dir: str = "run", **overrides
) -> list[str]:
    """`gptforge train [FILES] <tiny run options> [EXTRA]`: EXTRA options come last and win."""
    return ["train", *files, *tiny_train_args(data_dir, out_dir, **{**RUN, **overrides}), *extra]


def sample(*extra: str) -> list[str]:
    return ["sample", "--out_dir=run", "--device=cpu", "--num_samples=1", "--max_new_tokens=5", *extra]


def serve(*extra: str, out_dir: str = "no-run") -> list[str]:
    """`gptforge serve`, by default of a run folder that does not exist: a message naming the row's flag rather than
    the missing checkpoint shows the flag was checked before any model was loaded (let alone compiled)."""
    return ["serve", f"--out_dir={out_dir}", "--device=cpu", "--compile=off", *extra]


def serve_more_rows_than_memory(ws: Path, held: list) -> list[str]:
    """A --max_batch whose KV cache (16 KB a row for the run's model) holds more than any machine's memory."""
    from gptforge.core.device import available_memory

    if available_memory("cpu")[0] is None:
        pytest.skip("this machine does not say how much memory is available (no /proc/meminfo)")
    return serve("--max_batch=10000000000", out_dir="run")


def marker(ws: Path) -> Path:
    return ws / "PWNED"


class RunsCode:
    """Unpickling this would call os.system(command)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def touch_marker(ws: Path) -> str:
    return f"touch {shlex.quote(str(marker(ws)))}"


def cut(path: Path, size: int) -> None:
    """Keep the first `size` bytes of path (negative: drop that many from the end)."""
    data = path.read_bytes()
    path.write_bytes(data[:size])


def edit_meta(ws: Path, **changes) -> None:
    path = ws / "data/tiny/meta.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def edit_checkpoint(ws: Path, **model_args) -> None:
    import torch

    ckpt = torch.load(ws / CKPT, weights_only=True)
    ckpt["model_args"].update(model_args)
    torch.save(ckpt, ws / CKPT)


def evil_checkpoint(ws: Path) -> None:
    import torch

    torch.save({"model": RunsCode(touch_marker(ws)), "model_args": {}}, ws / CKPT)


def evil_meta_pkl(ws: Path) -> None:
    (ws / "data/tiny/meta.json").unlink()
    (ws / "data/tiny/meta.pkl").write_bytes(pickle.dumps({"vocab_size": 34, "itos": RunsCode(touch_marker(ws))}))


def wider_dataset(ws: Path) -> None:
    """data/wide: a char dataset with a larger vocabulary than the run's."""
    from gptforge.data.prepare import prepare

    (ws / "wide.txt").write_text(SMALL_TEXT + "".join(map(chr, range(0x3B1, 0x3C9))) * 3, encoding="utf-8")
    prepare("text", data_dir=str(ws / "data"), files=[str(ws / "wide.txt")], name="wide", tokenizer="char")


def unwritable_out_dir(ws: Path, held: list) -> list[str]:
    """out_dir inside a folder made read-only with chmod 500. As root chmod stops nothing: then a folder under
    sysfs, where even root may not create folders (EPERM); else skip (the out_dir-under-a-file row remains)."""
    locked = ws / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        (locked / "probe").write_text("")
    except OSError:
        return train(out_dir="locked/run")
    (locked / "probe").unlink()
    locked.chmod(0o700)
    try:
        os.mkdir("/sys/gptforge-hostile-probe")
    except OSError:
        return train(out_dir="/sys/gptforge-hostile-probe/run")
    os.rmdir("/sys/gptforge-hostile-probe")
    pytest.skip(
        "running as root with a writable /sys: no folder here refuses writes (the out_dir-under-a-file "
        "row covers a failing out_dir)"
    )


def port_in_use(held: list) -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    held.append(sock)
    return sock.getsockname()[1]


@dataclass
class Case:
    build: Callable[[Path, list], list[str]]  # (workspace, resources to keep open) -> command-line arguments
    names: str  # the flag or file the message must name
    hint: str  # regex: the part that says what to do
    runs_code: bool = False  # the input tries to run code: the marker file must not appear
    torchrun: bool = False  # run under torchrun with 2 processes
    forbid: str | None = None  # text that would make the message wrong
    rank0_late: float = 0.0  # torchrun: seconds rank 0 takes longer to meet the mistake, as on a loaded machine


def do(change: Callable[[Path], object], args: list[str]) -> Callable[[Path, list], list[str]]:
    """Apply `change` to the workspace, then run `args`."""

    def build(ws: Path, held: list) -> list[str]:
        change(ws)
        return args

    return build


def just(args: list[str]) -> Callable[[Path, list], list[str]]:
    return lambda ws, held: args


def write(rel: str, text: str | bytes, args: list[str]) -> Callable[[Path, list], list[str]]:
    def change(ws: Path) -> None:
        path = ws / rel
        content = text.replace("MARKER", str(marker(ws))) if isinstance(text, str) else text
        path.write_bytes(content.encode() if isinstance(content, str) else content)

    return do(change, args)


def check_row(case: Case, workspace_template: Path, tmp_path: Path) -> None:
    """Copy the template, break it as `case` says, run the command there and check the rule (module docstring of
    test_hostile_inputs.py)."""
    ws = tmp_path / "ws"
    shutil.copytree(workspace_template, ws)
    held: list = []
    try:
        args = case.build(ws, held)
        before = snapshot(ws)
        if case.torchrun:
            r = torchrun(args, ws, case.rank0_late)
        else:
            r = run_cli(*args, cwd=ws, timeout=120)
    finally:
        for resource in held:
            resource.close()
        if (ws / "locked").exists():
            (ws / "locked").chmod(0o700)
    err = r.stderr
    if case.torchrun:
        # Rank 0 prints the message and exits 2, the other rank waiting for torchrun to end it; torchrun itself then
        # exits 1 and prints its own summary (a ChildFailedError traceback of torch/distributed/run.py, "exitcode  :
        # 2" for rank 0). None of ours.
        assert r.returncode == 1, (r.returncode, err[-3000:])
        assert err.count("gptforge: error:") == 1 and "exitcode  : 2" in err, err[-3000:]
        assert not [line for line in err.splitlines() if line.strip().startswith("File ") and "/gptforge/" in line]
    else:
        assert r.returncode == 2, (r.returncode, err[-3000:])
        assert "Traceback" not in err, err[-3000:]
        assert err.startswith("gptforge: error:") and err.count("gptforge: error:") == 1, err
    assert case.names in err, err
    assert re.search(case.hint, err), err
    if case.forbid:
        assert case.forbid not in err, err
    if case.runs_code:
        assert not marker(ws).exists(), "the hostile input ran code"
    after = snapshot(ws)
    assert after == before, {
        "lost": sorted(set(before) - set(after)),
        "added": sorted(set(after) - set(before)),
        "changed": sorted(k for k in set(before) & set(after) if before[k] != after[k]),
    }


RANK0_LATE = """import os, time
if os.environ.get("RANK") == "0":
    from gptforge.core.errors import UserError
    made = UserError.__init__
    def late(self, *args, **kwargs):
        time.sleep({seconds})
        made(self, *args, **kwargs)
    UserError.__init__ = late
"""


def torchrun(args: list[str], cwd: Path, rank0_late: float = 0.0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptforge", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if rank0_late:  # a sitecustomize that makes the process whose RANK is 0 slower to raise a user error
        late = cwd.parent / "rank0-late"
        late.mkdir()
        (late / "sitecustomize.py").write_text(RANK0_LATE.format(seconds=rank0_late), encoding="utf-8")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(late), env.get("PYTHONPATH")]))
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=180, env=env)

"""Shared fixtures: the offline data in ../shared/data, tiny datasets, and a runner for the real CLI.

Tests that need ../shared/data skip with a reason when it is absent; with GPTFORGE_REQUIRE_SHARED=1 (set by
.ci/run, since CI always has it) they fail instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("GPTFORGE_SHARED", ROOT.parent / "shared")).resolve() / "data"
TIKTOKEN_CACHE = SHARED / "tiktoken-cache"
SHAKESPEARE = SHARED / "tinyshakespeare" / "input.txt"
HELLASWAG_VAL = SHARED / "hellaswag" / "hellaswag_val.jsonl"

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker per core: one thread each, or they oversubscribe
    os.environ["OMP_NUM_THREADS"] = "1"
if TIKTOKEN_CACHE.is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))


def pytest_sessionstart(session):
    """Byte-compile src/ once. Where PYTHONDONTWRITEBYTECODE=1 (this workplace's machines, CI among them) no process
    writes gptforge's .pyc files, and every `python -m gptforge` a test starts compiles its modules anew (~0.1 s of
    its ~1.2 s start); .pyc files already in __pycache__ (which git ignores) are read even then."""
    import compileall

    compileall.compile_dir(str(ROOT / "src"), quiet=1)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """The test modules as pytest rewrote them for its assertion messages are kept in tests/__pycache__, also where
    PYTHONDONTWRITEBYTECODE=1: rewriting all of them took ~4 s of every worker's start in every run."""
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = before


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is available."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def need_shared(path: Path) -> Path:
    """The path inside ../shared/data, or skip (fail under CI) when it is missing."""
    if not path.exists():
        message = f"{path} is missing: these tests read the offline data in ../shared/data"
        if os.environ.get("GPTFORGE_REQUIRE_SHARED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture
def shakespeare_path() -> Path:
    return need_shared(SHAKESPEARE)


@pytest.fixture
def tiktoken_cache() -> Path:
    return need_shared(TIKTOKEN_CACHE)


@pytest.fixture
def hellaswag_path() -> Path:
    """HellaSwag's validation set (10,042 examples), as the official hellaswag_val.jsonl."""
    return need_shared(HELLASWAG_VAL)


# A small corpus with enough repetition that a tiny model visibly learns within ~50 steps.
SMALL_TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\n"
    "All:\nResolved. resolved.\n\n"
) * 60


@pytest.fixture
def char_data(tmp_path: Path) -> Path:
    """A prepared char-level dataset `tiny` under tmp_path/data; returns the data_dir."""
    from gptforge.data.prepare import prepare

    text_file = tmp_path / "tiny.txt"
    text_file.write_text(SMALL_TEXT, encoding="utf-8")
    data_dir = tmp_path / "data"
    prepare("text", data_dir=str(data_dir), files=[str(text_file)], name="tiny", tokenizer="char")
    return data_dir


@pytest.fixture
def bpe_data(tmp_path: Path, tiktoken_cache: Path) -> Path:
    """A GPT-2 BPE dataset `bpe` (one repeated line) under tmp_path/data; returns the data_dir."""
    from gptforge.data.prepare import prepare

    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question. " * 60)
    prepare("text", data_dir=str(tmp_path / "data"), files=[str(tmp_path / "t.txt")], name="bpe", tokenizer="gpt2")
    return tmp_path / "data"


class ListBatches:
    """A data source replaying given batches: stands in for RandomBatches to feed chosen data."""

    def __init__(self, batches):
        self.batches = list(batches)

    def next_batch(self):
        return self.batches.pop(0)

    def state_dict(self):
        return {"left": len(self.batches)}


def kept_rates(monkeypatch, folder: Path, **rates: float) -> None:
    """This process's CPU product rates (FLOP/s by dtype) as if the probe had measured them: written where
    core/cpu.py keeps them ($GPTFORGE_CACHE_DIR/product_rates.json, `folder`), under this machine's key."""
    import functools
    import json

    from gptforge.core import cpu

    monkeypatch.setenv("GPTFORGE_CACHE_DIR", str(folder))
    folder.mkdir(parents=True, exist_ok=True)
    entry = {"machines": {cpu.machine_key(): rates}}
    (folder / cpu.RATES_FILE).write_text(json.dumps(entry), encoding="utf-8")
    # a memo of its own for the test, so that nothing this process reads or measures meanwhile outlives it
    monkeypatch.setattr(cpu, "_known", functools.cache(cpu._known.__wrapped__))
    monkeypatch.setattr(cpu, "product_seconds", lambda *a: pytest.fail("probed although the rates are kept"))


def tiny_train_args(data_dir: Path, out_dir: Path, **overrides) -> list[str]:
    """Command-line style options for a seconds-long CPU run on the `tiny` dataset."""
    opts = dict(
        data_dir=data_dir,
        dataset="tiny",
        out_dir=out_dir,
        device="cpu",
        compile=False,
        dtype="float32",
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=32,
        batch_size=8,
        gradient_accumulation_steps=1,
        max_iters=20,
        lr_decay_iters=20,
        warmup_iters=5,
        learning_rate=3e-3,
        min_lr=3e-4,
        eval_interval=10,
        eval_iters=4,
        log_interval=1,
        dropout=0.0,
        peak_flops=1e12,
    )
    opts.update(overrides)
    return [f"--{k}={v}" for k, v in opts.items() if v is not None]  # None: leave the key at its default


def train_in_process(*args) -> None:
    """`gptforge train ARGS` in this process, through the CLI's own dispatch (cli.main.run) without a new
    interpreter: for a run that a test starts from or reads, where the command line is not what it tests."""
    from gptforge.cli.main import run

    assert run(["train", *map(str, args)]) == 0


# Environment variables that may be read when a module is imported or a runtime starts: a run whose environment
# differs from the warm process's in one of these starts a fresh interpreter (warm_cli.py).
IMPORT_TIME_VARIABLES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "CUDA", "GLIBC_", "MALLOC_")
# Set in this process's environment by what runs in it: core/allocator.py's malloc settings (train() does it) and
# torch's inductor (its cache folder, on a compile). Not the test's: a CLI run starts without them, as from a shell.
SET_IN_PROCESS = {"GLIBC_TUNABLES", "TORCHINDUCTOR_CACHE_DIR"}
FRESH_CLI = os.environ.get("GPTFORGE_TEST_FRESH_CLI", "").strip() not in ("", "0")  # every run a new interpreter
_START_ENV = dict(os.environ)
_warm = []  # the warm_cli.WarmCli, once started


def cli_env(env: dict | None = None) -> dict:
    """The environment of a CLI run: this process's with `env` over it, less what runs in this process set."""
    full_env = {**os.environ, **(env or {})}
    for key in SET_IN_PROCESS.difference(env or {}):  # the session's value (or none), not what a run here set
        full_env.pop(key, None)
        if key in _START_ENV:
            full_env[key] = _START_ENV[key]
    return full_env


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None):
    """`python -m gptforge ARGS` in a real process of its own; returns the CompletedProcess (text). The process is
    forked from a warm one that has imported torch (warm_cli.py), or, where the environment differs in what an
    import may read (or GPTFORGE_TEST_FRESH_CLI=1), a new interpreter."""
    full_env, argv = cli_env(env), [str(arg) for arg in args]
    warm = _warm_cli(full_env)
    if warm is None:
        return subprocess.run(
            [sys.executable, "-m", "gptforge", *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
            env=full_env,
        )  # fmt: skip
    return warm.run(argv, str(cwd or os.getcwd()), full_env, timeout)


def popen_cli(*args: str, cwd: Path | None = None, env: dict | None = None):
    """`python -m gptforge ARGS` started and not awaited, its stderr a pipe (text), as run_cli chooses the process:
    a subprocess.Popen, or warm_cli's WarmProcess with the same pid, stderr, poll, wait, send_signal, kill and
    communicate. For commands that run until told to stop (serve)."""
    full_env, argv = cli_env(env), [str(arg) for arg in args]
    warm = _warm_cli(full_env)
    if warm is None:
        command = [sys.executable, "-m", "gptforge", *argv]
        return subprocess.Popen(command, cwd=cwd, stderr=subprocess.PIPE, text=True, env=full_env)
    return warm.popen(argv, str(cwd or os.getcwd()), full_env)


def _warm_cli(full_env: dict):
    """The session's warm process (started on first use), or None where a new interpreter must run the command."""
    changed = {k for k in full_env.keys() | _START_ENV.keys() if full_env.get(k) != _START_ENV.get(k)}
    if FRESH_CLI or any(k.startswith(IMPORT_TIME_VARIABLES) for k in changed):
        return None
    if not _warm:
        from warm_cli import WarmCli

        _warm.append(WarmCli(_START_ENV))
    return _warm[0]


def pytest_sessionfinish(session, exitstatus):
    for warm in _warm:
        warm.stop()


@pytest.fixture
def dashboard(tmp_path):
    """start(folders) -> url of a dashboard on a free port, stopped at the end of the test."""
    from gptforge.dashboard.server import start_dashboard

    servers = []

    def start(*folders) -> str:
        server, url = start_dashboard(list(folders), port=0)
        servers.append(server)
        return url

    yield start
    for server in servers:
        server.stop()


def whole_and_resumed(data_dir: Path, tmp_path: Path, run: dict) -> tuple[dict, dict]:
    """Train `run` (max_iters steps) in one go in tmp_path/whole, and to half of it then resumed to the end in
    tmp_path/split, through the real CLI; returns both final checkpoints, whose weights must be equal."""
    import torch

    from gptforge.weights.checkpoint import load_checkpoint

    whole, split, steps = tmp_path / "whole", tmp_path / "split", run["max_iters"]
    for out, options in ((whole, run), (split, {**run, "max_iters": steps // 2})):
        r = run_cli("train", *tiny_train_args(data_dir, out, **options), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    r = run_cli("train", f"--out_dir={split}", "--init_from=resume", f"--max_iters={steps}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    a, b = load_checkpoint(str(whole / "ckpt.pt")), load_checkpoint(str(split / "ckpt.pt"))
    assert a["iter_num"] == b["iter_num"] == steps
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    return a, b


def loss_and_grads(model, idx, seed: int | None = None, bf16: bool = True, **kwargs):
    """One training step's loss and gradients of `model` on idx (its own targets), under bf16 CPU autocast unless
    bf16 is False: (the loss, {parameter name: a copy of its gradient}); `seed` reseeds torch's generator first
    (the same dropout masks on every call); kwargs go to the model."""
    import torch

    model.zero_grad()
    if seed is not None:
        torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, loss = model(idx, idx, **kwargs)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is no such file)."""
    path = Path("/proc/cpuinfo")
    for line in path.read_text().splitlines() if path.exists() else ():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()

"""Never lose a run: real `gptforge train` processes killed with SIGKILL, stopped with SIGTERM, interrupted twice.

Each test compares with an uninterrupted run of the same command, exactly: every model and optimizer
tensor (torch.equal), torch's generator, the data position, and every loss in metrics.jsonl (fault_tools.py).
The kill -9 campaigns live in campaign_tools.py, which scripts/fault_campaign.py also runs for bigger campaigns:

    python scripts/fault_campaign.py --kills 60 --seed 0 --json
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from campaign_tools import SHARDED_RUN, prepare_shard_data, run_campaign, summary
from conftest import SHARED, need_shared, tiny_train_args
from fault_tools import CHILD_TIMEOUT, Child, compare_runs, records
from gptforge.weights.checkpoint import load_checkpoint


def finished(args: list[str]) -> Child:
    """Run to the end; the exit must be 0."""
    child = Child(args)
    rc = child.finish()
    assert rc == 0, child.stderr_text()[-3000:]
    return child


def check_campaign(figures: dict, kills: int) -> None:
    print("\n" + summary(figures))
    assert figures["problems"] == [], "\n\n".join(figures["problems"])
    assert figures["mismatches"] == [], figures["mismatches"][:20]
    assert figures["equal"] is True
    assert figures["kills"] == kills
    assert figures["checkpoints_checked"] >= 1  # ckpt.pt existed after some kill and loaded
    assert figures["scratch_restarts"] >= 1  # the first kill, at start-up, came before any checkpoint
    assert all(n > 0 for n in figures["kills_by_phase"].values()), figures["kills_by_phase"]


def test_kill_9_campaign_resumes_bit_identically(char_data, tmp_path):
    """8 SIGKILLs at start-up, mid-step and during checkpoint writes, each followed by a restart (resume when
    ckpt.pt exists): the final checkpoint and metrics equal an uninterrupted run's, and every ckpt.pt seen after
    a kill loads. Whether kills land inside a write, and how many .tmp files they leave, is reported."""
    figures = run_campaign(char_data, tmp_path / "campaign", kills=8, seed=0)
    check_campaign(figures, 8)


def test_kill_9_campaign_with_the_sharded_loader(tmp_path, tiktoken_cache):
    """The same on GPT-2 token shards read by ShardedBatches, whose position is a counter in the checkpoint."""
    need_shared(SHARED / "webtext-sample")
    data = prepare_shard_data(tmp_path)
    assert json.loads((data / "web/meta.json").read_text())["format"] == "shards"
    figures = run_campaign(data, tmp_path / "campaign", kills=4, seed=1, **SHARDED_RUN)
    check_campaign(figures, 4)
    config = json.loads((tmp_path / "campaign/faulty/config.json").read_text())
    assert config["data_loader"] == "sharded"


SIGNAL_RUN = dict(
    max_iters=40, lr_decay_iters=40, warmup_iters=5, eval_interval=10, eval_iters=2, n_embd=64, n_head=2, dropout=0.1
)


def test_sigterm_mid_run_then_resume_equals_an_uninterrupted_run(char_data, tmp_path):
    """SIGTERM: the step finishes, ckpt.pt is written, exit 0; the resumed run ends bit-identical to a run
    never stopped, its metrics holding every step once with the same losses."""
    finished(tiny_train_args(char_data, tmp_path / "whole", **SIGNAL_RUN))
    out = tmp_path / "split"
    child = Child(tiny_train_args(char_data, out, **SIGNAL_RUN))
    assert child.wait_for(lambda line: line.startswith("iter 12:"), child.started + CHILD_TIMEOUT)
    child.proc.send_signal(signal.SIGTERM)
    rc = child.finish()
    stdout = child.stdout_text()
    assert rc == 0, child.stderr_text()
    assert "SIGTERM: finishing this step" in stdout
    assert f"continue with: gptforge train --out_dir={out} --init_from=resume" in stdout
    stopped_at = load_checkpoint(str(out / "ckpt.pt"))["iter_num"]
    assert 13 <= stopped_at < SIGNAL_RUN["max_iters"], stopped_at
    assert f"saved checkpoint ckpt.pt in {out} at iter {stopped_at} (stop requested)" in stdout
    assert [r["step"] for r in records(out) if r["kind"] == "train"] == list(range(stopped_at))
    assert not any(r["kind"] == "end" for r in records(out))

    resumed = finished(tiny_train_args(char_data, out, **SIGNAL_RUN, init_from="resume"))
    assert f"iter {stopped_at}: loss" in resumed.stdout_text()
    assert f"iter {stopped_at - 1}:" not in resumed.stdout_text()
    assert compare_runs(tmp_path / "whole", out, SIGNAL_RUN["max_iters"]) == []


def test_second_signal_while_the_step_finishes_stops_at_once(char_data, tmp_path):
    """A second SIGTERM while the loop finishes its step (a ~1 s step, so both signals land inside it): exit 130
    at once, no step completed and no checkpoint written after it; the previous ckpt.pt is intact."""
    out = tmp_path / "run"
    args = tiny_train_args(
        char_data,
        out,
        max_iters=1000,
        lr_decay_iters=1000,
        eval_interval=2,
        eval_iters=1,
        n_embd=64,
        gradient_accumulation_steps=128,
    )
    child = Child(args)
    deadline = child.started + CHILD_TIMEOUT
    assert child.wait_for(lambda line: line.startswith("saved checkpoint") and " at iter 2 " in line, deadline)
    assert child.wait_for(lambda line: line.startswith("iter 2:"), deadline)
    child.proc.send_signal(signal.SIGTERM)  # step 3 has just begun
    assert child.wait_for(lambda line: line.startswith("SIGTERM: finishing this step"), deadline)
    child.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    rc = child.finish(timeout=60)
    waited = time.monotonic() - sent
    stdout, stderr = child.stdout_text(), child.stderr_text()
    assert rc == 130, (rc, stderr)
    assert "gptforge: interrupted" in stderr and "Traceback" not in stderr
    assert "iter 3:" not in stdout and "stop requested" not in stdout  # step 3 never finished, nothing saved
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 2
    assert not list(out.glob(".ckpt.pt.*.tmp"))
    assert waited < 30, waited  # "at once": in practice well under the step's second


# The checkpoint writer, in the child, holds ckpt.pt's write open (the temporary file written, not yet renamed) once
# the test has armed it, and says so: the second signal then surely arrives mid-write, on any machine's speed.
HOLD_THE_WRITE = """
import contextlib, os, pathlib, time
import gptforge.weights.checkpoint as ck
real_atomic_write = ck.atomic_write

@contextlib.contextmanager
def atomic_write(path, *args, **kwargs):
    with real_atomic_write(path, *args, **kwargs) as fh:
        yield fh
        folder = pathlib.Path(path).parent
        if pathlib.Path(path).name == "ckpt.pt" and (folder / "ARMED").exists():
            (folder / "HOLDING.part").write_text(fh.name)
            os.replace(folder / "HOLDING.part", folder / "HOLDING")  # whole when the test sees it
            end = time.monotonic() + 120
            while time.monotonic() < end:  # until the test's second signal interrupts the write
                time.sleep(0.01)

ck.atomic_write = atomic_write
"""


def test_second_signal_during_the_stop_checkpoint_write(char_data, tmp_path):
    """A second SIGTERM while the stop checkpoint is being written (its temporary file complete, not yet renamed):
    exit 130 at once, ckpt.pt still the previous checkpoint (never torn), the temporary file gone."""
    out = tmp_path / "run"
    args = tiny_train_args(char_data, out, max_iters=1000, lr_decay_iters=1000, eval_interval=4, eval_iters=1)
    child = Child(args, preamble=HOLD_THE_WRITE)
    deadline = child.started + CHILD_TIMEOUT
    assert child.wait_for(lambda line: line.startswith("saved checkpoint") and " at iter 4 " in line, deadline)
    # after the line of step 4, not the checkpoint's: a signal during an evaluation's checkpoint stops the run
    # right there, that checkpoint serving as the stop checkpoint
    assert child.wait_for(lambda line: line.startswith("iter 4:"), deadline)
    # the next ckpt.pt written is the stop checkpoint: hold it mid-write. Armed before the signal: armed after its
    # line, the test (descheduled on a busy machine) was now and then later than the whole stop checkpoint
    (out / "ARMED").touch()
    child.proc.send_signal(signal.SIGTERM)  # inside step 5; the stop checkpoint comes at step 6
    assert child.wait_for(lambda line: line.startswith("SIGTERM: finishing this step"), deadline)
    child.wait_for(lambda line: False, deadline, poll=(out / "HOLDING").exists)
    assert (out / "HOLDING").exists(), "the stop checkpoint's write was never reached"
    tmp = Path((out / "HOLDING").read_text())
    assert tmp.exists() and tmp.stat().st_size > 0  # the new checkpoint's bytes, not yet renamed over ckpt.pt
    child.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    rc = child.finish(timeout=60)
    waited = time.monotonic() - sent
    stdout, stderr = child.stdout_text(), child.stderr_text()
    assert rc == 130, (rc, stderr)
    assert "gptforge: interrupted" in stderr and "Traceback" not in stderr
    assert "(stop requested)" not in stdout  # the stop checkpoint was not completed and announced
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 4  # weights_only: the previous one, whole
    assert not tmp.exists() and not list(out.glob(".ckpt.pt.*.tmp"))
    assert waited < 30, waited


def test_campaign_helpers_compare_exactly(char_data, tmp_path):
    """compare_runs is not blind: a run with another seed differs in weights, optimizer state and losses."""
    from gptforge.core.config import load_config
    from gptforge.train.loop import train

    opts = dict(max_iters=4, lr_decay_iters=4, eval_interval=2, eval_iters=1)
    train(load_config(tiny_train_args(char_data, tmp_path / "a", **opts)))
    train(load_config(tiny_train_args(char_data, tmp_path / "b", **opts, seed=7)))
    mismatches = compare_runs(tmp_path / "a", tmp_path / "b", 4)
    assert any(m.startswith("model.") for m in mismatches) and any(m.startswith("optimizer.") for m in mismatches)
    assert any(m.startswith("metrics.jsonl") for m in mismatches) and "log.txt differs" in mismatches
    assert compare_runs(tmp_path / "a", tmp_path / "a", 4) == []


def test_driver_script_runs(tmp_path):
    """`python scripts/fault_campaign.py --help` works as a script (the figures for the docs come from it)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "fault_campaign.py"
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--kills" in r.stdout, r.stderr

"""Kill -9 campaigns against real `gptforge train` processes: the engine behind tests/test_faults.py (a few kills
in every test run) and scripts/fault_campaign.py (a bigger campaign's figures, docs/RELIABILITY.md).

A campaign runs one uninterrupted reference run, then the same command in another out_dir, SIGKILLs it at
seeded random moments and starts it again (`--init_from=resume` when out_dir/ckpt.pt exists, else from
scratch) until a run completes, whose final ckpt.pt (model, optimizer, torch's generator, data position, step,
best val loss) and metrics must equal the reference's exactly (fault_tools.py). Kill i of n aims at a
random step in the i-th n-th of the run (`plan`), in one of three phases (about 25 / 35 / 40 % of the kills,
shuffled; the first kill at start-up, so the campaign restarts from scratch once):

    startup      a random delay after launch (imports, model build, checkpoint load, the first evaluation),
                 at the latest when the first "iter" line appears
    step         a random delay (up to one measured step) after the line "iter k:", at the latest at the
                 next "iter" line: inside the next update or the evaluation before it
    checkpoint   after the evaluation line "step k: ...", as soon as the writer's temporary file
                 `.ckpt.pt.<pid>.tmp` appears, plus a random delay up to half the measured time from that line
                 to "saved checkpoint": mostly inside the write, sometimes just after the rename

After every kill the process must have died of SIGKILL (no earlier exit, no traceback), and ckpt.pt, if
present, must load (weights_only) and never go back in steps. A writer's temporary file left behind tells
that the kill landed inside a write; leftover ones are counted, not removed: they are what a killed writer
leaves.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import SHARED, tiny_train_args
from fault_tools import CHILD_TIMEOUT, CampaignError, Child, ckpt_step, compare_runs

# A run whose checkpoints come every other step (always_save_checkpoint is on by default) and whose dropout
# draws from the global generator, so a resume must restore it; seconds long on one CPU thread.
CAMPAIGN_RUN = dict(
    max_iters=50, lr_decay_iters=50, warmup_iters=5, eval_interval=2, eval_iters=2, n_embd=64, n_head=2, dropout=0.1
)
TMP_PATTERN = ".ckpt.pt.*.tmp"
PHASES = {"startup": 0.25, "step": 0.35, "checkpoint": 0.4}  # weights of the planned kill phases


def measure(child: Child, eval_interval: int) -> dict[str, float]:
    """Startup, step and checkpoint-write times (seconds) from the time-stamped lines of a finished run."""
    lines = [(t, line) for t, line in child.stdout]
    first_iter = next((t for t, line in lines if line.startswith("iter ")), None)
    first_out = lines[0][0] if lines else None
    iters = {int(line.split()[1].rstrip(":")): t for t, line in lines if line.startswith("iter ")}
    # the gap between "iter k" and "iter k+1" is one step when no evaluation happens at step k+1
    steps = [iters[k + 1] - iters[k] for k in iters if k + 1 in iters and (k + 1) % eval_interval]
    writes = [
        t2 - t1
        for (t1, a), (t2, b) in zip(lines, lines[1:], strict=False)
        if a.startswith("step ") and " val loss " in a and b.startswith("saved checkpoint")
    ]
    if first_iter is None or not steps or not writes:
        raise CampaignError(
            "the reference run printed no iter / checkpoint lines to time kills by:\n" + child.stdout_text()[-2000:]
        )
    return {
        "startup_s": first_iter,
        "first_output_s": first_out,
        "step_s": statistics.median(steps),
        "checkpoint_s": statistics.median(writes),
    }


def phase_order(rng: random.Random, kills: int) -> list[str]:
    """The phases of `kills` kills in PHASES' proportions (each at least once when kills >= 3), shuffled, but a
    start-up kill first: it lands before the first checkpoint, so the campaign also restarts from scratch."""
    counts = {p: max(1, round(w * kills)) if kills >= len(PHASES) else 0 for p, w in PHASES.items()}
    order = [p for p, n in counts.items() for _ in range(n)][:kills]
    order += rng.choices(list(PHASES), weights=list(PHASES.values()), k=kills - len(order))
    rng.shuffle(order)
    if "startup" in order:
        order.remove("startup")
        order.insert(0, "startup")
    return order


def plan(
    rng: random.Random, phase: str, i: int, kills: int, start: int, max_iters: int, eval_interval: int
) -> tuple[str, int]:
    """(phase, target step) of kill number i (from 0) for a run resuming at step `start` (< max_iters - 1).

    Kill i aims at a random step of the i-th of `kills` equal slices of the run (or at `start`, when the run is
    behind), so the kills cover it evenly; targets stay below the last step, so a kill never races the run's
    completion. A checkpoint kill takes the first checkpoint (evaluation step > 0) from there."""
    target = min(max(int((i + rng.random()) * (max_iters - 1) / kills), start), max_iters - 2)
    if phase == "checkpoint":
        evals = [e for e in range(max(target, 1), max_iters) if e % eval_interval == 0]
        if evals:
            return phase, evals[0]
        phase = "step"  # no checkpoint left before the last step
    return phase, (target if phase == "step" else start)


def wait_for_kill(
    child: Child, phase: str, target: int, timing: dict[str, float], rng: random.Random, tmp: Path
) -> str | None:
    """Read the child's output up to the moment its planned kill lands (the phases in the module docstring);
    None when the output ended first: the process exited by itself."""
    forever = child.started + CHILD_TIMEOUT
    if phase == "startup":  # by a random time, or when training has begun
        return child.wait_for(
            lambda line: line.startswith("iter "), child.started + rng.uniform(0.0, timing["startup_s"])
        )
    if phase == "step":
        got = child.wait_for(lambda line: line.startswith(f"iter {target}:"), forever)
        if got:
            got = child.wait_for(
                lambda line: line.startswith("iter "), time.monotonic() + rng.uniform(0.0, timing["step_s"])
            )
        return got
    got = child.wait_for(lambda line: line.startswith(f"step {target}:") and " val loss " in line, forever)
    if got:  # the write starts within milliseconds: poll for its temporary file
        got = child.wait_for(lambda line: line.startswith(("saved checkpoint", "iter ")), forever, poll=tmp.exists)
    if got == "":
        got = child.wait_for(
            lambda line: line.startswith("iter "), time.monotonic() + rng.uniform(0.0, timing["checkpoint_s"] / 2)
        )
    return got


def check_kill(
    child: Child,
    phase: str,
    target: int,
    start: int,
    out: Path,
    last_ckpt: int,
    figures: dict[str, Any],
    log: Callable[[str], None],
) -> int | None:
    """Wait for the killed child and record what its death left into `figures`: it must have died of SIGKILL
    without a traceback, and ckpt.pt must load and not go back. The step ckpt.pt is at now (last_ckpt when
    there is none), or None when it does not load: the campaign stops there."""
    rc = child.finish()
    figures["kills"] += 1
    figures["kills_by_phase"][phase] += 1
    if rc != -signal.SIGKILL:
        figures["problems"].append(f"pid {child.pid} exited with {rc}, not by SIGKILL:\n{child.stderr_text()[-2000:]}")
    if "Traceback" in child.stderr_text():
        figures["problems"].append(f"pid {child.pid} printed a traceback:\n{child.stderr_text()[-2000:]}")
    during_write = (out / f".ckpt.pt.{child.pid}.tmp").exists()
    figures["kills_during_checkpoint_write"] += during_write
    figures["kills_during_checkpoint_write_by_phase"][phase] += during_write
    step_now = None
    if (out / "ckpt.pt").exists():
        try:
            step_now = ckpt_step(out / "ckpt.pt")
            figures["checkpoints_checked"] += 1
        except Exception as e:  # noqa: BLE001  (UserError or anything else: a torn checkpoint)
            figures["problems"].append(f"after killing pid {child.pid} ({phase}): ckpt.pt does not load: {e}")
            return None
        if step_now < last_ckpt:
            figures["problems"].append(f"ckpt.pt went back from step {last_ckpt} to {step_now}")
        last_ckpt = step_now
    figures["checkpoint_steps_after_kills"].append(step_now)
    reached = max(
        (int(line.split()[1].rstrip(":")) + 1 for _, line in child.stdout if line.startswith("iter ")), default=start
    )
    figures["steps_lost"] += max(0, reached - (step_now or 0))
    log(
        f"kill {figures['kills']:3d}: {phase:10s} target {target:3d}, last line {child.last_line[:60]!r}, "
        f"{'in a checkpoint write, ' if during_write else ''}ckpt.pt at step {step_now}"
    )
    return last_ckpt


def run_campaign(
    data_dir: Path, work: Path, kills: int, seed: int = 0, log: Callable[[str], None] = print, **overrides: Any
) -> dict[str, Any]:
    """Reference run, then `kills` SIGKILLs with restarts, then the final run to completion; returns figures.

    `overrides` are tiny_train_args keys on top of CAMPAIGN_RUN (e.g. dataset, data_loader, max_iters).
    Findings (a process that died otherwise, an unreadable checkpoint, a difference from the reference) go to
    figures["problems"] / figures["mismatches"]; a hang raises CampaignError."""
    opts = {**CAMPAIGN_RUN, **overrides}
    max_iters, eval_interval = int(opts["max_iters"]), int(opts["eval_interval"])
    work.mkdir(parents=True, exist_ok=True)
    reference, out = work / "reference", work / "faulty"
    rng = random.Random(seed)
    began = time.monotonic()
    figures: dict[str, Any] = dict(
        seed=seed,
        kills_planned=kills,
        kills=0,
        kills_by_phase={p: 0 for p in PHASES},
        kills_during_checkpoint_write=0,
        kills_during_checkpoint_write_by_phase={p: 0 for p in PHASES},
        resumes=0,
        scratch_restarts=0,
        processes=0,
        checkpoints_checked=0,
        checkpoint_steps_after_kills=[],
        leftover_tmp_files=0,
        steps_lost=0,
        problems=[],
        mismatches=[],
        equal=None,
    )
    children: list[Child] = []

    def launch(out_dir: Path, **extra: Any) -> Child:
        children.append(Child(tiny_train_args(data_dir, out_dir, **opts, **extra)))
        return children[-1]

    def restart(counted: bool) -> Child:  # resume when ckpt.pt exists, else from scratch
        resume = (out / "ckpt.pt").exists()
        if counted:
            figures["resumes" if resume else "scratch_restarts"] += 1
        figures["processes"] += 1
        return launch(out, init_from="resume" if resume else "scratch")

    try:
        ref = launch(reference)
        rc = ref.finish()
        if rc != 0:
            raise CampaignError(f"the reference run failed (exit {rc}):\n{ref.stderr_text()[-3000:]}")
        timing = measure(ref, eval_interval)
        figures["timing"] = {k: round(v, 4) for k, v in timing.items()}
        figures["reference_s"] = round(ref.stdout[-1][0], 2)
        log(f"reference run: {figures['timing']}")
        phases = phase_order(rng, kills)
        start, last_ckpt = 0, -1
        while figures["kills"] < kills:
            if (out / "ckpt.pt").exists():
                start = ckpt_step(out / "ckpt.pt")
            if start >= max_iters - 1:
                log(f"the run reached step {start} before all kills were spent; finishing it")
                break
            phase, target = plan(
                rng, phases[figures["kills"]], figures["kills"], kills, start, max_iters, eval_interval
            )
            child = restart(counted=figures["processes"] > 0)
            if wait_for_kill(child, phase, target, timing, rng, out / f".ckpt.pt.{child.pid}.tmp") is None:
                rc = child.finish()
                figures["problems"].append(
                    f"pid {child.pid} ({phase} kill planned at step {target}) exited "
                    f"with {rc} before the kill:\n{child.stderr_text()[-2000:]}"
                )
                break
            child.kill()
            last_ckpt = check_kill(child, phase, target, start, out, last_ckpt, figures, log)
            if last_ckpt is None:
                break

        final = restart(counted=True)
        rc = final.finish()
        if rc != 0:
            figures["problems"].append(f"the final run exited with {rc}:\n{final.stderr_text()[-3000:]}")
        else:
            figures["mismatches"] = compare_runs(reference, out, max_iters)
            figures["equal"] = not figures["mismatches"]
        figures["leftover_tmp_files"] = len(list(out.glob(TMP_PATTERN)))
    finally:
        for child in children:
            child.kill()
            child.proc.wait(timeout=30)
    figures["wall_s"] = round(time.monotonic() - began, 1)
    return figures


def summary(figures: dict[str, Any]) -> str:
    return (
        f"{figures['kills']} kills (by phase {figures['kills_by_phase']}), "
        f"{figures['kills_during_checkpoint_write']} during a checkpoint write, {figures['resumes']} resumes, "
        f"{figures['scratch_restarts']} restarts from scratch, {figures['checkpoints_checked']} checkpoints "
        f"loaded after kills, {figures['leftover_tmp_files']} leftover .tmp files, {figures['steps_lost']} "
        f"steps redone; final run equal to the uninterrupted one: {figures['equal']}; "
        f"problems {len(figures['problems'])}, mismatches {len(figures['mismatches'])}; {figures['wall_s']} s"
    )


def prepare_shard_data(folder: Path) -> Path:
    """A GPT-2 token-shard dataset `web` (several train shards) from ../shared/data's web text; the data_dir."""
    from gptforge.data.shards import prepare_shards

    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken-cache"))
    sample = SHARED / "webtext-sample" / "cc_en_head-0091.jsonl"
    prepare_shards(
        "files",
        data_dir=str(folder / "data"),
        paths=[str(sample)],
        name="web",
        shard_size=4000,
        val_tokens=300,
        num_proc=1,
    )
    return folder / "data"


# GPT-2's vocabulary makes every step and checkpoint heavier (50,304 x n_embd embedding): a smaller model
SHARDED_RUN = dict(
    dataset="web",
    data_loader="sharded",
    max_iters=12,
    lr_decay_iters=12,
    warmup_iters=3,
    n_embd=16,
    batch_size=4,
    block_size=16,
)

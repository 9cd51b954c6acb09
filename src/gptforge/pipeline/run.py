"""Running a recipe: each stage's fingerprint (its kind, settings, config file and its inputs' fingerprints) decides
whether it is done (skipped), interrupted (resumed: training and RL continue from their last checkpoint; the
others start again) or new or changed (its folder cleared, run again, and so every stage after it that reads it).
pipeline.json in the pipeline folder keeps each stage's fingerprint, whether it finished and its wall time;
report.md is written after every stage."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from gptforge.core.console import duration
from gptforge.core.errors import UserError
from gptforge.pipeline.kinds import KINDS, Stage
from gptforge.pipeline.options import PipelineArgs
from gptforge.pipeline.recipe import PATHS, Recipe, read_recipe
from gptforge.pipeline.report import write_report
from gptforge.pipeline.stages import command, commands, finish, run_text

STATE = "pipeline.json"


def fingerprints(recipe: Recipe) -> dict[str, str]:
    out: dict[str, str] = {}
    for s in recipe.stages:
        config = open(s.config, encoding="utf-8").read() if s.config else None
        settings = dict(s.settings)
        for key in PATHS.get(s.kind, ()):  # a file's content, wherever it lies: an edited file re-runs its stage
            if key in settings:
                settings[key] = _content(settings[key])
        record = {"kind": s.kind, "settings": settings, "config": config, "name": s.name}
        record["inputs"] = {key: out[name] for key, name in sorted(s.inputs.items())}
        out[s.name] = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return out


def _content(value: Any) -> Any:
    """A path setting as its file's name and content hash (FILE.py:FUNCTION: the file's, and the function); a
    folder, or a path not there yet, as given."""
    if isinstance(value, list):
        return [_content(v) for v in value]
    if not isinstance(value, str) or not value:
        return value
    path, function = (value, "") if os.path.isfile(value) else (value.rpartition(":")[0], value.rpartition(":")[2])
    if not os.path.isfile(path):
        return value
    with open(path, "rb") as fh:
        return [os.path.basename(path), hashlib.sha256(fh.read()).hexdigest()[:16], function]


def load_state(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, STATE)
    if not os.path.isfile(path):
        return {"stages": {}}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def save_state(folder: str, state: dict[str, Any]) -> None:
    path = os.path.join(folder, STATE)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(state, fh, indent=1)
    os.replace(path + ".tmp", path)


def plan(recipe: Recipe, state: dict[str, Any], folder: str) -> list[tuple[Stage, str, str]]:
    """[(stage, fingerprint, 'done' | 'resume' | 'run')]: done when it finished with the same fingerprint and its
    folder is there; resume when it started with the same fingerprint and its kind continues; else run."""
    out, prints = [], fingerprints(recipe)
    for stage in recipe.stages:
        fp, kept = prints[stage.name], state["stages"].get(stage.name, {})
        there = os.path.exists(os.path.join(folder, stage.folder))
        if kept.get("fingerprint") == fp and there and kept.get("done"):
            action = "done"
        elif kept.get("fingerprint") == fp and there and KINDS[stage.kind].resumes:
            action = "resume"
        else:
            action = "run"
        out.append((stage, fp, action))
    return out


def shown(stage: Stage, recipe: Recipe) -> str:
    argv = command(stage, {s.name: s for s in recipe.stages})
    return "(writes the texts)" if argv is None else "gptforge " + shlex.join(argv)


def run_pipeline(args: PipelineArgs) -> None:
    recipe = read_recipe(args.recipe, args.overrides, args.out_dir)
    folder = recipe.out_dir
    state = load_state(folder)
    steps = plan(recipe, state, folder)
    print(f"pipeline {recipe.path} in {folder}/: {len(steps)} stages")
    for n, (stage, _, action) in enumerate(steps, 1):
        what = {"done": "done, will be skipped", "resume": "interrupted, will resume", "run": "will run"}[action]
        print(f"  {n}. {stage.name} ({stage.kind}, ~{stage.minutes:g} min): {what}\n     {shown(stage, recipe)}")
    if args.dry_run:
        return
    os.makedirs(os.path.join(folder, "logs"), exist_ok=True)
    state["recipe"] = os.path.abspath(recipe.path)
    started, spent, expected = time.time(), 0.0, 0.0
    for n, (stage, fp, action) in enumerate(steps, 1):
        head = f"[{n}/{len(steps)}] {stage.name}"
        if action == "done":
            print(f"{head}: done earlier ({duration(state['stages'][stage.name].get('wall_s', 0))}), skipped")
            continue
        left = sum(s.minutes for s, _, a in steps[n - 1 :] if a != "done") * _pace(spent, expected)
        verb = "resuming" if action == "resume" else "starting"
        print(f"{head}: {verb} ({stage.kind}); the pipeline has about {duration(left * 60)} left")
        if action == "run":
            _clear(folder, stage)
        state["stages"][stage.name] = {"fingerprint": fp, "done": False, "kind": stage.kind, "folder": stage.folder}
        save_state(folder, state)
        t0 = time.time()
        try:
            _run_stage(recipe, stage, folder)
        finally:
            write_report(recipe, state, folder)
        wall = time.time() - t0  # a resumed stage: the time of this run of it
        state["stages"][stage.name].update(
            done=True, wall_s=round(wall, 1), ended=time.time(), resumed=action == "resume"
        )
        save_state(folder, state)
        write_report(recipe, state, folder)
        if stage.minutes:
            spent, expected = spent + time.time() - t0, expected + stage.minutes * 60
        print(f"{head}: done in {duration(time.time() - t0)}")
    write_report(recipe, state, folder)
    print(f"pipeline done in {duration(time.time() - started)}; report: {os.path.join(folder, 'report.md')}")


def _pace(spent: float, expected: float) -> float:
    """How much longer than the recipe's minutes the stages are taking here: measured once two minutes of them
    have run (short stages say little), kept between a third and three times."""
    return min(3.0, max(1 / 3, spent / expected)) if expected >= 120 else 1.0


def _clear(folder: str, stage: Stage) -> None:
    path = os.path.join(folder, stage.folder)
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def _run_stage(recipe: Recipe, stage: Stage, folder: str) -> None:
    log = os.path.join(folder, "logs", f"{stage.name}.log")
    argvs = commands(stage, {s.name: s for s in recipe.stages})
    if not argvs:
        run_text(stage, folder)
        return
    said = []
    with open(log, "ab") as out:
        for argv in argvs:
            out.write(f"$ gptforge {shlex.join(argv)}\n".encode())
            start = out.tell()
            rc = _tee([sys.executable, "-m", "gptforge", *argv], folder, out, stage.kind == "chat")
            if rc != 0:
                where = f"its output above and in {log}"
                if rc == 2:
                    raise UserError(f"stage [{stage.name}] stopped with a user error (exit 2): {where}")
                raise StageFailed(f"stage [{stage.name}] failed (exit {rc}): {where}", rc)
            said.append((argv, start))
    if stage.kind == "chat":
        _write_samples(stage, folder, log, said)
    finish(stage, folder, log)


def _write_samples(stage: Stage, folder: str, log: str, said: list[tuple[list[str], int]]) -> None:
    """A chat stage's samples.json: each prompt and the answer `gptforge chat -p` printed (its stdout, in the log
    from where the command's header line ends to the next one's)."""
    with open(log, "rb") as fh:
        text = fh.read()
    pairs = []
    for argv, start in said:
        answer = text[start:].split(b"\n$ gptforge ", 1)[0].decode(errors="replace").strip()
        pairs.append({"prompt": argv[-1], "answer": answer})
    os.makedirs(os.path.join(folder, stage.folder), exist_ok=True)
    with open(os.path.join(folder, stage.folder, "samples.json"), "w", encoding="utf-8") as fh:
        json.dump(pairs, fh, indent=1)


class StageFailed(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _tee(argv: list[str], cwd: str, log, quiet_stderr: bool = False) -> int:
    """Run argv in cwd, its output to the terminal and to log as it comes (quiet_stderr: its stderr to the terminal
    only); it dies with this process (kill -9 included), so an interrupted pipeline leaves no stage running."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    stderr = None if quiet_stderr else subprocess.STDOUT
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, env=env, preexec_fn=_die_with_parent)
    try:
        while chunk := os.read(proc.stdout.fileno(), 1 << 16):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            log.write(chunk)
            log.flush()
    except KeyboardInterrupt:  # Ctrl-C reached the stage too: let it save and stop
        proc.wait()
        raise
    return proc.wait()


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

"""Everything the training loop measures, through one `log` call, fanned out to sinks: the console line,
metrics.jsonl, log.txt (build-nanogpt's format), samples.jsonl, wandb and TensorBoard. Only rank 0 writes.
Record kinds and resume rules: docs/ARCHITECTURE.md "Files"."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Collection
from typing import Any

from gptforge.core.config import TrainConfig
from gptforge.core.console import duration
from gptforge.core.distributed import DistEnv
from gptforge.core.errors import UserError
from gptforge.core.files import CONFIG, LOG, METRICS, SAMPLES, TENSORBOARD, atomic_write, remove_stale_temporaries


class Metrics:
    def __init__(
        self,
        out_dir: str,
        enabled: bool = True,
        resume_step: int | None = None,
        wandb: dict[str, Any] | None = None,
        tensorboard: bool = False,
        continues: bool = True,
    ):
        """wandb: None, or dict(project=..., name=..., config=..., id=...) to log there too. continues: a resumed
        run trains on (not eval_only), so the `end` record of the step it resumes from no longer holds."""
        self.enabled = enabled
        self.jsonl_path = os.path.join(out_dir, METRICS)
        self.txt_path = os.path.join(out_dir, LOG)
        self.samples_path = os.path.join(out_dir, SAMPLES)
        self.wandb_run = self.tb = None
        if not enabled:
            return
        self.jsonl = RecordFile(self.jsonl_path, _jsonl_record, resume_step, superseded={"end"} if continues else ())
        self.txt = RecordFile(self.txt_path, _txt_record, resume_step)
        # samples.jsonl exists only once a run samples (the dashboard takes the file for samples); one left by an
        # earlier run in this folder still follows the resume rule
        self.samples = None  # opened by the first log_samples
        if os.path.exists(self.samples_path):
            self.samples = RecordFile(self.samples_path, _samples_record, resume_step)
        if wandb is not None:
            self.wandb_run = _start_wandb(**wandb)
        if tensorboard:
            self.tb = _start_tensorboard(os.path.join(out_dir, TENSORBOARD), purge_step=resume_step)

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, step: int, kind: str, **values: Any) -> None:
        if not self.enabled:
            return
        if kind == "eval":
            values = with_perplexity(values)
        record = {"step": step, "kind": kind, **values, "time": round(time.time(), 3)}
        self.jsonl.append(step, kind, json.dumps(record, allow_nan=True))
        line = _txt_line(step, kind, values)
        if line:
            self.txt.append(step, line.split()[1], line)
        print(_console_line(step, kind, values), flush=True)
        numbers = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float)) and v is not None}
        if self.wandb_run is not None:
            self.wandb_run.log(numbers, step=step)
        if self.tb is not None:
            for tag, value in numbers.items():
                self.tb.add_scalar(tag, value, step)

    def log_samples(self, step: int, prompt: str, texts: list[str]) -> None:
        """Text samples: samples.jsonl, the console, and wandb / TensorBoard when on."""
        if not self.enabled:
            return
        record = {"step": step, "prompt": prompt, "samples": texts, "time": round(time.time(), 3)}
        if self.samples is None:
            self.samples = RecordFile(self.samples_path, _samples_record, None, fresh=False)
        self.samples.append(step, "samples", json.dumps(record, ensure_ascii=False))
        print(f"step {step}: samples", *[f"  > {t!r}" for t in texts], sep="\n", flush=True)
        joined = "\n\n---\n\n".join(texts)
        if self.wandb_run is not None:
            self.wandb_run.log({"samples/text": joined}, step=step)
        if self.tb is not None:
            self.tb.add_text("samples", joined, step)

    def info(self, message: str) -> None:
        """A plain message for the console only (rank 0)."""
        if self.enabled:
            print(message, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        for fh in (self.jsonl, self.txt, self.samples):
            if fh is None:
                continue
            with contextlib.suppress(OSError):  # a full disk was reported where it happened; closing goes on
                fh.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


class RecordFile:
    """One of a run's append-only record files (metrics.jsonl, log.txt, samples.jsonl), one line per record of a
    step and kind.

    A fresh run empties it. A run resumed from the checkpoint of step N keeps every record of the steps before N,
    drops those after N (no checkpoint covers them) and keeps those of step N until the resumed run writes a record
    of the same kind at step N again (it re-runs step N's evaluation, say): only then is the old one replaced, so a
    resume that does not redo one of them (a changed eval_interval, a stop before the evaluation) loses nothing. The
    `end` record of step N goes at once when the resumed run trains on past it.
    A line torn by a crash (no newline) is dropped. Every rewrite goes through files.atomic_write."""

    def __init__(
        self,
        path: str,
        parse: Callable[[str], tuple[int, str] | None],
        resume_step: int | None,
        fresh: bool = True,
        superseded: Collection[str] = (),
    ):
        """superseded: kinds of record at resume_step that the resumed run makes untrue (`end`, when it trains on)."""
        self.path, self.parse, self.resume_step = path, parse, resume_step
        self.replaceable: set[str] = set()  # kinds of step resume_step still holding an old record
        if fresh:
            at = resume_step if resume_step is not None else -1
            kept = self._read(keep=lambda step, kind: step < at or (step == at and kind not in superseded))
            self.replaceable = {kind for step, kind, _ in kept if step == resume_step}
            self._write([line for _, _, line in kept])
        self.fh = self._open()

    def append(self, step: int, kind: str, line: str) -> None:
        if step == self.resume_step and kind in self.replaceable:
            self.replaceable.discard(kind)  # the resumed run's own record of this kind replaces the old one
            self.fh.close()
            kept = self._read(keep=lambda s, k: not (s == step and k == kind))
            self._write([line for _, _, line in kept])
            self.fh = self._open()
        elif step != self.resume_step:
            self.replaceable.clear()
        try:
            self.fh.write(line + "\n")
            self.fh.flush()
        except OSError as e:  # e.g. the disk filled up: stop with the checkpoints written so far intact
            raise _write_error(self.path, e) from None

    def close(self) -> None:
        self.fh.close()

    def _read(self, keep: Callable[[int, str], bool]) -> list[tuple[int, str, str]]:
        out = []
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    parsed = self.parse(line) if line.endswith("\n") else None  # no newline: torn mid-write
                    if parsed is not None and keep(*parsed):
                        out.append((*parsed, line))
        return out

    def _write(self, lines: list[str]) -> None:
        try:
            with atomic_write(self.path, "w", encoding="utf-8") as fh:
                fh.writelines(lines)
        except OSError as e:
            raise _write_error(self.path, e) from None

    def _open(self):
        try:
            return open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise _write_error(self.path, e) from None


def _write_error(path: str, e: OSError) -> UserError:
    return UserError(
        f"cannot write {path}: {e.strerror}; free space or choose another --out_dir, then "
        "continue with --init_from=resume"
    )


def perplexity(loss: float) -> float:
    """exp(loss): the model is as unsure as a uniform choice among this many tokens (a vocabulary of V gives V at
    loss ln V). inf beyond the float range; NaN stays NaN."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def with_perplexity(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with `X_ppl` = exp(`X_loss`) right after each loss (unless given), in the same order otherwise."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        out[key] = value
        ppl = key.removesuffix("_loss") + "_ppl"
        if key.endswith("_loss") and ppl not in values and isinstance(value, (int, float)):
            out[ppl] = perplexity(value)
    return out


def _txt_line(step: int, kind: str, values: dict[str, Any]) -> str | None:
    if kind == "train":
        return f"{step} train {values['loss']:.6f}"
    if kind == "eval":
        return f"{step} val {values['val_loss']:.4f}"
    if kind == "hellaswag":
        return f"{step} hellaswag {values['acc_norm']:.4f}"
    return None


def _console_line(step: int, kind: str, v: dict[str, Any]) -> str:
    if kind == "train":
        parts = [f"iter {step}: loss {v['loss']:.4f}", f"lr {v['lr']:.2e}"]
        if v.get("grad_norm") is not None:
            parts.append(f"norm {v['grad_norm']:.2f}")
        parts.append(f"time {v['ms_per_iter']:.1f}ms")
        if v.get("tokens_per_s"):
            parts.append(f"{v['tokens_per_s']:,.0f} tok/s")
        if v.get("mfu") is not None:
            parts.append(f"mfu {v['mfu'] * 100:.2f}%")
        if v.get("eta_s") is not None:
            parts.append(f"eta {duration(v['eta_s'])}")
        return ", ".join(parts)
    if kind == "eval":
        parts = []
        for split in ("train", "val"):
            text = f"{split} loss {v[split + '_loss']:.4f}"
            if v.get(split + "_ppl") is not None:
                text += f" (ppl {v[split + '_ppl']:.2f})"
            parts.append(text)
        parts += [
            f"{split} bpb {v[split + '_bpb']:.4f}" for split in ("train", "val") if v.get(split + "_bpb") is not None
        ]
        return f"step {step}: " + ", ".join(parts)
    if kind == "hellaswag":
        return f"step {step}: hellaswag acc_norm {v['acc_norm']:.4f}, acc {v['acc']:.4f} ({v['n']} examples)"
    if kind == "skip":
        return (
            f"iter {step}: skipped, loss {v['loss']:.4g}, norm {v['grad_norm']:.4g} not finite; weights unchanged "
            f"({v['in_a_row']} in a row, the run stops at {v['max_bad_steps']})"
        )
    if kind == "end":
        return f"step {step}: done ({v.get('reason', '')})"
    if kind in ("rl", "rl_eval"):
        return _rl_line(step, kind, v)
    return f"step {step}: {kind} " + ", ".join(f"{k} {val}" for k, val in v.items())


def _rl_line(step: int, kind: str, v: dict[str, Any]) -> str:
    """gptforge rl's lines: a step's rewards, pass rates, speed and time left; an evaluation's pass rates."""
    shown = {k: x for k, x in v.items() if isinstance(x, float) and k not in ("lr", "step_s", "eta_s")}
    text = ", ".join(f"{k} {x:,.0f}" if k.endswith("per_s") else f"{k} {x:.4g}" for k, x in shown.items())
    if kind == "rl_eval":
        return f"step {step}: held-out {text}"
    return f"step {step}: {text}, {v['step_s']:.1f}s, eta {duration(v['eta_s'])}"


def _jsonl_record(line: str) -> tuple[int, str] | None:
    """(step, kind) of a metrics.jsonl line; None for a line that is not a record."""
    try:
        record = json.loads(line)
        return int(record["step"]), str(record["kind"])
    except (ValueError, KeyError, TypeError):
        return None


def _samples_record(line: str) -> tuple[int, str] | None:
    try:
        return int(json.loads(line)["step"]), "samples"
    except (ValueError, KeyError, TypeError):
        return None


def _txt_record(line: str) -> tuple[int, str] | None:
    """(step, kind) of a log.txt line ('{step} {kind} {value}')."""
    parts = line.split()
    return (int(parts[0]), parts[1]) if len(parts) >= 2 and parts[0].isdigit() else None


def _start_tensorboard(folder: str, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(
            "tensorboard_log=True needs tensorboard: pip install 'gptforge[tensorboard]', "
            "or set --tensorboard_log=False"
        ) from None
    # purge_step drops events a resumed run is about to write again
    return SummaryWriter(log_dir=folder, purge_step=purge_step)


def _start_wandb(project: str, name: str, config: dict[str, Any], id: str | None = None):
    try:
        import wandb
    except ImportError:
        raise UserError("wandb_log=True needs wandb: pip install 'gptforge[wandb]', or set --wandb_log=False") from None
    return wandb.init(project=project, name=name, config=config, id=id, resume="allow" if id else None)


class StepTimer:
    """Seconds per step, averaged over the steps since the last log line, with running averages for ETA and MFU.
    max_iters: where the run ends (the ETA); tokens_per_iter: tokens per whole step; mfu: the time of a whole step
    -> its MFU. A step of `share` of the whole batch (batch_warmup_size) counts its share of the tokens and FLOPs."""

    def __init__(self, max_iters: int, tokens_per_iter: int, mfu: Callable[[float], float]) -> None:
        self.max_iters, self.tokens_per_iter, self.step_mfu = max_iters, tokens_per_iter, mfu
        self.seconds, self.steps, self.shares, self.ema_dt, self.mfu = 0.0, 0, 0.0, None, None
        self.warming_up = True

    def add(self, seconds: float, share: float = 1.0) -> None:
        self.seconds += seconds
        self.steps += 1
        self.shares += share

    def report(self, step: int) -> dict[str, Any]:
        dt, steps, whole_dt = self.seconds / self.steps, self.steps, self.seconds / self.shares
        self.seconds, self.steps, self.shares = 0.0, 0, 0.0
        settled = step >= 5  # the first steps include compilation and warm-up
        if self.warming_up:  # they would hold the ETA up for long and drag the MFU down
            self.ema_dt = dt
        else:
            keep = 0.9**steps  # the same average per step whatever log_interval is
            self.ema_dt = keep * self.ema_dt + (1 - keep) * dt
        self.warming_up = not settled
        if settled:
            mfu = self.step_mfu(whole_dt)
            self.mfu = mfu if self.mfu is None else 0.9 * self.mfu + 0.1 * mfu
        return {
            "ms_per_iter": dt * 1000,
            "tokens_per_s": self.tokens_per_iter / whole_dt,
            "mfu": self.mfu,
            "eta_s": self.ema_dt * (self.max_iters - step - 1),
        }


def write_config(cfg: Any, name: str = CONFIG) -> None:
    """A run's resolved settings (a TrainConfig, or `gptforge rl`'s RLConfig with its own file name) as JSON in its
    out_dir, once everything is built and checked, after the temporaries a run killed while writing a checkpoint
    left are removed."""
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        remove_stale_temporaries(cfg.out_dir)
        with atomic_write(os.path.join(cfg.out_dir, name), "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(cfg), fh, indent=2)
            fh.write("\n")
    except OSError as e:
        raise unwritable(cfg.out_dir, e) from None


def unwritable(out_dir: str, e: OSError) -> UserError:
    """The error for an out_dir that cannot be written (a file in its path, no permission, a full disk)."""
    return UserError(f"--out_dir={out_dir}: cannot write there ({e.strerror}); choose another folder")


def open_outputs(cfg: TrainConfig, env: DistEnv, ckpt: dict[str, Any] | None) -> tuple[Metrics, contextlib.ExitStack]:
    """The run folder (rank 0), Metrics (console, files, wandb, TensorBoard) and the dashboard, with what closes
    them: the first writes of a run, every input checked by now (config.json follows: write_config)."""
    wandb = None
    if cfg.wandb_log:
        wandb = dict(
            project=cfg.wandb_project,
            name=cfg.wandb_run_name,
            config=dataclasses.asdict(cfg),
            id=ckpt.get("wandb_run_id") if ckpt else None,
        )
    with contextlib.ExitStack() as cleanup:
        try:
            if env.is_main:
                os.makedirs(cfg.out_dir, exist_ok=True)
            metrics = Metrics(
                cfg.out_dir,
                enabled=env.is_main,
                resume_step=int(ckpt["iter_num"]) if ckpt else None,
                wandb=wandb,
                tensorboard=cfg.tensorboard_log,
                continues=not cfg.eval_only,
            )
        except OSError as e:
            raise unwritable(cfg.out_dir, e) from None
        cleanup.enter_context(contextlib.closing(metrics))
        if cfg.dashboard and env.is_main:
            from gptforge.dashboard import start_dashboard  # standard library only: cheap to import

            try:
                server, url = start_dashboard([cfg.out_dir], "127.0.0.1", cfg.dashboard_port)
            except UserError as e:
                raise UserError(f"--dashboard_port={cfg.dashboard_port}: {e}") from None
            cleanup.callback(server.stop)
            metrics.info(f"dashboard: open {url} (it stops when training ends)")
        return metrics, cleanup.pop_all()

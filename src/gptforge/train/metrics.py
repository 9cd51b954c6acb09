"""Everything the training loop measures, through one `log` call, fanned out to sinks: the console line,
metrics.jsonl, log.txt (build-nanogpt's format), samples.jsonl, wandb and TensorBoard. Only rank 0 writes.
Record kinds and resume rules: docs/ARCHITECTURE.md "Files"."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any

from gptforge.core.errors import UserError
from gptforge.core.files import LOG, METRICS, SAMPLES, TENSORBOARD, atomic_write


class Metrics:
    def __init__(
        self,
        out_dir: str,
        enabled: bool = True,
        resume_step: int | None = None,
        wandb: dict[str, Any] | None = None,
        tensorboard: bool = False,
    ):
        """wandb: None, or dict(project=..., name=..., config=..., id=...) to log there too."""
        self.enabled = enabled
        self.jsonl_path = os.path.join(out_dir, METRICS)
        self.txt_path = os.path.join(out_dir, LOG)
        self.samples_path = os.path.join(out_dir, SAMPLES)
        self.wandb_run = self.tb = None
        if not enabled:
            return
        _keep_before(self.jsonl_path, _jsonl_step, resume_step)
        _keep_before(self.txt_path, _txt_step, resume_step)
        # samples.jsonl exists only once a run samples (the dashboard takes the file for samples); one left by an
        # earlier run in this folder still follows the resume rule
        if os.path.exists(self.samples_path):
            _keep_before(self.samples_path, _jsonl_step, resume_step)
        self.jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self.txt = open(self.txt_path, "a", encoding="utf-8")
        self.samples = None  # opened by the first log_samples
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
        _append(self.jsonl, json.dumps(record, allow_nan=True))
        line = _txt_line(step, kind, values)
        if line:
            _append(self.txt, line)
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
            try:
                self.samples = open(self.samples_path, "a", encoding="utf-8")
            except OSError as e:
                raise _write_error(self.samples_path, e) from None
        _append(self.samples, json.dumps(record, ensure_ascii=False))
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


def _append(fh, line: str) -> None:
    try:
        fh.write(line + "\n")
        fh.flush()
    except OSError as e:  # e.g. the disk filled up: stop with the checkpoints written so far intact
        raise _write_error(fh.name, e) from None


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
            parts.append(f"eta {format_duration(v['eta_s'])}")
        return ", ".join(parts)
    if kind == "eval":
        parts = []
        for split in ("train", "val"):
            text = f"{split} loss {v[split + '_loss']:.4f}"
            if v.get(split + "_ppl") is not None:
                text += f" (ppl {v[split + '_ppl']:.2f})"
            parts.append(text)
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
    return f"step {step}: {kind} " + ", ".join(f"{k} {val}" for k, val in v.items())


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _jsonl_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _txt_step(line: str) -> int | None:
    first = line.split(maxsplit=1)[0] if line.strip() else ""
    return int(first) if first.isdigit() else None


def _keep_before(path: str, parse, resume_step: int | None) -> None:
    """Fresh run: empty the file. Resume from step N: keep the lines of steps before N."""
    kept = []
    if resume_step is not None and os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                step = parse(line) if line.endswith("\n") else None  # no newline: torn by a crash mid-write
                if step is not None and step < resume_step:
                    kept.append(line)
    with atomic_write(path, "w", encoding="utf-8") as fh:
        fh.writelines(kept)


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

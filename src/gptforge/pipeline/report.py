"""report.md, the pipeline's report card: written after every stage from what the stages' own commands wrote
(pipeline.json's wall times, the runs' metrics.jsonl, the datasets' meta.json, eval.json from `gptforge eval chat`'s
output), so a killed pipeline still has one and nothing is counted twice. The curves are the dashboard's:
`gptforge dashboard PIPELINE_FOLDER` shows every stage's run."""

from __future__ import annotations

import json
import math
import os
import platform
from importlib import metadata
from typing import Any

from gptforge.core.console import duration
from gptforge.pipeline.kinds import Stage
from gptforge.pipeline.recipe import Recipe


def write_report(recipe: Recipe, state: dict[str, Any], folder: str) -> None:
    lines = [f"# Report: {os.path.basename(recipe.path)}", "", *machine(), "", "## Stages", ""]
    lines += ["| stage | kind | wall time | status | settings |", "|---|---|---|---|---|"]
    for s in recipe.stages:
        kept = state["stages"].get(s.name, {})
        status = "done" if kept.get("done") else ("interrupted" if kept else "not run")
        settings = ", ".join(f"{k}={v}" for k, v in {**s.inputs, **s.settings}.items()) or "-"
        wall = duration(kept["wall_s"]) if "wall_s" in kept else "-"
        lines.append(f"| {s.name} | {s.kind} | {wall} | {status} | {settings} |")
    total = sum(k.get("wall_s", 0) for k in state["stages"].values())
    lines += ["", f"Wall time of the stages: {duration(total)}.", ""]
    done = [s for s in recipe.stages if state["stages"].get(s.name, {}).get("done")]
    for s in done:
        lines += _figures(s, recipe, folder)
    lines += _eval_table([s for s in done if s.kind == "eval_chat"], folder)
    lines += _samples([s for s in done if s.kind == "chat"], folder)
    lines += ["## Curves", "", f"`gptforge dashboard {folder}` draws every training and RL stage's curves.", ""]
    with open(os.path.join(folder, "report.md.tmp"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))
    os.replace(os.path.join(folder, "report.md.tmp"), os.path.join(folder, "report.md"))


def machine() -> list[str]:
    cpu, flags, family, model = platform.processor() or "?", set(), "?", "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = (p.strip() for p in line.partition(":"))
                cpu = value if key == "model name" else cpu
                family = value if key == "cpu family" else family
                model = value if key == "model" else model
                flags = set(value.split()) if key == "flags" else flags
    except OSError:
        pass
    bf16 = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "none"
    versions = []
    for name in ("gptforge", "torch"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return [
        f"Machine: {cpu} (family {family} model {model}), {os.cpu_count()} CPUs, bf16 flags: {bf16}; "
        f"Python {platform.python_version()}, {', '.join(versions)}."
    ]


def records(run: str, kind: str) -> list[dict[str, Any]]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [r for r in rows if r.get("kind") == kind]


def _figures(stage: Stage, recipe: Recipe, folder: str) -> list[str]:
    where = os.path.join(folder, stage.folder)
    if stage.kind == "prepare_text":
        with open(os.path.join(where, "meta.json"), encoding="utf-8") as fh:
            tokens = json.load(fh).get("tokens", {})
        text = recipe.stage(stage.inputs["text"])
        size = sum(
            os.path.getsize(os.path.join(folder, text.folder, f)) for f in os.listdir(os.path.join(folder, text.folder))
        )
        count = sum(tokens.values())
        per = f"; {size / count:.2f} bytes per token" if count else ""
        return [f"**{stage.name}**: {tokens.get('train', 0):,} train and {tokens.get('val', 0):,} val tokens{per}.", ""]
    if stage.kind == "train":
        evals, chats = records(where, "eval"), records(where, "chat")
        if not evals:
            return []
        last = evals[-1]
        bpb = f", {last['val_bpb']:.3f} bits per byte" if "val_bpb" in last else ""
        out = f"**{stage.name}**: step {last['step']}, val loss {last['val_loss']:.4f}{bpb}"
        if chats:
            out += f"; its held-out chat check {chats[-1]['acc']:.3f} ({chats[-1]['n']} problems)"
        return [out + ".", ""]
    if stage.kind == "eval_hellaswag":
        with open(os.path.join(where, "eval.json"), encoding="utf-8") as fh:
            h = json.load(fh)["hellaswag"]
        said = f"HellaSwag acc_norm {h['acc_norm']:.4f}, acc {h['acc']:.4f}, {h['n']:,} examples"
        return [f"**{stage.name}** ({stage.inputs['model']}): {said}.", ""]
    if stage.kind == "rl":
        steps, evals = records(where, "rl"), records(where, "rl_eval")
        if not steps:
            return []
        k = max(1, min(100, len(steps) // 4))  # the first and last k steps' mean reward
        first, last = (sum(r["reward"] for r in part) / k for part in (steps[:k], steps[-k:]))
        out = f"**{stage.name}**: {len(steps)} steps; mean reward {first:.3f} (first {k}) -> {last:.3f} (last {k})"
        if len(evals) > 1:
            out += f"; held-out pass@1 {evals[0]['pass_at_1']:.3f} -> {evals[-1]['pass_at_1']:.3f}"
        return [out + ".", ""]
    return []


def _eval_table(stages: list[Stage], folder: str) -> list[str]:
    """One table of every eval_chat stage: a column each, a row a kind, exact match ± its standard error."""
    if not stages:
        return []
    results = []
    for s in stages:
        with open(os.path.join(folder, s.folder, "eval.json"), encoding="utf-8") as fh:
            results.append(json.load(fh))
    kinds = list(dict.fromkeys(k for r in results for k in r["kinds"]))
    lines = ["## Chat evaluation (exact match, ± standard error)", ""]
    lines += ["| kind | " + " | ".join(f"{s.name} ({s.inputs['model']})" for s in stages) + " |"]
    lines += ["|---|" + "---|" * len(stages)]
    for kind in kinds:
        cells = [_cell(r["kinds"].get(kind)) for r in results]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("| all | " + " | ".join(f"{r['all'].get('exact', float('nan')):.3f}" for r in results) + " |")
    sizes = ", ".join(str(next(iter(r["kinds"].values()), {}).get("n", "?")) for r in results)
    return lines + ["", f"Held-out problems per kind: {sizes}.", ""]


def _cell(got: dict[str, Any] | None) -> str:
    if not got:
        return ""
    p, n = got["exact"], got["n"]
    return f"{p:.3f} ± {math.sqrt(p * (1 - p) / n):.3f}"


def _samples(stages: list[Stage], folder: str) -> list[str]:
    lines = ["## Sample conversations", ""] if stages else []
    for s in stages:
        with open(os.path.join(folder, s.folder, "samples.json"), encoding="utf-8") as fh:
            for pair in json.load(fh):
                lines += [
                    f"**{s.inputs['model']}**, asked: {pair['prompt']}",
                    "",
                    "> " + pair["answer"].replace("\n", "\n> "),
                    "",
                ]
    return lines

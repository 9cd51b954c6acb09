"""What each kind of stage runs: the gptforge command line it amounts to (run in the pipeline folder, so its
outputs land in it: tokenizers/NAME, data/NAME, run folders), the `text` stage's own small job, and what a stage
leaves for the report (eval_chat's table as eval.json)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any

from gptforge.core.errors import UserError
from gptforge.pipeline.kinds import KINDS, Stage

COMMANDS = {  # the kinds run by a gptforge command whose options argparse reads (the rest: --key=value)
    "tokenizer": ["tokenizer", "train"],
    "prepare_text": ["prepare"],
    "prepare_chat": ["prepare"],
    "eval_chat": ["eval", "chat"],
    "eval_hellaswag": ["eval", "hellaswag"],
    "export": ["export"],
    "chat": ["chat"],
}


def text_files(stage: Stage) -> list[str]:
    """The files a `text` stage writes, relative to the pipeline folder: one a built-in source, one a file given."""
    names = [f"{s}.txt" for s in stage.settings.get("sources", [])]
    names += [os.path.basename(f) for f in stage.settings.get("files", [])]
    return [os.path.join(stage.folder, n) for n in names]


def values(stage: Stage, inputs: dict[str, Stage]) -> dict[str, Any]:
    """The stage command's settings: the recipe's, then the ones the pipeline sets (folders, inputs resolved)."""
    out = {k: v for k, v in stage.settings.items() if k not in KINDS[stage.kind].own}
    given = {key: inputs[name] for key, name in stage.inputs.items()}
    if stage.kind == "tokenizer":
        out.update(files=text_files(given["text"]), name=stage.name, force=True)
    elif stage.kind in ("prepare_text", "prepare_chat"):
        out.update(name=stage.name, data_dir="data")
        if "tokenizer" in given:
            out["tokenizer"] = given["tokenizer"].folder
        if "text" in given:
            out.update(recipe="text", files=text_files(given["text"]))
        elif stage.kind == "prepare_chat":
            out["recipe"] = "chat"
    elif stage.kind in ("train", "rl"):
        out["out_dir"] = stage.folder
        if "init_from" in given:
            out["init_from"] = given["init_from"].folder
        if "dataset" in given:
            out["dataset"] = given["dataset"].name
        if stage.kind == "train":
            out["resume"] = "auto"  # an interrupted stage continues from its last checkpoint
    elif stage.kind in ("eval_chat", "eval_hellaswag", "export", "chat"):
        out["out_dir"] = given["model"].folder
        if stage.kind == "export":
            out["to"] = os.path.join(stage.folder, out.get("to", "hf"))
            out["force"] = True
    return out


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, list) else str(value)


def check_argv(stage: Stage, inputs: dict[str, Stage]) -> tuple[type | None, list[str]]:
    """The settings class that checks the stage (None: train's) and the --key=value list it is checked on."""
    settings = values(stage, inputs)
    if stage.kind == "train" and "init_from" in stage.inputs:
        settings["init_from"] = "scratch"  # the input run's folder is made by its stage; train checks it then
    argv = [stage.config] if stage.config else []
    argv += [f"--{k}={_text(v)}" for k, v in settings.items()]
    return KINDS[stage.kind].options, argv


def command(stage: Stage, inputs: dict[str, Stage]) -> list[str] | None:
    """The gptforge command line (after `gptforge`) that runs the stage; None for the `text` stage."""
    if stage.kind == "text":
        return None
    if stage.kind in ("train", "rl"):
        config = [stage.config] if stage.config else []
        return [stage.kind, *config, *(f"--{k}={_text(v)}" for k, v in values(stage, inputs).items())]
    settings, cls = values(stage, inputs), KINDS[stage.kind].options
    argv, positional = list(COMMANDS[stage.kind]), []
    for f in dataclasses.fields(cls):
        if f.name not in settings:
            continue
        value, meta = settings[f.name], f.metadata
        if meta.get("positional"):
            positional += value if isinstance(value, list) else [str(value)]
            continue
        flag = (meta.get("flags") or (f"--{f.name}",))[0]
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif isinstance(value, list):
            for item in value:
                argv += [flag, str(item)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv[: len(COMMANDS[stage.kind])] + positional + argv[len(COMMANDS[stage.kind]) :]


def commands(stage: Stage, inputs: dict[str, Stage]) -> list[list[str]]:
    """The command lines a stage runs in turn: one, or a chat stage's one per prompt (`gptforge chat -p`)."""
    argv = command(stage, inputs)
    if stage.kind == "chat":
        return [[*argv, "-p", prompt] for prompt in stage.settings.get("prompts", [])]
    return [] if argv is None else [argv]


def run_text(stage: Stage, folder: str) -> None:
    """The `text` stage: each built-in source and each given file as a UTF-8 text file in the stage's folder."""
    out = os.path.join(folder, stage.folder)
    os.makedirs(out, exist_ok=True)
    for source in stage.settings.get("sources", []):
        target = os.path.join(out, f"{source}.txt")
        if source == "shakespeare":
            from gptforge.data.prepare import shakespeare_input

            shutil.copyfile(shakespeare_input(out, stage.settings.get("shakespeare") or None), target)
        else:
            from gptforge.chat.conversations import read_chitchat

            text = "\n\n".join("\n".join(m.content for m in c.messages) for c in read_chitchat())
            with open(target, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
    for path in stage.settings.get("files", []):
        if not os.path.isfile(path):
            raise UserError(f"[{stage.name}] files: {path} not found")
        shutil.copyfile(path, os.path.join(out, os.path.basename(path)))


EVAL_LINE = re.compile(r"^(\S+)\s+exact match ([0-9.]+) \((\d+) held-out problems\)(?:, tool calls ([0-9.]+))?")
HELLASWAG_LINE = re.compile(r"hellaswag: (\d+) examples, acc ([0-9.]+) \(\d+/\d+\), acc_norm ([0-9.]+)")
END_LINE = re.compile(r"^all\s+exact match ([0-9.]+); answers ending with the end token ([0-9.]+)")


def finish(stage: Stage, folder: str, log: str) -> None:
    """What a finished stage leaves for the report beyond its command's own files: eval_chat's table and
    eval_hellaswag's line, read from the command's own output, as <stage>/eval.json."""
    if stage.kind == "eval_hellaswag":
        with open(log, encoding="utf-8", errors="replace") as fh:
            found = HELLASWAG_LINE.findall(fh.read())
        n, acc, norm = found[-1] if found else ("0", "nan", "nan")
        _write_eval(folder, stage, {"hellaswag": {"n": int(n), "acc": float(acc), "acc_norm": float(norm)}})
        return
    if stage.kind != "eval_chat":
        return
    kinds: dict[str, Any] = {}
    summary: dict[str, float] = {}
    with open(log, encoding="utf-8", errors="replace") as fh:
        for line in fh.read().replace("\r", "\n").splitlines():
            if m := EVAL_LINE.match(line):
                kinds[m.group(1)] = {"exact": float(m.group(2)), "n": int(m.group(3))}
                if m.group(4) is not None:
                    kinds[m.group(1)]["tool_calls"] = float(m.group(4))
            elif m := END_LINE.match(line):
                summary = {"exact": float(m.group(1)), "ended": float(m.group(2))}
    _write_eval(folder, stage, {"kinds": kinds, "all": summary})


def _write_eval(folder: str, stage: Stage, result: dict[str, Any]) -> None:
    out = os.path.join(folder, stage.folder)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "eval.json"), "w", encoding="utf-8") as fh:
        json.dump({**result, "settings": stage.settings}, fh, indent=1)

"""The kinds of pipeline stage (what each runs, which keys name its inputs, what the pipeline sets itself) and a
stage as a recipe gives it. No torch here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from gptforge.data.options import PrepareArgs
from gptforge.evaluate.options import EvalChatArgs, HellaswagArgs
from gptforge.infer.options import ChatArgs
from gptforge.pipeline.options import TextArgs
from gptforge.rl.options import RLConfig
from gptforge.tokenizer.options import TokenizerTrainArgs
from gptforge.weights.options import ExportArgs

MODELS = ("train", "rl")


@dataclass(frozen=True)
class Kind:
    """What a kind of stage runs: its settings class, the keys naming input stages (and the kinds they may name),
    the settings the pipeline sets itself, and whether an interrupted run continues (else it starts again)."""

    options: type | None  # None: train's settings (core/config.py)
    inputs: dict[str, tuple[str, ...]]
    fixed: tuple[str, ...]
    resumes: bool = False
    config_file: bool = False  # takes `config = "FILE"`: a config file of its command, the stage's keys on top
    outside: tuple[str, ...] = ()  # input keys that may be left out or name something else (gpt2, a folder)
    own: tuple[str, ...] = ()  # keys the pipeline reads itself (chat's prompts), not its command


KINDS = {
    "text": Kind(TextArgs, {}, ()),
    "tokenizer": Kind(TokenizerTrainArgs, {"text": ("text",)}, ("files", "name", "force")),
    "prepare_text": Kind(  # the texts of a text stage, or one of prepare's recipes (recipe = "fineweb_edu")
        PrepareArgs,
        {"text": ("text",), "tokenizer": ("tokenizer",)},
        ("files", "name", "data_dir"),
        outside=("text", "tokenizer"),
    ),
    "prepare_chat": Kind(
        PrepareArgs, {"tokenizer": ("tokenizer",)}, ("recipe", "name", "data_dir"), outside=("tokenizer",)
    ),
    "train": Kind(
        None,
        {"dataset": ("prepare_text", "prepare_chat"), "init_from": MODELS},
        ("resume",),
        resumes=True,
        config_file=True,
        outside=("init_from",),
    ),
    "rl": Kind(RLConfig, {"init_from": MODELS}, (), resumes=True, config_file=True, outside=("init_from",)),
    "eval_chat": Kind(EvalChatArgs, {"model": MODELS}, ("out_dir", "ckpt", "init_from")),
    "eval_hellaswag": Kind(HellaswagArgs, {"model": MODELS}, ("out_dir", "ckpt", "init_from")),
    "export": Kind(ExportArgs, {"model": MODELS}, ("out_dir", "ckpt")),
    "chat": Kind(ChatArgs, {"model": MODELS}, ("out_dir", "ckpt", "init_from", "prompt"), own=("prompts",)),
}
RESERVED = ("logs", "text", "tokenizers", "data", "report.md", "pipeline.json")  # the pipeline's own names


@dataclass(frozen=True)
class Stage:
    name: str
    kind: str
    settings: dict[str, Any]  # the command's own settings (inputs and the pipeline's keys not among them)
    inputs: dict[str, str]  # key -> the input stage's name
    minutes: float
    config: str | None  # a config file's absolute path (train, rl)
    line: int  # the table's line in the recipe

    @property
    def folder(self) -> str:
        """Where its output goes, relative to the pipeline folder."""
        sub = {"text": "text", "tokenizer": "tokenizers", "prepare_text": "data", "prepare_chat": "data"}
        where = self.settings.get("out_dir") if self.kind in MODELS else None
        return os.path.normpath(where or os.path.join(sub.get(self.kind, ""), self.name))

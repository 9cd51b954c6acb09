"""The options of every command that reads a model (sample, chat, serve, eval, export): where the model comes from
(`run_folder`, `checkpoint_file`, `model_source`: weights/load.py's load_model reads them) and the device it runs
on; and `gptforge export`'s options. Each is written once (default, type, allowed values, help text) and the
command lines are built from them (cli/parsers.py). No torch here, so --help stays instant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptforge.core.config import DTYPE_CHOICES
from gptforge.core.settings import REQUIRED, setting

SOURCE_HELP = (
    "'resume' (the run in --out_dir), a GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a local Hugging Face "
    "folder (GPT-2 or NanoChat, e.g. one `gptforge export` wrote), or a GGUF file `gptforge export` wrote (NAME.gguf)"
)
DTYPE_HELP = (
    "autocast dtype (auto: bf16/fp16 on CUDA; on a CPU bf16 where the hardware has it, AMX or AVX512-BF16, for "
    "models 256 wide or more; else float32)"
)


def run_folder(doc: str = "run folder holding ckpt.pt") -> Any:
    """--out_dir: the run whose ckpt.pt a command reads."""
    return setting("out", doc)


def checkpoint_file(verb: str = "read") -> Any:
    """--ckpt: another checkpoint file of the run."""
    doc = f"a checkpoint file to {verb} instead of <out_dir>/ckpt.pt (e.g. out/model_05000.pt)"
    return setting(None, doc, metavar="PATH")


def model_source() -> Any:
    """--init_from: the run, GPT-2's weights or a Hugging Face folder."""
    return setting("resume", SOURCE_HELP)


def device_setting() -> Any:
    return setting("auto", "cpu, cuda, cuda:N, mps or auto")


def dtype_setting() -> Any:
    return setting("auto", DTYPE_HELP, choices=DTYPE_CHOICES)


@dataclass(frozen=True, kw_only=True)
class ExportArgs:
    out_dir: str = run_folder()
    ckpt: str | None = checkpoint_file("export")
    to: str = setting(
        REQUIRED,
        "the Hugging Face folder to create (it may exist if empty), or a file NAME.gguf: one GGUF file for llama.cpp, "
        "Ollama and LM Studio, with NAME.Modelfile beside it",
        metavar="FOLDER|NAME.gguf",
    )
    outtype: str = setting(
        "f16",
        "a GGUF file's weights: f32, f16, bf16 or q8_0 (norms and biases stay f32)",
        choices=("f32", "f16", "bf16", "q8_0"),
    )
    force: bool = setting(False, "replace a previous export at --to")

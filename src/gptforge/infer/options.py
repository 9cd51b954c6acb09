"""`gptforge sample`'s options, written once: each field carries its default, help text and check, and the
command line is built from them (cli/args.py). No torch here, so `gptforge --help` stays instant."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gptforge.core.settings import positive, setting

WINDOWS = ("slide", "half", "stream")  # the context once a sample outgrows block_size; the first is nanoGPT's


def _temperature(value: float) -> str | None:
    return "must be a finite number >= 0 (0 = greedy)" if not 0.0 <= value < math.inf else None


def _top_k(value: int) -> str | None:
    return "must not be negative (0 = all tokens)" if value < 0 else None


def _top_p(value: float) -> str | None:
    return "must be in (0, 1] (1 = off)" if not 0.0 < value <= 1.0 else None


def _window(value: str) -> str | None:
    return f"must be one of {', '.join(WINDOWS)}" if value not in WINDOWS else None


SOURCE_HELP = (
    "'resume' (the run in --out_dir), a GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), or a local Hugging Face "
    "folder (GPT-2 or NanoChat, e.g. one `gptforge export` wrote)"
)
DTYPE_HELP = (
    "autocast dtype (auto: bf16/fp16 on CUDA; on a CPU bf16 where the hardware has it, AMX or AVX512-BF16, for "
    "models 256 wide or more; else float32)"
)


@dataclass
class SampleArgs:
    out_dir: str = setting("out", "run folder holding ckpt.pt")
    init_from: str = setting("resume", SOURCE_HELP)
    ckpt: str | None = setting(None, "a checkpoint file to read instead of <out_dir>/ckpt.pt (e.g. out/model_05000.pt)")
    start: str = setting("\n", "prompt text, or FILE:path to read it from a file (default: a newline)")
    num_samples: int = setting(10, "samples to draw", positive)
    max_new_tokens: int = setting(500, "tokens generated per sample", positive)
    temperature: float = setting(0.8, "< 1 sharper, > 1 more random, 0 greedy", _temperature)
    top_k: int = setting(200, "sample from the k likeliest tokens only (0 = all)", _top_k)
    top_p: float = setting(
        1.0, "sample from the smallest set of tokens holding this much probability (1 = off)", _top_p
    )
    stop_token: int = setting(-1, "end a sample when this token id comes (GPT-2's <|endoftext|> is 50256; -1 = never)")
    seed: int = setting(1337, "random seed: the same seed gives the same samples")
    device: str = setting("auto", "cpu, cuda, cuda:N, mps or auto")
    dtype: str = setting("auto", DTYPE_HELP)
    use_cache: bool = setting(
        True,
        "recompute the whole context at every token instead of using the KV cache (default: the cache is on); the "
        "same tokens, only slower",
    )
    window: str = setting(
        "slide",
        "the context once a sample outgrows the model's block_size: 'slide' = the last block_size tokens at every "
        "step, as nanoGPT's sample.py (one full pass per token); 'half' = restart from the last block_size/2 tokens "
        "and grow again with the KV cache (faster on long samples; a shorter context, so other text); 'stream' "
        "(rotary models) = the KV cache drops its oldest token and keeps going, one cached step per token "
        "(sliding-window attention: other text than 'slide')",
        _window,
    )


COMPILE_CHOICES = ("auto", "on", "off")
COMPILE_HELP = (
    "compile the one-token decode step (torch.compile, once at start: seconds) for more tokens/s: on, off, or auto "
    "(on where a C++ compiler, or Triton on CUDA, is there; a failure falls back to eager, and says so)"
)


def _compile(value: str) -> str | None:
    return f"must be one of {', '.join(COMPILE_CHOICES)}" if value not in COMPILE_CHOICES else None


def _penalty(value: float) -> str | None:
    return "must be a positive number (1 = off; 1.1-1.3 discourages repeating)" if not 0.0 < value < math.inf else None


@dataclass
class ChatArgs:
    """`gptforge chat`'s options: sample's where they mean the same, and the conversation's own."""

    out_dir: str = setting("out", "run folder holding ckpt.pt")
    init_from: str = setting("resume", SOURCE_HELP)
    ckpt: str | None = setting(None, "a checkpoint file to read instead of <out_dir>/ckpt.pt (e.g. out/model_05000.pt)")
    system: str | None = setting(None, "the system message (a chat model's instructions), e.g. 'Answer briefly.'")
    prompt: str | None = setting(None, "answer this one message, print the answer to stdout and exit")
    max_new_tokens: int = setting(512, "the longest answer, in tokens", positive)
    temperature: float = setting(
        0.6, "< 1 sharper, > 1 more random, 0 greedy (the same answer every time)", _temperature
    )
    top_k: int = setting(50, "sample from the k likeliest tokens only (0 = all)", _top_k)
    top_p: float = setting(
        1.0, "sample from the smallest set of tokens holding this much probability (1 = off)", _top_p
    )
    repetition_penalty: float = setting(
        1.0, "divide the logits of tokens already in the conversation by this", _penalty
    )
    stop: list[str] | None = setting(None, "end an answer where this text appears (not shown); repeat for several")
    seed: int = setting(1337, "random seed: the same seed, settings and conversation give the same answers")
    device: str = setting("auto", "cpu, cuda, cuda:N, mps or auto")
    dtype: str = setting("auto", DTYPE_HELP)
    compile: str = setting("off", COMPILE_HELP + "; chat's default is off: it starts at once", _compile)

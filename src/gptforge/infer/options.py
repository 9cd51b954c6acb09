"""The options of `gptforge sample`, `chat` and `serve`, each written once: a field carries its default, type,
allowed values, help text and check, and the command line is built from them (cli/parsers.py); each command takes
its options object. No torch here, so `gptforge --help` stays instant."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gptforge.core.settings import positive, setting
from gptforge.weights.options import checkpoint_file, device_setting, dtype_setting, model_source, run_folder

WINDOWS = ("slide", "half", "stream")  # the context once a sample outgrows block_size; the first is nanoGPT's
COMPILE_CHOICES = ("auto", "on", "off")
COMPILE_HELP = (
    "compile the one-token decode step (torch.compile, once at start: seconds) for more tokens/s: on, off, or auto "
    "(on where a C++ compiler, or Triton on CUDA, is there; a failure falls back to eager, and says so)"
)

TOOL_CHOICES = ("calculator", "none")  # --tools: the built-in tools the engine runs (chat/tools.py BUILTIN)
TOOLS_HELP = (
    "the built-in tool the engine runs when the model calls it: calculator, or none (a call gets an error back)"
)


def _temperature(value: float) -> str | None:
    return "must be a finite number >= 0 (0 = greedy)" if not 0.0 <= value < math.inf else None


def _top_k(value: int) -> str | None:
    return "must not be negative (0 = all tokens)" if value < 0 else None


def _top_p(value: float) -> str | None:
    return "must be in (0, 1] (1 = off)" if not 0.0 < value <= 1.0 else None


def _penalty(value: float) -> str | None:
    return "must be a positive number (1 = off; 1.1-1.3 discourages repeating)" if not 0.0 < value < math.inf else None


@dataclass(frozen=True, kw_only=True)
class SampleArgs:
    """`gptforge sample`'s options."""

    out_dir: str = run_folder()
    init_from: str = model_source()
    ckpt: str | None = checkpoint_file()
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
    device: str = device_setting()
    dtype: str = dtype_setting()
    use_cache: bool = setting(
        True,
        "recompute the whole context at every token instead of using the KV cache (default: the cache is on); the "
        "same tokens, only slower",
        flags=("--no_cache",),
    )
    window: str = setting(
        "slide",
        "the context once a sample outgrows the model's block_size: 'slide' = the last block_size tokens at every "
        "step, as nanoGPT's sample.py (one full pass per token); 'half' = restart from the last block_size/2 tokens "
        "and grow again with the KV cache (faster on long samples; a shorter context, so other text); 'stream' "
        "(rotary models) = the KV cache drops its oldest token and keeps going, one cached step per token "
        "(sliding-window attention: other text than 'slide')",
        choices=WINDOWS,
    )


@dataclass(kw_only=True)
class ChatArgs:
    """`gptforge chat`'s options: sample's where they mean the same, and the conversation's own. Not frozen: the
    chat's /temperature, /top_p and /system commands change them."""

    out_dir: str = run_folder()
    init_from: str = model_source()
    ckpt: str | None = checkpoint_file()
    system: str | None = setting(
        None, "the system message (a chat model's instructions), e.g. 'Answer briefly.'", metavar="TEXT"
    )
    prompt: str | None = setting(
        None, "answer this one message, print the answer to stdout and exit", flags=("-p", "--prompt"), metavar="TEXT"
    )
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
    stop: list[str] | None = setting(
        None, "end an answer where this text appears (not shown); repeat for several", metavar="TEXT"
    )
    seed: int = setting(1337, "random seed: the same seed, settings and conversation give the same answers")
    device: str = device_setting()
    dtype: str = dtype_setting()
    compile: str = setting("off", COMPILE_HELP + "; chat's default is off: it starts at once", choices=COMPILE_CHOICES)
    tools: str = setting("calculator", TOOLS_HELP, choices=TOOL_CHOICES)


@dataclass(frozen=True, kw_only=True)
class ServeArgs:
    """`gptforge serve`'s options; infer/serve_options.py checks them (each mistake naming its flag) before the
    model loads."""

    out_dir: str = run_folder()
    ckpt: str | None = checkpoint_file("serve")
    init_from: str = model_source()
    host: str = setting("127.0.0.1", "address to listen on; 0.0.0.0 lets other machines in (set --api_key then)")
    port: int = setting(8000, "port to listen on; 0 picks a free one")
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' (the OpenAI clients' api_key) on every API call",
        metavar="KEY",
    )
    name: str | None = setting(None, "the model's id in the API (default: the run folder's name)")
    max_batch: int = setting(16, "rows (requests x n) in one model step; more wait")
    max_tokens: int = setting(0, "the most tokens a request may ask for (default 0: the model's context)")
    max_body_mb: float = setting(1.0, "the largest request body, in MiB", finite=False)
    max_messages: int = setting(256, "the most messages in one chat request")
    compile: str = setting("auto", COMPILE_HELP, choices=COMPILE_CHOICES)
    device: str = device_setting()
    dtype: str = dtype_setting()
    tools: str = setting("calculator", TOOLS_HELP, choices=TOOL_CHOICES)

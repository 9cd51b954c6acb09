"""Measuring a chat model: the synthetic tasks' exact-match accuracy on held-out problems, answered greedily through
the generation engine until the assistant's end token (its loss on the assistant's tokens: evaluate/loss.py)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from gptforge.chat.render import chat_special_ids, render_prompt
from gptforge.chat.synthetic import ALL_KINDS, KINDS, generate, score
from gptforge.chat.tools import EXAMPLE_FUNCTIONS
from gptforge.core.distributed import DistEnv
from gptforge.infer.engine import generate as generate_tokens
from gptforge.infer.toolcalls import CallWatcher, builtin_tools, greedy_answer
from gptforge.model.cache import evaluating
from gptforge.tokenizer.spec import from_spec, tokenizer_spec
from gptforge.tokenizer.specials import role_tokens


def chat_task(examples: int, env: DistEnv, meta: dict[str, Any]) -> Callable[..., dict[str, Any]] | None:
    """The synthetic tasks' accuracy during SFT (rank 0), when the chat dataset holds them and examples > 0 (train's
    chat_eval_examples): held-out problems (never trained on), the same ones at every evaluation."""
    if examples <= 0 or "synthetic" not in (meta.get("sources") or {}):
        return None
    tokenizer = from_spec(tokenizer_spec(meta))
    kinds = meta.get("synthetic_kinds") or KINDS  # the kinds the dataset was made with (older ones: the default 8)
    tools = meta.get("synthetic_tools") or "none"
    problems = generate(examples, meta.get("seed", 0), "held_out", kinds=kinds, tools=tools)
    runs = builtin_tools(tools) if tools != "none" else None
    return functools.partial(task_accuracy, tokenizer=tokenizer, examples=problems, device=env.device, tools=runs)


@torch.no_grad()
def task_accuracy(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: list[Any],
    device: str,
    ctx: contextlib.AbstractContextManager | None = None,
    max_new_tokens: int = 128,  # a function call alone can take ~60 tokens of a small vocabulary
    bar: Any = None,
    tools: frozenset[str] | None = None,
) -> dict[str, Any]:
    """Exact match of greedy answers per task kind and overall, and the share of answers that ended with the
    assistant's end token (rather than running to max_new_tokens or the context's end). tools: the built-in tools
    the engine runs (infer/toolcalls.py; the text after the last tool output is scored, and the share of answers
    that called a tool is counted per kind); None: plain generation, no calls watched."""
    special_ids = chat_special_ids(tokenizer)
    end = special_ids[role_tokens("assistant")[1]]
    right: dict[str, list[bool]] = {}
    called: dict[str, list[bool]] = {}
    ended = 0
    with evaluating(model):
        for example in examples:
            prompt = render_prompt(example.prompt, tokenizer, special_ids, tools=example.tools)
            room = model.config.block_size - len(prompt)
            if room <= 0:
                right.setdefault(example.kind, []).append(False)
                called.setdefault(example.kind, []).append(False)
                continue
            with ctx or contextlib.nullcontext():
                answer, done, calls = _answer(model, tokenizer, prompt, min(max_new_tokens, room), end, device, tools)
            ended += done
            right.setdefault(example.kind, []).append(score(example, tokenizer.decode(answer)))
            called.setdefault(example.kind, []).append(calls > 0)
            if bar is not None:
                bar.update(1)
    result: dict[str, Any] = {"acc": sum(sum(v) for v in right.values()) / len(examples), "n": len(examples)}
    result.update({f"acc_{k}": sum(v) / len(v) for k in ALL_KINDS if (v := right.get(k))})
    if tools is not None:
        result.update({f"calls_{k}": sum(v) / len(v) for k in ALL_KINDS if (v := called.get(k))})
    result["ended"] = ended / len(examples)
    return result


def _answer(model, tokenizer, prompt, max_new_tokens, end, device, tools) -> tuple[list[int], bool, int]:
    """(the answer's scored tokens, whether it ended with `end`, how many tool calls it made)."""
    if tools is None:
        idx = torch.tensor([prompt], device=device)
        out = generate_tokens(model, idx, max_new_tokens, temperature=0, stop_token=end)
        answer = out[0, len(prompt) :].tolist()
        return (answer[: answer.index(end)] if end in answer else answer), end in answer, 0
    runners = {name: run for name, (_, run) in EXAMPLE_FUNCTIONS.items()}  # the synthetic functions: run here
    watcher = CallWatcher(chat_special_ids(tokenizer), tokenizer.decode, tokenizer.encode, tools, runners=runners)
    text, done = greedy_answer(model, prompt, max_new_tokens, end, watcher)
    return text, done, len(watcher.calls)


def eval_chat(
    out_dir: str,
    ckpt: str | None,
    init_from: str,
    kinds: str,
    examples: int,
    max_new_tokens: int,
    seed: int,
    device: str,
    dtype: str,
    tools: str,
) -> dict[str, Any]:
    """`gptforge eval chat`: a chat model answers `examples` held-out problems of each synthetic task kind greedily
    (problems no synthetic training set holds, whatever its seed); prints the exact match per kind, overall, and
    the share of answers that ended with the assistant's end token."""
    from gptforge.core.console import log, progress
    from gptforge.core.errors import UserError
    from gptforge.infer.chat_model import load_for_inference

    chosen = [k for k in kinds.split(",") if k]
    unknown = [k for k in chosen if k not in ALL_KINDS]
    if unknown or not chosen:
        raise UserError(f"--kinds {kinds!r}: unknown kind(s) {unknown or '(none)'}; choose from {','.join(ALL_KINDS)}")
    for flag, value in (("--examples", examples), ("--max_new_tokens", max_new_tokens)):
        if value <= 0:
            raise UserError(f"{flag} {value}: give a positive number")
    loaded = load_for_inference(out_dir, ckpt, init_from, device, dtype)
    if not loaded.chat:
        raise UserError(f"{loaded.name} is a base model: eval chat needs a chat model (gptforge train --task=sft)")
    log(loaded.describe())
    problems = generate(examples * len(chosen), seed, "held_out", kinds=chosen)
    bar = progress(len(problems), "eval chat", "ex", mininterval=2.0)
    runs = builtin_tools(tools)
    result = task_accuracy(
        loaded.model, loaded.tokenizer, problems, loaded.device, loaded.autocast(), max_new_tokens, bar, runs
    )
    bar.close()
    for kind in chosen:
        share = f", tool calls {result[f'calls_{kind}']:.3f}"
        print(f"{kind:<8} exact match {result[f'acc_{kind}']:.3f} ({examples} held-out problems){share}")
    print(f"{'all':<8} exact match {result['acc']:.3f}; answers ending with the end token {result['ended']:.3f}")
    return result

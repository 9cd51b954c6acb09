"""Measuring a chat model: the synthetic tasks' exact-match accuracy on held-out problems, answered greedily through
the generation engine until the assistant's end token (its loss on the assistant's tokens: evaluate/loss.py)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gptforge.chat.render import render_prompt
from gptforge.chat.synthetic import ALL_KINDS, KINDS, generate, score
from gptforge.chat.tools import EXAMPLE_FUNCTIONS
from gptforge.core.distributed import DistEnv
from gptforge.infer.batcher import Batcher, Request
from gptforge.infer.chat_model import in_memory
from gptforge.infer.function_calling import ToolPlan
from gptforge.infer.sampling import SamplingParams
from gptforge.infer.toolcalls import CallWatcher, builtin_tools, scored_tokens
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
    """Exact match of greedy answers per task kind and overall (greedy_answers: all the problems batched), and the
    share of answers that ended with the assistant's end token (rather than running to max_new_tokens or the
    context's end). tools: the built-in tools the engine runs (infer/toolcalls.py; the text after the last tool
    output is scored, and the share of answers that called a tool is counted per kind); None: plain generation, no
    calls watched."""
    lm = in_memory(model, tokenizer, device, "float32", "eval", chat=True)  # float32: ctx, the caller's, applies
    prompts = [render_prompt(e.prompt, tokenizer, lm.special_ids, tools=e.tools) for e in examples]
    fits = [i for i, p in enumerate(prompts) if len(p) < lm.block_size]  # a prompt that fills the context scores 0
    with evaluating(model), ctx or contextlib.nullcontext():
        written = greedy_answers(lm, [prompts[i] for i in fits], max_new_tokens, tools, bar)
    answers = dict(zip(fits, written, strict=True))
    right: dict[str, list[bool]] = {}
    called: dict[str, list[bool]] = {}
    for i, example in enumerate(examples):
        answer, _, calls = answers.get(i, (None, False, 0))
        right.setdefault(example.kind, []).append(answer is not None and score(example, tokenizer.decode(answer)))
        called.setdefault(example.kind, []).append(calls > 0)
    result: dict[str, Any] = {"acc": sum(sum(v) for v in right.values()) / len(examples), "n": len(examples)}
    result.update({f"acc_{k}": sum(v) / len(v) for k in ALL_KINDS if (v := right.get(k))})
    if tools is not None:
        result.update({f"calls_{k}": sum(v) / len(v) for k in ALL_KINDS if (v := called.get(k))})
    result["ended"] = sum(a[1] for a in answers.values()) / len(examples)
    return result


CACHE_BYTES = 1 << 30  # the batched answers' KV cache at most: 64 rows of a small model, 14 of GPT-2 124M's


@dataclass
class _RunHere(ToolPlan):
    """eval chat plays the client: the engine runs the synthetic tasks' functions (convert_length) as its own."""

    watchers: list[CallWatcher] = field(default_factory=list)

    def watcher(self, lm, builtins):
        watcher = super().watcher(lm, builtins)
        watcher.runners = {name: run for name, (_, run) in EXAMPLE_FUNCTIONS.items()}
        self.watchers.append(watcher)
        return watcher


@torch.no_grad()
def greedy_answers(lm, prompts: list[list[int]], max_new_tokens: int, tools: frozenset[str] | None, bar=None):
    """Each prompt's greedy answer, the prompts batched by the serving engine (infer/batcher.py; up to 64 rows a
    step, fewer where their cache would pass CACHE_BYTES): (its scored tokens: with tools, the text after the last
    call, without, all it wrote; whether it ended with the assistant's end token; how many calls it made).
    max_new_tokens counts what the model writes, calls included (not the tools' outputs). Run under the caller's
    autocast."""
    end = lm.special_ids[role_tokens("assistant")[1]]
    rows = max(1, min(64, len(prompts), CACHE_BYTES // lm.cache_row_bytes))  # lm: float32, the most a row takes
    batcher = Batcher(lm, max_batch=rows, thread=False, tools=tools or frozenset())
    tokens: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    plans = [_RunHere() if tools is not None else None for _ in prompts]
    failed: list[str] = []

    def emit(i: int, event) -> None:
        if event.kind == "token" and event.token is not None:
            tokens[i].append(event.token)
        elif event.kind == "done":
            ended[i] = event.finish == "stop" and event.choice is not None and event.choice.token == end
            if bar is not None:
                bar.update(1)
        elif event.kind == "error":
            failed.append(event.text)

    for i, prompt in enumerate(prompts):
        room = lm.block_size - len(prompt)
        params = SamplingParams(temperature=0.0)
        request = Request([prompt], params, min(max_new_tokens, room), functools.partial(emit, i), plan=plans[i])
        batcher.submit(request)
    batcher.close()
    batcher.run()
    if failed:
        raise RuntimeError(failed[0])
    out = []
    for i, plan in enumerate(plans):
        scored = scored_tokens(tokens[i], lm.special_ids) if plan is not None else tokens[i]
        out.append((scored, ended[i], sum(len(w.calls) for w in plan.watchers) if plan is not None else 0))
    return out


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

"""OpenAI's HTTP API without the HTTP: a request body checked and turned into a batcher Request, and the events of
its choices turned into OpenAI's response objects and stream chunks. Every mistake in a request is an ApiError,
which serve answers with OpenAI's error JSON ({"error": {"message", "type", "param", "code"}}) and a 4xx status.

Supported: /v1/chat/completions (messages, temperature, top_p, max_tokens / max_completion_tokens, stop, n, seed,
stream + stream_options.include_usage, logprobs + top_logprobs, frequency_penalty, presence_penalty) and
/v1/completions (prompt as text, token ids or a list of either, echo, logprobs including the prompt's with echo, the
same sampling options); gptforge's own extras top_k and repetition_penalty, and vLLM's ignore_eos. A parameter that
would change the answer but is not applied (UNAPPLIED: response_format, logit_bias, ...) is refused. Function calling
(tools, tool_choice, tool messages): infer/function_calling.py."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gptforge.infer.api_error import ApiError
from gptforge.infer.batcher import Event
from gptforge.infer.chat_model import LoadedModel
from gptforge.infer.function_calling import (
    ToolPlan,
    call_deltas,
    plain_message,
    tools_prompt,
    uses_tools,
)
from gptforge.infer.sampling import SamplingParams
from gptforge.infer.toolcalls import ToolCall


@dataclass
class Limits:
    max_body: int = 1 << 20  # bytes of JSON
    max_messages: int = 256
    max_tokens: int = 0  # 0: the model's context
    max_n: int = 8
    max_prompts: int = 32


@dataclass
class Parsed:
    chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    max_tokens: int
    n: int
    stop: list[str]
    stream: bool
    include_usage: bool
    echo: bool = False
    prompt_texts: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    plan: ToolPlan | None = None  # a chat request's tools (infer/function_calling.py)

    @property
    def rows(self) -> int:
        return self.n * len(self.prompts)


def _nothing(value: Any) -> bool:
    return not value  # false, 0, "", [], {}: what clients send to ask for nothing (LangChain: logit_bias {})


_FUNCTIONS = (
    "gptforge takes function calling as 'tools' and 'tool_choice', not the legacy 'functions' / 'function_call'"
)
_SHAPED = "gptforge does not constrain output to JSON, a schema, a grammar or a list of choices"
# What changes a correct answer but is not applied: answered anyway, a client would take plain text for an answer that
# obeyed it, so it is refused, named. name -> (accepted(value), why; what to do). Null is accepted, as is user etc.
UNAPPLIED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "response_format": (
        lambda v: not v or isinstance(v, dict) and v.get("type") == "text",
        'gptforge does not constrain output to JSON: ask for JSON in the prompt, or send {"type": "text"}',
    ),
    "functions": (_nothing, _FUNCTIONS),
    "function_call": (lambda v: not v or v == "none", _FUNCTIONS),
    "logit_bias": (_nothing, "gptforge does not bias token probabilities; send no logit_bias (or {})"),
    "suffix": (_nothing, "gptforge does not write text to fit before a suffix; send the prompt alone"),
    "best_of": (lambda v: v == 1, "gptforge samples each choice once: best_of must be 1 (n asks for more choices)"),
    "audio": (_nothing, "gptforge answers in text only"),
    "modalities": (lambda v: not v or v == ["text"], 'gptforge answers in text only: modalities ["text"]'),
    "web_search_options": (lambda v: False, "gptforge does not search the web"),
    # vLLM's extras that gptforge lacks (its top_k, repetition_penalty and ignore_eos are applied)
    "min_p": (_nothing, "gptforge has no min_p sampling; use top_p or top_k"),
    "min_tokens": (_nothing, "gptforge does not hold back the end of an answer; use ignore_eos with max_tokens"),
    "use_beam_search": (_nothing, "gptforge samples; it has no beam search"),
    "stop_token_ids": (_nothing, "gptforge stops on strings: give them in 'stop'"),
    "bad_words": (_nothing, "gptforge does not forbid words"),
    "allowed_token_ids": (_nothing, "gptforge does not restrict the tokens it samples"),
    "include_stop_str_in_output": (_nothing, "gptforge leaves the stop string out of the answer"),
    **{key: (_nothing, _SHAPED) for key in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    "structured_outputs": (_nothing, _SHAPED),
}


def _refuse_unapplied(body: dict) -> None:
    for key, (accepted, why) in UNAPPLIED.items():
        if body.get(key) is not None and not accepted(body[key]):
            raise ApiError(400, f"'{key}' is not supported: {why}", key, "unsupported_parameter")


def _get(body: dict, key: str, kinds: tuple, default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__.replace("str", "string").replace("float", "number") for k in kinds)
        raise ApiError(400, f"'{key}' must be {names}, not {type(value).__name__}", key, "invalid_type")
    return value


def _ranged(body: dict, key: str, kinds: tuple, default: Any, low: float, high: float) -> Any:
    value = _get(body, key, kinds, default)
    if isinstance(value, float) and not math.isfinite(value) or not low <= value <= high:
        raise ApiError(400, f"'{key}' is {value}; it must be between {low} and {high}", key, "invalid_value")
    return value


def sampling(body: dict, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=float(_ranged(body, "temperature", (int, float), 1.0, 0.0, 2.0)),
        top_p=float(_ranged(body, "top_p", (int, float), 1.0, 1e-9, 1.0)),
        top_k=int(_ranged(body, "top_k", (int,), 0, 0, 1 << 30)) or None,
        repetition_penalty=float(_ranged(body, "repetition_penalty", (int, float), 1.0, 0.01, 100.0)),
        frequency_penalty=float(_ranged(body, "frequency_penalty", (int, float), 0.0, -2.0, 2.0)),
        presence_penalty=float(_ranged(body, "presence_penalty", (int, float), 0.0, -2.0, 2.0)),
        seed=_get(body, "seed", (int,), None),
        logprobs=logprobs,
    )


def _common(body: dict, lm: LoadedModel, limits: Limits, chat: bool) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_body")
    model = _get(body, "model", (str,), None)
    if model is None:
        raise ApiError(400, "'model' is required: GET /v1/models lists the model served", "model", "missing_model")
    if model != lm.name:
        raise ApiError(
            404, f"the model '{model}' does not exist; this server serves '{lm.name}'", "model", "model_not_found"
        )
    _refuse_unapplied(body)
    cap = limits.max_tokens or lm.block_size
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    key = next((k for k in keys if body.get(k) is not None), keys[-1])
    max_tokens = _get(body, key, (int,), cap if chat else 16)
    if not (0 if not chat else 1) <= max_tokens <= cap:
        raise ApiError(
            400,
            f"'{key}' is {max_tokens}; this server allows 1 to {cap} (the model's context is {lm.block_size} tokens)",
            key,
            "invalid_value",
        )
    n = _ranged(body, "n", (int,), 1, 1, limits.max_n)
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", "stop", "invalid_value")
    options = _get(body, "stream_options", (dict,), {})
    return {
        "max_tokens": max_tokens,
        "n": n,
        "stop": stop,
        "stream": bool(_get(body, "stream", (bool,), False)),
        "include_usage": bool(options.get("include_usage", False)),
        "ignore_eos": bool(_get(body, "ignore_eos", (bool,), False)),
    }


def parse_chat(body: Any, lm: LoadedModel, limits: Limits) -> Parsed:
    common = _common(body, lm, limits, chat=True)
    if not lm.chat:
        raise ApiError(
            400,
            f"'{lm.name}' is a base model (not chat-tuned): it has no chat format; use "
            "/v1/completions, or serve a model fine-tuned on conversations",
            "model",
            "not_a_chat_model",
        )
    messages = _get(body, "messages", (list,), None)
    if not messages:
        raise ApiError(
            400, "'messages' must be a non-empty list of {role, content} objects", "messages", "invalid_value"
        )
    if len(messages) > limits.max_messages:
        raise ApiError(
            400,
            f"{len(messages)} messages; this server takes at most {limits.max_messages}",
            "messages",
            "too_many_messages",
        )
    top = _ranged(body, "top_logprobs", (int,), 0, 0, 20)
    logprobs = top if _get(body, "logprobs", (bool,), False) else None
    if top and logprobs is None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    if uses_tools(body, messages):
        prompt, plan = tools_prompt(body, messages, lm)
    else:
        prompt, plan = lm.chat_prompt([plain_message(m, i) for i, m in enumerate(messages)]), ToolPlan()
    _check_room(len(prompt), lm)
    return Parsed(True, [prompt], sampling(body, logprobs), **common, plan=plan)


def parse_completion(body: Any, lm: LoadedModel, limits: Limits) -> Parsed:
    common = _common(body, lm, limits, chat=False)
    prompt = body.get("prompt")
    items = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    if not items or len(items) > limits.max_prompts:
        raise ApiError(400, f"'prompt' must hold 1 to {limits.max_prompts} prompts", "prompt", "invalid_value")
    prompts, texts = [], []
    for item in items:
        if isinstance(item, str):
            ids = lm.encode(item) or ([lm.tokenizer.eot_token] if lm.tokenizer.eot_token is not None else [])
            texts.append(item)
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            if not all(0 <= t < lm.vocab for t in item):
                raise ApiError(400, f"'prompt' holds a token id outside 0..{lm.vocab - 1}", "prompt", "invalid_value")
            ids = list(item)
            texts.append(lm.text.text(ids))
        else:
            raise ApiError(
                400, "'prompt' must be a string, a list of token ids, or a list of either", "prompt", "invalid_value"
            )
        if not ids:
            raise ApiError(
                400,
                "'prompt' is empty and this model has no end-of-text token to start from",
                "prompt",
                "invalid_value",
            )
        _check_room(len(ids), lm, "prompt")
        prompts.append(ids)
    logprobs = _ranged(body, "logprobs", (int,), -1, -1, 20)
    logprobs = None if logprobs < 0 else logprobs
    echo = bool(_get(body, "echo", (bool,), False))
    parsed = Parsed(False, prompts, sampling(body, logprobs), **common, echo=echo, prompt_texts=texts)
    if parsed.rows > limits.max_prompts:
        raise ApiError(400, f"n x prompts is {parsed.rows}; at most {limits.max_prompts}", "n", "invalid_value")
    return parsed


def _check_room(length: int, lm: LoadedModel, param: str = "messages") -> None:
    if length >= lm.block_size:
        raise ApiError(
            400,
            f"the prompt is {length} tokens; this model's context is {lm.block_size} tokens, so a "
            f"prompt may have at most {lm.block_size - 1}",
            param,
            "context_length_exceeded",
        )


class Collector:
    """A request's events gathered into OpenAI's objects: `chunk(event)` for a stream, `response()` at the end."""

    def __init__(self, parsed: Parsed, lm: LoadedModel):
        self.parsed, self.lm = parsed, lm
        self.chat = parsed.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        count = parsed.rows
        self.texts = [""] * count
        self.finish: list[str | None] = [None] * count
        self.tokens = [0] * count
        self.logprobs: list[list[tuple[int, float | None, list]]] = [[] for _ in range(count)]
        self.calls: list[ToolCall | None] = [None] * count  # a choice that ends calling a client's function
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or all(f is not None for f in self.finish)

    def add(self, event: Event) -> None:
        i = event.index
        if event.kind == "error":
            self.error = event.text
        elif event.kind == "prompt":
            self.logprobs[i] = list(event.logprobs or [])
            if self.parsed.echo:
                self.texts[i] = self.parsed.prompt_texts[i // self.parsed.n]
        elif event.kind == "token":
            self.texts[i] += event.text
            if event.choice is not None and event.choice.logprob is not None:
                self.logprobs[i].append((event.token, event.choice.logprob, event.choice.top or []))
        elif event.kind == "call":
            self.calls[i] = event.call
        elif event.kind == "done":
            self.finish[i], self.tokens[i] = event.finish, event.tokens
            if event.choice is not None and event.choice.logprob is not None and not self.chat:
                self.logprobs[i].append((event.choice.token, event.choice.logprob, event.choice.top or []))

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.parsed.prompts)
        completion = sum(self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.lm.name}

    def response(self) -> dict[str, Any]:
        choices = []
        for i, text in enumerate(self.texts):
            if self.chat and self.calls[i] is not None:
                call = [self.calls[i].openai()]
                choice = {"index": i, "message": {"role": "assistant", "content": text or None, "tool_calls": call}}
            elif self.chat:
                choice = {"index": i, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": i, "text": text}
            choice["logprobs"] = self._logprobs(self.logprobs[i])
            choice["finish_reason"] = self.finish[i]
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": choices, "usage": self.usage()}

    def _logprobs(self, items: list[tuple[int, float | None, list]]) -> dict[str, Any] | None:
        if self.parsed.params.logprobs is None:
            return None
        name = self.lm.text.token
        if self.chat:

            def entry(t, lp):
                return {"token": name(t), "logprob": lp, "bytes": list(self.lm.text.bytes(t))}

            return {
                "content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]} for t, lp, top in items]
            }
        offsets, at = [], 0
        for t, _lp, _top in items:
            offsets.append(at)
            at += len(name(t))
        return {
            "tokens": [name(t) for t, _, _ in items],
            "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [None if lp is None else {name(a): b for a, b in top} for _, lp, top in items],
            "text_offset": offsets,
        }

    def chunks(self, event: Event) -> list[dict[str, Any]]:
        """The stream chunks an event makes (none for most 'prompt' events)."""
        i = event.index
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if event.kind == "prompt":
            if not self.parsed.echo:
                return []
            text = self.parsed.prompt_texts[i // self.parsed.n]
            return [{**self._head(kind), "choices": [self._delta(i, text, self._logprobs(event.logprobs or []))]}]
        if event.kind == "token":
            if not event.text and (event.choice is None or event.choice.logprob is None):
                return []
            items = (
                [(event.token, event.choice.logprob, event.choice.top or [])]
                if event.choice and event.choice.logprob is not None
                else []
            )
            return [{**self._head(kind), "choices": [self._delta(i, event.text, self._logprobs(items))]}]
        if event.kind == "call":
            return [
                {**self._head(kind), "choices": [{"index": i, "delta": d, "logprobs": None, "finish_reason": None}]}
                for d in call_deltas(event.call)
            ]
        if event.kind == "done":
            choice = self._delta(i, "", None)
            choice["finish_reason"] = event.finish
            if self.chat:
                choice["delta"] = {}
            return [{**self._head(kind), "choices": [choice]}]
        return []

    def first_chunks(self) -> list[dict[str, Any]]:
        """A chat stream starts each choice with its role."""
        if not self.chat:
            return []
        head = self._head("chat.completion.chunk")
        return [
            {
                **head,
                "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
            }
            for i in range(len(self.texts))
        ]

    def usage_chunk(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage()}

    def _delta(self, i: int, text: str, logprobs: Any) -> dict[str, Any]:
        if self.chat:
            return {"index": i, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}

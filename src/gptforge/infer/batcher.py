"""Continuous batching for `gptforge serve`: every request's rows share each model step. A thread owns the model;
between two steps it admits waiting requests (each prompt prefilled on its own, its n choices forked from that one
prefill) and drops rows that finished or whose client left, so rows join and leave while the others go on.

SlotCache is the KV cache behind it, speaking the protocol GPT's attention uses (`update(layer, k, v)`, `length`,
`position`, `ring`, `advance`): a fixed number of slots, each row its own length. The live rows sit in slots
0..B-1 (a row that leaves is replaced by the last one), so a step reads the cache as one view, without copies; each
row's new key goes to its own position, and a padding mask hides the keys past each row's length."""

from __future__ import annotations

import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

from gptforge.chat.tools import BUILTIN
from gptforge.core.console import log
from gptforge.infer.chat_model import LoadedModel
from gptforge.infer.function_calling import ToolPlan
from gptforge.infer.sampling import Choice, RowSampler, SamplingParams, choose_rows, top_logprobs
from gptforge.infer.textstream import TextStream
from gptforge.infer.toolcalls import CallWatcher, ToolCall

BUILTINS = frozenset(BUILTIN)


class SlotCache:
    ring = False

    def __init__(self, n_layer: int, slots: int, max_len: int):
        self.n_layer, self.slots, self.max_len = n_layer, slots, max_len
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.position = 0  # GPT reads it only when it is given no positions: prefills, which start at 0
        self.length = 0  # what attention takes as the cached tokens: 0 makes a prefill causal
        self._slot, self._rows, self._lengths, self._width = 0, None, None, 0

    def prefill(self, slot: int, start: int = 0) -> None:
        """The next forward pass is one row's tokens into `slot` from position `start`: its prompt (from 0), or
        what it reads after `start` cached tokens (a tool's output)."""
        self._slot, self._rows, self.length, self.position = slot, None, start, start

    def step(self, lengths: torch.Tensor) -> None:
        """The next forward pass is one token for each of the rows in slots 0..B-1, which hold `lengths` (B,)."""
        self._rows, self._lengths = torch.arange(lengths.numel(), device=lengths.device), lengths
        self._width = int(lengths.max()) + 1
        self.length = self._width - 1

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.k) <= layer:  # allocated on first use, in the dtype attention produces (autocast's)
            _, nh, _, hs = k.shape
            self.k.append(k.new_zeros(self.slots, nh, self.max_len, hs))  # zeros: a compiled step reads all
            self.v.append(v.new_zeros(self.slots, nh, self.max_len, hs))
        K, V = self.k[layer], self.v[layer]
        if self._rows is None:
            s, start, T = self._slot, self.position, k.size(2)
            K[s, :, start : start + T], V[s, :, start : start + T] = k[0], v[0]
            return K[s : s + 1, :, : start + T], V[s : s + 1, :, : start + T]
        K[self._rows, :, self._lengths] = k[:, :, 0]
        V[self._rows, :, self._lengths] = v[:, :, 0]
        B = self._rows.numel()
        return K[:B, :, : self._width], V[:B, :, : self._width]

    def advance(self, T: int) -> None:
        """Each row's length is the batcher's to keep."""

    def copy(self, source: int, target: int, length: int) -> None:
        for K, V in zip(self.k, self.v, strict=True):
            K[target, :, :length] = K[source, :, :length]
            V[target, :, :length] = V[source, :, :length]


@dataclass
class Event:
    """What happens to a request, handed to its `emit` on the batcher's thread. kind 'token': choice `index` got
    `token` (with its Choice) and `text` became showable; 'prompt': the prompt's `logprobs` (echo); 'done': the
    choice ended with `finish` after `tokens` tokens; 'error': the request failed (`text` says why)."""

    kind: str
    index: int = 0
    text: str = ""
    token: int | None = None
    choice: Choice | None = None
    finish: str | None = None
    tokens: int = 0
    logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] | None = None
    call: ToolCall | None = None  # kind 'call': a call to a function the client runs (the choice ends with it)


@dataclass
class Request:
    prompts: list[list[int]]
    params: SamplingParams
    max_tokens: int
    emit: Callable[[Event], None]
    n: int = 1
    stop: list[str] = field(default_factory=list)
    prompt_logprobs: bool = False  # echo with logprobs: every prompt token's log-probability
    ignore_eos: bool = False  # the end tokens do not end the answer (benchmarks: a fixed length)
    cancelled: bool = False
    plan: ToolPlan | None = None  # a chat request's tools: each row's calls watched (infer/function_calling.py)

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n


@dataclass
class Row:
    request: Request
    index: int  # the choice's index in the response: prompt * n + j
    sampler: RowSampler
    stream: TextStream
    length: int  # tokens in the cache
    next_token: int = -1  # sampled, to be fed at the next step
    made: int = 0
    done: bool = False
    watcher: CallWatcher | None = None
    feed: list[int] = field(default_factory=list)  # a tool's output, fed after next_token


class Batcher:
    """The model's loop: `submit(request)`, `cancel(request)`, `close()` (finishes what was submitted first). It runs
    in a thread of its own, or with thread=False in whichever thread calls `run()`: `gptforge serve` runs it in the
    main thread, where torch's OpenMP kernels run at full speed (from other threads a small model's step takes
    longer: docs/lab/2026-11-25-serve.md)."""

    def __init__(self, lm: LoadedModel, max_batch: int = 16, thread: bool = True, tools: frozenset[str] = BUILTINS):
        self.lm, self.max_batch, self.tools = lm, max_batch, tools  # tools: the built-in tools run for chat requests
        self.cache = SlotCache(lm.model.config.n_layer, max_batch, lm.block_size)
        self.rows: list[Row] = []  # rows[i] lives in slot i
        self.waiting: deque[Request] = deque()
        self.cond = threading.Condition()
        self.closing = False
        self.after_step: Callable[[], None] = lambda: None  # after each step's events: serve delivers them then
        self.stats = {"steps": 0, "step_tokens": 0, "prefill_tokens": 0, "requests": 0, "max_rows": 0}
        self.stats.update(tool_calls=0, tool_calls_invalid=0)  # calls the model wrote; arguments unfit for the schema
        self.thread = None
        if thread:
            self.thread = threading.Thread(target=self.run, name="gptforge-batcher", daemon=True)
            self.thread.start()

    def submit(self, request: Request) -> None:
        assert request.rows <= self.max_batch, "the API checks n and the prompts against max_batch"
        with self.cond:
            if self.closing:
                raise RuntimeError("the server is shutting down")
            self.waiting.append(request)
            self.cond.notify()

    def cancel(self, request: Request) -> None:
        """The client left: its rows are dropped before the next step (or it is never started)."""
        request.cancelled = True
        with self.cond:
            self.cond.notify()

    def close(self, timeout: float | None = None) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def snapshot(self) -> dict[str, Any]:
        return {**self.stats, "rows": len(self.rows), "waiting": len(self.waiting)}

    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Serve requests until close() and every submitted request is done, or until `alive()` turns False (checked
        twice a second while idle: the web server's thread died)."""
        with torch.no_grad(), self.lm.autocast():  # autocast is per thread: it is entered here
            while True:
                with self.cond:
                    while not (self.waiting or self.rows or self.closing):
                        if not self.cond.wait(0.5) and not alive():
                            return
                    if self.closing and not self.waiting and not self.rows:
                        return
                    admitted = self._admit()
                for request in admitted:
                    self._guarded([request], lambda r=request: self._start(r))
                self._compact()
                if self.rows:
                    self._guarded({id(r.request): r.request for r in self.rows}.values(), self._step)
                    self._compact()
                self.after_step()

    def _admit(self) -> list[Request]:
        free, out = self.max_batch - len(self.rows), []
        while self.waiting and (self.waiting[0].cancelled or self.waiting[0].rows <= free):
            request = self.waiting.popleft()
            if not request.cancelled:
                out.append(request)
                free -= request.rows
        return out

    def _guarded(self, requests, work: Callable[[], None]) -> None:
        """Run `work`; a failure ends the requests it concerned with an error, and the server goes on."""
        try:
            work()
        except Exception as e:  # a bug or an out-of-memory: said to the clients concerned, logged with its traceback
            log(f"serve: a model step failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            for request in list(requests):
                request.emit(Event("error", text=f"the model failed: {type(e).__name__}: {e}"))
                request.cancelled = True

    def _start(self, request: Request) -> None:
        model, vocab = self.lm.model, self.lm.vocab
        self.stats["requests"] += 1
        for p, prompt in enumerate(request.prompts):
            slot = len(self.rows)
            self.cache.prefill(slot)
            hidden = model.hidden_states(torch.tensor([prompt], device=self.lm.device), cache=self.cache)
            logits = model.logits(hidden[0] if request.prompt_logprobs else hidden[0, -1:]).float()[:, :vocab]
            self.stats["prefill_tokens"] += len(prompt)
            if request.prompt_logprobs:
                info = prompt_logprobs(logits, prompt, request.params.logprobs or 0)
                for j in range(request.n):
                    request.emit(Event("prompt", index=p * request.n + j, logprobs=info))
            for j in range(request.n):
                if j:
                    self.cache.copy(slot, slot + j, len(prompt))
                sampler = RowSampler(_seeded(request.params, j), vocab, self.lm.device, prompt)
                stream = TextStream(self.lm.text.bytes, request.stop)
                row = Row(request, p * request.n + j, sampler, stream, len(prompt))
                row.watcher = request.plan.watcher(self.lm, self.tools) if request.plan is not None else None
                self.rows.append(row)
                if request.max_tokens <= 0:
                    self._finish(row, "length")
                else:
                    self._advance(row, sampler.choose(logits[-1]))
        self.stats["max_rows"] = max(self.stats["max_rows"], len(self.rows))

    def _step(self) -> None:
        while pending := [r for r in self.rows if r.feed and not r.done]:  # a tool's output first, row by row
            for row in pending:
                self._extend(row)
        self._compact()  # the step below reads slots 0..B-1: every row in it live
        rows = list(self.rows)
        if not rows:
            return
        device = self.lm.device
        tokens = torch.tensor([[r.next_token] for r in rows], device=device)  # (B, 1)
        lengths = torch.tensor([r.length for r in rows], device=device)  # (B,)
        if self.lm.decode is not None:  # compiled: every cached key read, the mask made inside
            logits = self.lm.decode(tokens, lengths, self.cache.k, self.cache.v)[:, : self.lm.vocab]
        else:
            mask = None
            if len(rows) > 1:  # each row sees its own keys: those past its length are another row's padding
                mask = (torch.arange(int(lengths.max()) + 1, device=device) <= lengths[:, None])[:, None, None, :]
            self.cache.step(lengths)
            hidden = self.lm.model.hidden_states(tokens, cache=self.cache, positions=lengths[:, None], mask=mask)
            logits = self.lm.model.logits(hidden[:, -1]).float()[:, : self.lm.vocab]  # (B, V)
        self.stats["steps"] += 1
        self.stats["step_tokens"] += len(rows)
        for row in rows:
            row.length += 1
        for row, choice in zip(rows, choose_rows(logits, [r.sampler for r in rows]), strict=True):
            self._advance(row, choice)

    def _advance(self, row: Row, choice: Choice) -> None:
        """A token was sampled for `row`: the stop rule, then the token is shown and queued to be fed (a token of a
        tool call is not shown; a call closed is run, or ends the choice: _call)."""
        token = choice.token
        if token in self.lm.stop_ids and not row.request.ignore_eos:
            self._finish(row, "stop", choice)
            return
        row.made += 1
        watcher = row.watcher
        if watcher is not None and watcher.in_call(token):
            text = row.stream.finish() if token == watcher.start else ""  # the text before the call, whole
            row.request.emit(Event("token", row.index, text, token, choice))
            call = watcher.push(token)
            if call is not None and self._call(row, call):
                return
        else:
            row.request.emit(Event("token", row.index, row.stream.push(token), token, choice))
        if row.stream.stopped:
            self._finish(row, "stop")
        elif row.made >= row.request.max_tokens or row.length + 1 + len(row.feed) > self.lm.block_size:
            self._finish(row, "length")
        else:
            row.next_token = token

    def _call(self, row: Row, call: ToolCall) -> bool:
        """A call closed: the client's function ends the choice (True); a built-in's output is fed next."""
        self.stats["tool_calls"] += 1
        if call.output is None:
            if not row.request.plan.valid(call):
                self.stats["tool_calls_invalid"] += 1
            row.request.emit(Event("call", row.index, call=call))
            self._finish(row, "tool_calls")
            return True
        row.feed = call.feed
        row.stream = TextStream(self.lm.text.bytes, row.request.stop)
        return False

    def _extend(self, row: Row) -> None:
        """Feed a row its sampled token and a tool's output after it, on its own; sample its next token."""
        tokens, row.feed = [row.next_token, *row.feed], []
        self.cache.prefill(self.rows.index(row), row.length)
        hidden = self.lm.model.hidden_states(torch.tensor([tokens], device=self.lm.device), cache=self.cache)
        logits = self.lm.model.logits(hidden[0, -1:]).float()[:, : self.lm.vocab]
        self.stats["prefill_tokens"] += len(tokens)
        row.length += len(tokens)
        self._advance(row, row.sampler.choose(logits[-1]))

    def _finish(self, row: Row, reason: str, choice: Choice | None = None) -> None:
        rest = row.stream.finish()
        if rest:
            row.request.emit(Event("token", row.index, rest))
        row.done = True
        row.request.emit(Event("done", row.index, finish=reason, tokens=row.made, choice=choice))

    def _compact(self) -> None:
        """Drop finished and abandoned rows; the last row moves into each freed slot."""
        i = 0
        while i < len(self.rows):
            if self.rows[i].done or self.rows[i].request.cancelled:
                last = self.rows.pop()
                if i < len(self.rows):
                    self.cache.copy(len(self.rows), i, last.length)
                    self.rows[i] = last
            else:
                i += 1


class Mailbox:
    """Events from the model's thread to the requests' queues on the event loop: those of one model step (a token
    for each row) are posted, then delivered together after the step, with one wake-up of the loop instead of one per
    event (each a write to the loop's pipe, a visible share of a small model's step: docs/lab/2026-11-25-serve.md)."""

    def __init__(self):
        self.loop: Any = None  # the asyncio event loop the queues belong to
        self.lock, self.pending = threading.Lock(), []

    def post(self, queue: Any, event: Event) -> None:
        with self.lock:
            self.pending.append((queue, event))

    def flush(self) -> None:
        if self.pending and self.loop is not None:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, event in pending:
            queue.put_nowait(event)


def _seeded(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of a seeded request draws from seed + j: n choices differ, and each is reproducible."""
    if params.seed is None or j == 0:
        return params
    return SamplingParams(**{**params.__dict__, "seed": params.seed + j})


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], k: int) -> list[tuple[int, float | None, list]]:
    """(token, its log-probability given the tokens before it, the k likeliest there) for every prompt token; the
    first has none. logits (T, V): each position's next-token logits."""
    logp = F.log_softmax(logits[:-1], dim=-1)  # (T - 1, V)
    target = torch.tensor(prompt[1:], device=logits.device)
    picked = logp.gather(1, target[:, None])[:, 0].tolist() if len(prompt) > 1 else []
    out: list[tuple[int, float | None, list]] = [(prompt[0], None, [])]
    for t, value in enumerate(picked):
        out.append((prompt[t + 1], value, top_logprobs(logp[t], k)))
    return out

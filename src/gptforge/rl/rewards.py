"""What an RL run is asked and how it is scored: prompts (the synthetic tasks' training problems, or a JSONL file of
your own, `{"messages": [...], "answer": ...}` a line) and a reward (exact match of the answer, built in; or a
Python function of your own, `--reward=FILE.py:FUNCTION`, called as f(prompt, answer, example) -> float). A reward
that raises or is not a finite number stops the run with the example it was scoring: never a silent zero."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gptforge.chat.conversations import as_dict
from gptforge.chat.synthetic import TaskExample, generate, pseudo_words
from gptforge.core.errors import UserError

Reward = Callable[[list[dict[str, Any]], str, dict[str, Any]], float]


@dataclass
class Prompt:
    """A question to answer: the conversation up to it, and what the reward reads (`example`: the JSONL record, or
    a synthetic problem's kind, key and answer); `tools`: the functions it offers (a synthetic convert problem's)."""

    messages: list[dict[str, Any]]
    example: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return str(self.example.get("kind", "prompts"))


def exact_match(prompt: list[dict[str, Any]], answer: str, example: dict[str, Any]) -> float:
    """1.0 when the answer is the example's answer, whitespace at the ends aside; else 0.0 (eval chat's rule)."""
    return 1.0 if answer.strip() == str(example["answer"]).strip() else 0.0


def synthetic_prompts(n: int, seed: int, split: str, kinds: list[str], words: list[str] | None = None) -> list[Prompt]:
    """n problems of the synthetic kinds in turn (chat/synthetic.py; the same arguments, the same problems)."""
    return [as_prompt(e) for e in generate(n, seed, split, kinds=kinds, words=words or pseudo_words())]


def as_prompt(example: TaskExample) -> Prompt:
    """A synthetic problem as a prompt: its conversation, the functions it offers, its kind, key and answer."""
    fields = {"kind": example.kind, "key": example.key, "answer": example.answer}
    return Prompt([as_dict(m) for m in example.prompt], fields, list(example.tools))


class PromptSource:
    """The prompts of each step, the same for the same (seed, step) whatever happened before (a resumed run draws
    what the uninterrupted one drew): synthetic problems from a seed derived from both, or the file's records in
    an order shuffled once per pass over the file."""

    def __init__(self, kinds: str, path: str, seed: int, held_out: str = ""):
        self.kinds, self.seed = [k for k in kinds.split(",") if k], seed
        self.records = read_prompts(path) if path else None
        self.words = None if path else pseudo_words()
        self.held_out = read_prompts(held_out, "--eval_prompts") if held_out else None  # never trained on

    def step(self, step: int, n: int) -> list[Prompt]:
        if self.records is None:
            return synthetic_prompts(n, self.seed * 1_000_003 + step, "train", self.kinds, self.words)
        out, total = [], len(self.records)
        for i in range(step * n, (step + 1) * n):
            order = list(range(total))
            random.Random(f"gptforge-rl/{self.seed}/{i // total}").shuffle(order)
            out.append(self.records[order[i % total]])
        return out


def read_prompts(path: str, flag: str = "--prompts") -> list[Prompt]:
    """A JSONL file's prompts: each line an object with 'messages' (OpenAI's, ending with the user's turn) and
    the 'answer' the reward compares with (or whatever fields a reward of your own reads)."""
    if not os.path.isfile(path):
        raise UserError(
            f"{flag}={path}: no such file; give a JSONL file, one {{'messages': [...], 'answer': ...}} a line"
        )
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{n}: not JSON ({e})") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise UserError(f"{path}:{n}: needs 'messages', a list of {{'role': ..., 'content': ...}} objects")
            if messages[-1].get("role") != "user":
                raise UserError(f"{path}:{n}: the last message must be the user's: the model answers it")
            out.append(Prompt(messages, {**record, "line": n}))
    if not out:
        raise UserError(f"{flag}={path}: the file holds no prompts")
    return out


def load_reward(spec: str) -> Reward:
    """exact_match for '', else FILE.py:FUNCTION imported from the file."""
    if not spec:
        return exact_match
    path, _, name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise UserError(f"--reward={spec}: no such file {path!r}; give FILE.py:FUNCTION")
    module_spec = importlib.util.spec_from_file_location(f"gptforge_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: any error is theirs to see, with its kind
        raise UserError(f"--reward={spec}: importing {path} failed: {type(e).__name__}: {e}") from None
    finally:
        sys.path.pop(0)
    function = getattr(module, name, None)
    if not callable(function):
        names = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UserError(f"--reward={spec}: {path} has no function {name!r} (it has: {', '.join(names) or 'none'})")
    return function


def check_answers_given(reward: Reward, prompts: list[Prompt], where: str) -> None:
    """The built-in reward compares with each prompt's 'answer': a prompt without one is named before anything runs."""
    if reward is not exact_match:
        return
    for p in prompts:
        if "answer" not in p.example:
            line = p.example.get("line", "?")
            raise UserError(
                f"{where}:{line}: no 'answer' to compare with; add one, or score with --reward=FILE.py:FUNCTION"
            )


def score(reward: Reward, prompt: Prompt, answer: str) -> float:
    """The reward of one answer; a UserError naming the example when it raises or is not a finite number."""
    try:
        value = reward(prompt.messages, answer, prompt.example)
    except Exception as e:  # the user's function: its failure is reported with what it was scoring
        raise UserError(f"the reward raised {type(e).__name__}: {e}\n  scoring {_shown(prompt, answer)}") from None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise UserError(f"the reward returned {value!r}, not a number\n  scoring {_shown(prompt, answer)}") from None
    if not math.isfinite(value):
        raise UserError(f"the reward returned {value}, not a finite number\n  scoring {_shown(prompt, answer)}")
    return value


def _shown(prompt: Prompt, answer: str) -> str:
    question = str(prompt.messages[-1].get("content", ""))[:120]
    where = f" (line {prompt.example['line']})" if "line" in prompt.example else f" ({prompt.kind})"
    return f"the answer {answer[:120]!r} to {question!r}{where}"

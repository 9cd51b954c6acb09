"""Synthetic chat tasks, generated offline and scored exactly: multi-digit arithmetic (3-digit addition is its own
kind, `add3`), spelling a word letter by letter, counting a letter in a word, recalling a code word several turns
later, and following a system instruction; and, on request only (`EXTRA_KINDS`), `doc`: a long note of made-up
words to read and a short question on it, user text unlike any answer (where training on the user's turns costs).
Each example carries its exact answer; `score` is exact match after stripping whitespace at the ends.

Deterministic for a seed. Every problem has a canonical key (e.g. "add:123+456", the same whatever the wording)
whose hash puts it in the train or the held-out split, so no held-out problem is ever trained on, not even as the
filler talk of a recall conversation. Words come from a text (`words_from_text`, e.g. Tiny Shakespeare) or are
made up (`pseudo_words`).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gptforge.chat.calculator import calculate
from gptforge.chat.conversations import Conversation, Message
from gptforge.chat.tools import EXAMPLE_FUNCTIONS, LENGTH_UNITS, call_text
from gptforge.core.errors import UserError

KINDS = ("add3", "add", "sub", "mul", "spell", "count", "recall", "system")  # the default mix: each once
EXTRA_KINDS = ("doc", "convert")  # only when named
ALL_KINDS = KINDS + EXTRA_KINDS
SPLITS = ("train", "held_out")
HELD_OUT_PER_MILLE = 100  # a tenth of all problems is held out
INSTRUCTIONS = {
    "upper": "Answer in uppercase.",
    "lower": "Answer in lowercase.",
    "brackets": "Put your answer in square brackets.",
}


@dataclass
class TaskExample:
    kind: str
    key: str  # the problem itself, whatever its wording: decides its split
    messages: list[Message]  # the whole conversation, ending with the assistant's answer
    answer: str  # exactly what the last assistant message says
    tools: list[dict] = field(default_factory=list)  # the functions the conversation offers (chat/tools.py)

    @property
    def prompt(self) -> list[Message]:
        """The conversation up to the question: what a model is given to answer (any tool call is its to make)."""
        last_user = max(i for i, m in enumerate(self.messages) if m.role == "user")
        return self.messages[: last_user + 1]

    @property
    def calls(self) -> bool:
        """Whether the answer is meant to use a tool (the share that do is scored beside the answers)."""
        return any(m.role == "tool_call" for m in self.messages[len(self.prompt) :])

    def conversation(self) -> Conversation:
        meta = {"kind": self.kind, "answer": self.answer}
        return Conversation(list(self.messages), f"synthetic:{self.kind}", meta, list(self.tools))


def score(example: TaskExample, generated: str) -> bool:
    """Exact match; only whitespace at the ends is ignored."""
    return generated.strip() == example.answer


def split_of(key: str) -> str:
    """'held_out' for HELD_OUT_PER_MILLE of all problem keys, by hash; 'train' for the rest."""
    digest = int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")
    return "held_out" if digest % 1000 < HELD_OUT_PER_MILLE else "train"


def generate(
    n: int,
    seed: int = 0,
    split: str = "train",
    kinds: Sequence[str] = KINDS,
    words: Sequence[str] | None = None,
    tools: str = "none",
) -> list[TaskExample]:
    """n examples of `split`, the kinds in turn; the same arguments always give the same examples. tools=
    'calculator': the arithmetic kinds' answers call the calculator first (with_calculator); the problems and
    their splits are the same either way."""
    if split not in SPLITS:
        raise UserError(f"unknown synthetic split {split!r}; choose {' or '.join(SPLITS)}")
    unknown = [k for k in kinds if k not in MAKERS]
    if unknown or not kinds:
        raise UserError(f"unknown synthetic task kinds {unknown or '(none given)'}; choose from {', '.join(ALL_KINDS)}")
    words = list(words) if words else pseudo_words()
    rng = random.Random(f"gptforge-synthetic/{seed}/{split}")
    examples: list[TaskExample] = []
    while len(examples) < n:
        examples.append(_draw(MAKERS[kinds[len(examples) % len(kinds)]], rng, words, split))
    if tools not in TOOLS:
        raise UserError(f"synthetic tools {tools!r}: choose one of {', '.join(TOOLS)}")
    return [with_calculator(e) for e in examples] if tools == "calculator" else examples


TOOLS = ("none", "calculator")


def with_calculator(example: TaskExample) -> TaskExample:
    """An arithmetic answer that calls the calculator with the problem's expression and gives its output; every
    arithmetic exchange in the conversation (a recall's fillers too) does the same. Other kinds are unchanged:
    the model learns when a call is right and when it is not."""
    messages: list[Message] = []
    for m in example.messages:
        expression = _expression(m.content) if m.role == "user" else None
        messages.append(m)
        if expression is not None:
            call = call_text("calculator", {"expression": expression})
            messages += [
                Message("tool_call", call, call_id="c0"),
                Message("tool_output", calculate(expression), call_id="c0"),
            ]
    return TaskExample(example.kind, example.key, messages, example.answer, example.tools)


ARITH_QUESTION = re.compile(
    r"(?:What is|Compute) (\d+) (?:([-+*])|(plus|minus|times)) (\d+)[?.]|(\d+) ([-+*]) (\d+) = \?"
)


def _expression(question: str) -> str | None:
    """The expression of an arithmetic question as ARITH_WORDING writes it ("What is 12 times 34?" -> "12*34")."""
    match = ARITH_QUESTION.fullmatch(question)
    if match is None:
        return None
    if match.group(5):
        return f"{match.group(5)}{match.group(6)}{match.group(7)}"
    op = match.group(2) or {v: k for k, v in ARITH_NAMES.items()}[match.group(3)]
    return f"{match.group(1)}{op}{match.group(4)}"


def _draw(maker: Callable[..., TaskExample], rng: random.Random, words: list[str], split: str) -> TaskExample:
    for _ in range(10_000):
        example = maker(rng, words, split)
        if split_of(example.key) == split:
            return example
    raise UserError(f"found no {split} problem in 10,000 tries: give more words (a longer text)")


def _exchange(question: str, answer: str) -> list[Message]:
    return [Message("user", question), Message("assistant", answer)]


def _number(rng: random.Random, digits: int) -> int:
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


ARITH_WORDING = {  # {op} is the sign, {name} its word
    op: ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?", "What is {a} {name} {b}?")
    for op in "+-*"
}
ARITH_NAMES = {"+": "plus", "-": "minus", "*": "times"}
ARITH_KEYS = {"+": "add", "-": "sub", "*": "mul"}


def _arithmetic(rng: random.Random, op: str, a: int, b: int, kind: str) -> TaskExample:
    answer = str({"+": a + b, "-": a - b, "*": a * b}[op])
    question = rng.choice(ARITH_WORDING[op]).format(a=a, b=b, op=op, name=ARITH_NAMES[op])
    return TaskExample(kind, f"{ARITH_KEYS[op]}:{a}{op}{b}", _exchange(question, answer), answer)


def _add3(rng: random.Random, words: list[str], split: str) -> TaskExample:
    return _arithmetic(rng, "+", _number(rng, 3), _number(rng, 3), "add3")


def _add(rng: random.Random, words: list[str], split: str) -> TaskExample:
    return _arithmetic(rng, "+", _number(rng, rng.randint(1, 4)), _number(rng, rng.randint(1, 4)), "add")


def _sub(rng: random.Random, words: list[str], split: str) -> TaskExample:
    a, b = sorted((_number(rng, rng.randint(1, 4)), _number(rng, rng.randint(1, 4))), reverse=True)
    return _arithmetic(rng, "-", a, b, "sub")


def _mul(rng: random.Random, words: list[str], split: str) -> TaskExample:
    return _arithmetic(rng, "*", _number(rng, rng.randint(1, 3)), _number(rng, rng.randint(1, 2)), "mul")


def _spell(rng: random.Random, words: list[str], split: str) -> TaskExample:
    word = rng.choice(words)
    question = rng.choice(("Spell the word '{w}' letter by letter.", "How do you spell {w}?", "Spell {w}.")).format(
        w=word
    )
    answer = "-".join(word)
    return TaskExample("spell", f"spell:{word}", _exchange(question, answer), answer)


def _count(rng: random.Random, words: list[str], split: str) -> TaskExample:
    word = rng.choice(words)
    absent = sorted(set("abcdefghijklmnopqrstuvwxyz") - set(word))
    letter = rng.choice(absent) if absent and rng.random() < 0.2 else rng.choice(word)
    question = rng.choice(
        ("How many times does the letter '{c}' appear in '{w}'?", "Count the letter '{c}' in the word '{w}'.")
    ).format(c=letter, w=word)
    answer = str(word.count(letter))
    return TaskExample("count", f"count:{word}:{letter}", _exchange(question, answer), answer)


def _recall(rng: random.Random, words: list[str], split: str) -> TaskExample:
    """Remember a code word, two to four exchanges of other tasks (all of this split), then recall it."""
    code = rng.choice(words)
    opening = rng.choice(("Remember the code word: {w}.", "Please remember this code word: {w}.")).format(w=code)
    fillers = [
        _draw(rng.choice((_add, _sub, _mul, _spell, _count)), rng, words, split) for _ in range(rng.randint(2, 4))
    ]
    question = rng.choice(("What was the code word?", "Which code word did I ask you to remember?"))
    messages = [
        *_exchange(opening, "Okay, I will remember it."),
        *(m for filler in fillers for m in filler.messages),
        *_exchange(question, code),
    ]
    key = f"recall:{code}:" + "|".join(filler.key for filler in fillers)
    return TaskExample("recall", key, messages, code)


def _system(rng: random.Random, words: list[str], split: str) -> TaskExample:
    """A system instruction (uppercase, lowercase, square brackets) and a question whose answer it changes."""
    instruction = rng.choice(sorted(INSTRUCTIONS))
    phrase = " ".join(w.capitalize() if rng.random() < 0.5 else w for w in rng.sample(words, rng.randint(1, 3)))
    word = rng.choice(words)
    question, plain = rng.choice(
        (
            (f"Repeat after me: {phrase}", phrase),
            (f"What is the first letter of the word '{word}'?", word[0]),
            (f"What is the last letter of the word '{word}'?", word[-1]),
        )
    )
    answer = {"upper": plain.upper(), "lower": plain.lower(), "brackets": f"[{plain}]"}[instruction]
    messages = [Message("system", INSTRUCTIONS[instruction]), *_exchange(question, answer)]
    return TaskExample("system", f"system:{instruction}:{question}", messages, answer)


def _doc(rng: random.Random, words: list[str], split: str) -> TaskExample:
    """A note of 40-60 lowercase words (sentences of 5-12) with one word in capitals, and a question: which word
    is in capitals, or which word ends the note. Long user text of a kind the model never writes."""
    picked = [rng.choice(words) for _ in range(rng.randint(40, 60))]
    shout = rng.randrange(len(picked))
    picked[shout] = picked[shout].upper()
    sentences, start = [], 0
    while start < len(picked):
        end = min(len(picked), start + rng.randint(5, 12))
        sentences.append(" ".join(picked[start:end]) + rng.choice((".", ".", ".", ",", ";")))
        start = end
    note = " ".join(sentences)
    question, answer = rng.choice(
        (
            ("Which word in the note is written in capitals?", picked[shout]),
            ("What is the last word of the note?", picked[-1]),
        )
    )
    text = f"Read this note.\n\n{note}\n\n{question}"
    return TaskExample("doc", f"doc:{note}:{question}", _exchange(text, answer), answer)


UNIT_NAMES = {"mm": "millimetres", "cm": "centimetres", "m": "metres", "km": "kilometres"}


def _convert(rng: random.Random, words: list[str], split: str) -> TaskExample:
    """A length to convert with the made-up function convert_length, which the conversation offers: the answer
    calls it and gives its output with the unit (function calling with a result that can be checked)."""
    unit, to = rng.sample(sorted(LENGTH_UNITS), 2)
    value = rng.choice((rng.randint(1, 999), rng.randint(1, 99) + rng.randint(1, 9) / 10))
    question = rng.choice(("How many {to} are {v} {unit}?", "Convert {v} {unit} to {to}.")).format(
        v=value, unit=UNIT_NAMES[unit], to=UNIT_NAMES[to]
    )
    arguments = {"value": value, "from": unit, "to": to}
    output = EXAMPLE_FUNCTIONS["convert_length"][1](arguments)
    answer = f"{output} {to}"
    call = Message("tool_call", call_text("convert_length", arguments), call_id="c0")
    messages = [
        Message("user", question),
        call,
        Message("tool_output", output, call_id="c0"),
        Message("assistant", answer),
    ]
    schema = EXAMPLE_FUNCTIONS["convert_length"][0]
    return TaskExample("convert", f"convert:{value}:{unit}:{to}", messages, answer, [schema])


MAKERS: dict[str, Callable[[random.Random, list[str], str], TaskExample]] = {
    "add3": _add3,
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "spell": _spell,
    "count": _count,
    "recall": _recall,
    "system": _system,
    "doc": _doc,
    "convert": _convert,
}


def words_from_text(text: str, min_count: int = 3, min_len: int = 3, max_len: int = 10) -> list[str]:
    """The lowercase words of a text seen at least min_count times (as lowercase letters only), sorted."""
    counts = Counter(re.findall(r"[a-z]+", text.lower()))
    return sorted(w for w, c in counts.items() if c >= min_count and min_len <= len(w) <= max_len)


def pseudo_words(n: int = 2000, seed: int = 0) -> list[str]:
    """n distinct made-up, pronounceable words of two or three syllables (no text needed), sorted."""
    rng = random.Random(f"gptforge-pseudo-words/{seed}")
    onsets, vowels, codas = "bcdfghjklmnprstvwz", "aeiou", ["", "", "n", "r", "s", "t", "l", "m"]
    found: set[str] = set()
    while len(found) < n:
        syllables = rng.randint(2, 3)
        found.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables)))
    return sorted(found)

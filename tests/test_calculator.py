"""The built-in calculator (chat/calculator.py): values against Python's own arithmetic on exact fractions, hostile
expressions refused within its bounds as "error: ..." text, and random bytes that never raise."""

from __future__ import annotations

import random
import time
from fractions import Fraction

import pytest

from gptforge.chat.calculator import MAX_DIGITS, calculate, written

TABLE = [  # (expression, what the model reads back)
    ("1+2*3", "7"),
    ("-2**2", "-4"),  # ** binds tighter than the sign on its left, as in Python
    ("2**-2", "0.25"),
    ("2**3**2", "512"),  # groups to the right
    ("7/2", "3.5"),
    ("-7//2", "-4"),  # floors
    ("-7%3", "2"),
    ("1/3", "0.3333333333"),
    ("2/3*3", "2"),  # exact arithmetic: no 1.9999999999
    ("0.1+0.2", "0.3"),
    (".5 + .25", "0.75"),
    ("123456789*987654321", "121932631112635269"),
    ("(-1)**10**9", "1"),  # a huge power of 1, 0 or -1 keeps its value
    ("0**0", "1"),
    ("  (12 +  3) ", "15"),
    ("1/30000000000", "3.333333333e-11"),
]
HOSTILE = [  # (expression, the start of the error text)
    ("2**10**9", "error: the result is too large"),
    ("9**9**9", "error: the result is too large"),
    ("10**200", "error: the result is too large"),
    ("2**-600", "error: the result is too large"),
    ("(" * 1000 + "1" + ")" * 1000, "error: the expression is longer"),
    ("(" * 40 + "1" + ")" * 40, "error: more than 32 levels"),
    ("-" * 100 + "1", "error: more than 32 levels"),
    ("1" * 60, f"error: a number has more than {MAX_DIGITS} digits"),
    ("1" * 1_000_000, "error: the expression is longer"),
    ("__import__('os').system('ls')", "error: unexpected '_'"),
    ("(1).__class__", "error: unexpected '.'"),
    ("x+1", "error: unexpected 'x'"),
    ("1e400", "error: unexpected 'e'"),
    ("2**0.5", "error: the exponent must be a whole number"),
    ("1/0", "error: division by zero"),
    ("1//(2-2)", "error: division by zero"),
    ("3%0", "error: division by zero"),
    ("0**-1", "error: division by zero"),
    ("", "error: the expression is empty"),
    ("2*(3", "error: the expression ends too early"),
    ("(1)(2)", "error: unexpected '('"),
    ("1 2", "error: unexpected '2'"),
]


@pytest.mark.parametrize("expression, value", TABLE)
def test_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, error", HOSTILE)
def test_hostile_expressions_are_refused_quickly_as_text(expression, error):
    start = time.perf_counter()
    assert calculate(expression).startswith(error)
    assert time.perf_counter() - start < 0.5


def random_expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 3 or rng.random() < 0.3:
        number = str(rng.randint(0, 10 ** rng.randint(1, 6)))
        return number + (f".{rng.randint(0, 99)}" if rng.random() < 0.2 else "")
    op = rng.choice(["+", "-", "*", "/", "//", "%", "**"])
    left, right = random_expression(rng, depth + 1), random_expression(rng, depth + 1)
    if op == "**":
        right = str(rng.randint(-3, 4))
    text = f"{left} {op} {right}"
    return f"-({text})" if rng.random() < 0.1 else f"({text})"


def test_random_expressions_equal_pythons_arithmetic_on_fractions():
    """Python evaluates the same expression with every number a Fraction (the reference); the calculator's text
    is that value, written."""
    rng = random.Random(0)
    compared = 0
    for _ in range(2000):
        expression = random_expression(rng)
        as_fractions = "".join(
            f"Fraction('{token}')" if token[0].isdigit() else token for token in tokenize(expression)
        )
        try:
            expected = eval(as_fractions, {"Fraction": Fraction})  # the reference, in the test only
        except ZeroDivisionError:
            assert calculate(expression) == "error: division by zero", expression
            continue
        if isinstance(expected, float):  # Python's int (from //) ** a negative int: a float, no exact reference
            continue
        got = calculate(expression)
        if got == "error: the result is too large":
            assert max(expected.numerator.bit_length(), expected.denominator.bit_length()) > 512, expression
            continue
        assert got == written(expected), expression
        compared += 1
    assert compared > 1000


def tokenize(expression: str) -> list[str]:
    import re

    return re.findall(r"\d+\.?\d*|\*\*|//|\S", expression)


def test_random_bytes_never_raise():
    rng = random.Random(1)
    alphabet = "0123456789+-*/%()._ eE,x" * 3 + "".join(map(chr, range(32, 127)))
    for _ in range(3000):
        if rng.random() < 0.5:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        else:
            text = bytes(rng.randrange(256) for _ in range(rng.randint(0, 80))).decode("latin-1")
        result = calculate(text)
        assert isinstance(result, str) and result
    for value in (None, 12, b"1+1", ["1"]):
        assert calculate(value).startswith("error:")

"""The built-in calculator tool: an arithmetic expression in, its value (or a short error text) out.

A model calls it inside its answer and the engine runs it (docs/USAGE.md, "Tools"). The expression is read by a
parser of its own, never Python's eval: integers and decimals, + - * / // % ** (Python's precedence and meaning:
** binds tighter than a unary minus on its left and groups to the right; // and % floor), unary + and -, and
parentheses. Arithmetic is exact (fractions); a result that is not whole is written as a decimal, exactly when it
has at most 10 places, else to 10 significant digits.

Everything is bounded, so no input can take long or grow large: the expression's length, parenthesis and sign
nesting, the digits of every number written and of every value computed, and a power's size before it is
computed. Whatever falls outside (a name, an attribute, an unknown character, a huge power, division by zero) comes
back as one line starting "error:" that the model can read; `calculate` never raises. Standard library only.
"""

from __future__ import annotations

import re
from decimal import Context, Decimal
from fractions import Fraction

MAX_LENGTH = 256  # characters of an expression
MAX_DEPTH = 32  # parentheses and signs nested inside each other
MAX_DIGITS = 40  # digits of a number as written
MAX_BITS = 512  # of a value's numerator and of its denominator (about 154 decimal digits)
DECIMALS = 10  # places written exactly; beyond, significant digits

TOKEN = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|(\*\*|//|[-+*/%()]))")


class CalculatorError(Exception):
    """What the model reads back, after "error: "."""


def calculate(expression: str) -> str:
    """The value of `expression` as text, or "error: ..." saying why there is none."""
    try:
        if not isinstance(expression, str):
            raise CalculatorError("the expression must be text")
        if len(expression) > MAX_LENGTH:
            raise CalculatorError(f"the expression is longer than {MAX_LENGTH} characters")
        return written(Parser(expression).parse())
    except CalculatorError as e:
        return f"error: {e}"
    except (ArithmeticError, ValueError, RecursionError) as e:  # bounds make these unreachable; kept as text
        return f"error: {type(e).__name__}"


def tokens(expression: str) -> list[str]:
    found, at = [], 0
    while at < len(expression):
        match = TOKEN.match(expression, at)
        if match is None:
            rest = expression[at:].lstrip()
            if not rest:
                break
            raise CalculatorError(f"unexpected {rest[0]!r} at position {len(expression) - len(rest)}")
        found.append(match.group(1) or match.group(2))
        at = match.end()
    return found


def checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError("the result is too large")
    return value


def power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("the exponent must be a whole number")
    e = exponent.numerator
    if base == 0 and e < 0:
        raise CalculatorError("division by zero")
    if e == 0 or abs(base) in (0, 1):
        return base ** (e % 2 if e else 0) if base else Fraction(0 if e else 1)
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if (bits - 1) * abs(e) >= MAX_BITS:  # the value would have at least this many bits: refused before computing
        raise CalculatorError("the result is too large")
    return checked(base**e)


def binary(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op == "**":
        return power(a, b)
    if op in ("/", "//", "%") and b == 0:
        raise CalculatorError("division by zero")
    if op == "+":
        return checked(a + b)
    if op == "-":
        return checked(a - b)
    if op == "*":
        return checked(a * b)
    if op == "/":
        return checked(a / b)
    return checked(Fraction(a // b) if op == "//" else a % b)


class Parser:
    """Recursive descent over the tokens: sum := product (+|- product)*, product := signed (*|/|//|% signed)*,
    signed := (+|-) signed | power, power := atom (** signed)?, atom := number | ( sum )."""

    def __init__(self, expression: str):
        self.tokens = tokens(expression)
        self.at = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise CalculatorError("the expression ends too early")
        self.at += 1
        return token

    def parse(self) -> Fraction:
        if not self.tokens:
            raise CalculatorError("the expression is empty")
        value = self.sum()
        if self.peek() is not None:
            raise CalculatorError(f"unexpected {self.peek()!r} after a complete expression")
        return value

    def sum(self) -> Fraction:
        value = self.product()
        while self.peek() in ("+", "-"):
            value = binary(self.take(), value, self.product())
        return value

    def product(self) -> Fraction:
        value = self.signed()
        while self.peek() in ("*", "/", "//", "%"):
            value = binary(self.take(), value, self.signed())
        return value

    def signed(self) -> Fraction:
        if self.peek() in ("+", "-"):
            sign = self.take()
            value = self.nested(self.signed)
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> Fraction:
        value = self.atom()
        if self.peek() == "**":
            self.take()
            value = binary("**", value, self.nested(self.signed))
        return value

    def atom(self) -> Fraction:
        token = self.take()
        if token == "(":
            value = self.nested(self.sum)
            if self.take() != ")":
                raise CalculatorError("a parenthesis is not closed")
            return value
        if token[0].isdigit() or token[0] == ".":
            if sum(c.isdigit() for c in token) > MAX_DIGITS:
                raise CalculatorError(f"a number has more than {MAX_DIGITS} digits")
            return Fraction(token)
        raise CalculatorError(f"unexpected {token!r}")

    def nested(self, rule) -> Fraction:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"more than {MAX_DEPTH} levels of parentheses or signs")
        try:
            return rule()
        finally:
            self.depth -= 1


def written(value: Fraction) -> str:
    """A whole value as an integer; else a decimal, exact to DECIMALS places or to DECIMALS significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = value * 10**DECIMALS
    if scaled.denominator == 1:
        text = f"{Decimal(scaled.numerator).scaleb(-DECIMALS):f}"
        return text.rstrip("0").rstrip(".")
    exact = Context(prec=DECIMALS).divide(Decimal(value.numerator), Decimal(value.denominator))
    text = f"{exact:f}" if abs(exact.adjusted()) < DECIMALS else f"{exact:e}"
    return text.rstrip("0").rstrip(".") if "." in text and "e" not in text else text

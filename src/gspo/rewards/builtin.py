"""Built-in verifiable rewards: `fn(prompt, completion, **row) -> float`, 1.0 for a correct completion, else 0.0.

Each judges the answer only (`after_thinking`): a reasoning model's `<think> … </think>` block is cut off first, and a
completion whose reasoning never ended has no answer (`gspo.rewards.thinking`).

A wrong or malformed completion scores 0.0; it is not an error. Errors (exceptions) are reserved for bad *data*, e.g. a
row without the gold answer, so that `RewardRunner` reports them instead of silently training on zeros.
Model output is never passed to `eval`: countdown expressions go through a small arithmetic parser.

A reward that checks one final answer says which answer a completion gives (`with_answer`): maj@k votes on it
(`gspo.evaluation.evaluate`), so that "115" and "57 + 58 = 115" are one vote, not two.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import Counter
from collections.abc import Callable, Hashable
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, TypeVar

from gspo.rewards.thinking import after_thinking

__all__ = ["addition_reward", "answer_extractor", "countdown_reward", "math_reward", "parse_arithmetic", "with_answer"]

F = TypeVar("F", bound=Callable[..., float])


def with_answer(extract: Callable[[str], Hashable | None]) -> Callable[[F], F]:
    """Mark a reward function with the answer a completion gives (`extract(completion)`, None: no answer), the key
    maj@k votes on when this reward is the accuracy reward::

        @with_answer(lambda completion: completion.strip().split()[-1] if completion.strip() else None)
        def my_reward(prompt, completion, **row): ...

    Without it maj@k votes on the whole whitespace-normalised completion (`gspo.evaluation.vote_answer`)."""
    def mark(fn: F) -> F:
        fn.answer = extract  # type: ignore[attr-defined]
        return fn
    return mark


def answer_extractor(fn: Callable[..., Any]) -> Callable[[str], Hashable | None] | None:
    """The answer extractor `with_answer` gave reward `fn`, or None."""
    extract = getattr(fn, "answer", None)
    return extract if callable(extract) else None

_ANSWER_PREFIX = re.compile(r"-?[0-9]*")
_INTEGER = re.compile(r"-?[0-9]+")
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")  # what last_number_reward reads: an integer or a decimal
_THOUSANDS = re.compile(r"(?<=[0-9]),(?=[0-9]{3}(?![0-9]))")  # "1,000": a separator; "(1,2,3)": a list
_PLAIN_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_DELIMITER = re.compile(r"(?<!\\)\$")  # a math delimiter, not an escaped dollar sign ("\$18.90")
_WORDS = re.compile(r"[A-Za-z]{2,}(?: [A-Za-z]+)*")  # a text answer: parsed as LaTeX it would be a product of symbols
# A power a sympy evaluation could take hours on, holding the GIL (so no deadline can stop it): a numeric power of a
# power (10^{10^{10}}, 9**9**9, (10^10)^(10^10)) or an exponent of 5 or more digits. Such an answer is not evaluated.
_POWER = r"(?:\^|\*\*)\s*[{(]?\s*"
_HUGE_POWER = re.compile(r"[0-9)}]\s*" + _POWER + r"(?:[0-9]{5,}|[0-9.]+\s*[})]?\s*" + _POWER + r"[0-9({])")
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()]))")
_COUNTDOWN_PROMPT = re.compile(r"\s*([0-9]+(?:,[0-9]+)*):([0-9]+)=\s*")
_MAX_NESTING = 64  # parentheses deeper than this are rejected (bounds the parser's recursion)


def _required(row: dict[str, Any], key: str, fn: str) -> Any:
    if row.get(key) is None:
        raise ValueError(f"{fn} needs the row field {key!r}; the row has {sorted(row)}")
    return row[key]


def _answer_prefix(completion: str) -> str | None:
    """What `addition_reward` compares: the stripped completion's leading integer characters (None if none)."""
    prefix = _ANSWER_PREFIX.match(completion.strip())
    return prefix.group(0) if prefix is not None and prefix.group(0) not in ("", "-") else None


def _last_number(completion: str) -> Decimal | None:
    """What `last_number_reward` compares: the completion's last number, an integer or a decimal ("37.5" is 37.5, not
    37 and 5; thousands commas "1,000" dropped, a list "(1,2,3)" kept apart; a Unicode minus "−5" is -5), exact;
    None if none."""
    numbers = _NUMBER.findall(_THOUSANDS.sub("", completion.replace("\u2212", "-")))
    return Decimal(numbers[-1]).normalize() if numbers else None


@with_answer(_answer_prefix)
@after_thinking
def addition_reward(prompt: str, completion: str, **row: Any) -> float:
    """1.0 if the completion starts with exactly the answer, else 0.0.

    The completion is stripped and cut at its first character that cannot be part of an integer (anything but a
    leading `-` and digits); that prefix must equal `row["answer"]`: for answer "579", "579", " 579 " and "579 ok"
    score 1, "5790", "0579" and "57" score 0.
    """
    answer = str(_required(row, "answer", "addition_reward")).strip()
    if not _INTEGER.fullmatch(answer):
        raise ValueError(f"addition_reward needs an integer answer, got {answer!r}")
    return 1.0 if _answer_prefix(completion) == answer else 0.0


@with_answer(_last_number)
@after_thinking
def last_number_reward(prompt: str, completion: str, **row: Any) -> float:
    """1.0 if the last number in the completion equals the integer `row["answer"]`, else 0.0: for chat models that
    answer in a sentence or an equation ("57 + 58 = 115" scores 1 for 115, and so does "115.0"; "115 is wrong, it is
    116" scores 0, and so does "115.5")."""
    answer = str(_required(row, "answer", "last_number_reward")).strip()
    if not _INTEGER.fullmatch(answer):
        raise ValueError(f"last_number_reward needs an integer answer, got {answer!r}")
    return 1.0 if _last_number(completion) == int(answer) else 0.0


class _Parser:
    """Recursive-descent parser for `expr := term (('+'|'-') term)*`, `term := factor (('*'|'/') factor)*`,
    `factor := integer | '(' expr ')'`, evaluating exactly with fractions. Raises ValueError on any malformation."""

    def __init__(self, text: str) -> None:
        self.tokens: list[str] = []
        pos = 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                if text[pos:].strip():
                    raise ValueError(f"unexpected character {text[pos]!r} at {pos}")
                break  # only trailing whitespace left
            self.tokens.append(match.group(1) or match.group(2))
            pos = match.end()
        self.pos = 0
        self.used: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ValueError("unexpected end of expression")
        self.pos += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            value = value + self.term(depth) if self.take() == "+" else value - self.term(depth)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            if self.take() == "*":
                value *= self.factor(depth)
            else:
                divisor = self.factor(depth)
                if divisor == 0:
                    raise ValueError("division by zero")
                value /= divisor
        return value

    def factor(self, depth: int) -> Fraction:
        token = self.take()
        if token == "(":
            if depth >= _MAX_NESTING:
                raise ValueError("parentheses nested too deeply")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ValueError("missing ')'")
            return value
        if token.isdigit():
            if len(token) > 1 and token[0] == "0":
                raise ValueError(f"number with a leading zero: {token}")
            self.used.append(int(token))
            return Fraction(int(token))
        raise ValueError(f"unexpected {token!r}")


def parse_arithmetic(text: str) -> tuple[Fraction, list[int]]:
    """Evaluate an expression of non-negative integers, + - * / and parentheses exactly (no unary minus).

    Returns the value and the integers the expression uses, in order. Raises ValueError for anything else,
    including division by zero, so it is safe to call on untrusted model output.
    """
    parser = _Parser(text)
    if not parser.tokens:
        raise ValueError("empty expression")
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ValueError(f"unexpected {parser.peek()!r} after the expression")
    return value, parser.used


def _countdown_problem(prompt: str, row: dict[str, Any]) -> tuple[list[int], int]:
    """The numbers and target: from the row's `numbers` and `answer` fields, else from a `n1,n2,...:target=` prompt."""
    numbers, target = row.get("numbers"), row.get("answer")
    if numbers is None or target is None:
        match = _COUNTDOWN_PROMPT.fullmatch(prompt)
        if match is None:
            raise ValueError(
                "countdown_reward needs row fields 'numbers' and 'answer' or a prompt 'n1,n2,...:target='; "
                f"got prompt {prompt[:60]!r} and fields {sorted(row)}"
            )
        numbers = numbers if numbers is not None else [int(n) for n in match.group(1).split(",")]
        target = target if target is not None else match.group(2)
    try:
        return [int(n) for n in numbers], int(str(target).strip())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"countdown_reward: bad numbers {numbers!r} or target {target!r}: {exc}") from exc


@after_thinking
def countdown_reward(prompt: str, completion: str, **row: Any) -> float:
    """1.0 if the stripped completion is an arithmetic expression (+ - * /, parentheses) over the given numbers,
    each used at most once, whose exact value is the target; else 0.0.

    The numbers and target come from `row["numbers"]` / `row["answer"]` when present (as `make_task("countdown")`
    rows have), otherwise from the prompt `n1,n2,...:target=`.
    """
    numbers, target = _countdown_problem(prompt, row)
    try:
        value, used = parse_arithmetic(completion)
    except ValueError:
        return 0.0
    if Counter(used) - Counter(numbers):  # some number used more often than it was given
        return 0.0
    return 1.0 if value == target else 0.0


def _math_answer(completion: str) -> str | None:
    """What `math_reward` verifies: Math-Verify's parse of the completion's final answer, as text; None if nothing
    parses. A number is written as its exact value (`sympy.nsimplify`), so that "3", "3.0", "0.5", "1/2", "2/4" and
    "50%" each vote with their equals ("3", "1/2"); other expressions vote as sympy prints them (x**2 + 1)."""
    import sympy
    from math_verify import parse

    if _HUGE_POWER.search(completion):  # sympy could take hours on it
        return None
    in_main_thread = threading.current_thread() is threading.main_thread()
    predicted = parse(completion, parsing_timeout=5 if in_main_thread else None)
    if not predicted:
        return None
    answer = predicted[0]
    if isinstance(answer, sympy.Basic) and answer.is_number:
        with contextlib.suppress(TypeError, ValueError, ArithmeticError, RecursionError):  # else: as parsed
            answer = sympy.nsimplify(answer.doit(), rational=True)
    try:
        return str(answer)
    except ValueError:  # an integer past Python's 4,300 digits of text: no answer a vote can hold
        return None


def _gold_text(answer: str) -> str:
    """The gold answer as `math_reward` parses it: a number as its exact decimal ("1e-05" -> "0.00001": Math-Verify
    reads scientific notation as its mantissa, 1); LaTeX without delimiters ("6\\pi", "2^{10}", MATH's and verl's
    ground truths) inside `$...$`, where Math-Verify's plain parse would keep the leading number (6, 2) or nothing;
    a text answer ("yes") and anything already delimited as written (an escaped "\\$18.90" is a dollar amount)."""
    text = answer.strip()
    if _PLAIN_NUMBER.fullmatch(text):
        with contextlib.suppress(InvalidOperation, ValueError):
            return format(Decimal(text), "f")
    if _DELIMITER.search(text) or "\\boxed" in text or _WORDS.fullmatch(text):
        return text
    return f"${text}$"


@with_answer(_math_answer)
@after_thinking
def math_reward(prompt: str, completion: str, **row: Any) -> float:
    """1.0 if Math-Verify finds the completion's final answer equivalent to `row["answer"]`, else 0.0.

    Both sides go through `math_verify.parse` (LaTeX and plain expressions), so "$\\frac{1}{2}$" matches "0.5"; a gold
    answer is read as `_gold_text` says (LaTeX without `$`, as MATH and verl store it, is LaTeX). A gold answer that
    does not parse raises ValueError (a data problem, not a wrong completion). A completion with a numeric power tower
    or an exponent of 5+ digits (`_HUGE_POWER`) scores 0 unparsed: sympy would evaluate it for hours. Math-Verify's
    signal-based timeouts only work in the main thread, so elsewhere they are turned off.
    """
    from math_verify import parse, verify

    answer = str(_required(row, "answer", "math_reward"))
    in_main_thread = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main_thread else None
    gold = parse(_gold_text(answer), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math_reward could not parse the gold answer {answer[:60]!r}")
    if _HUGE_POWER.search(completion):  # sympy could take hours on it, holding the GIL: no deadline stops it
        return 0.0
    predicted = parse(completion, parsing_timeout=timeout)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0

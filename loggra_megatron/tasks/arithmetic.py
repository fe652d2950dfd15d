"""``arithmetic``: ``"What is 37 + 48?"`` with exact integer answers.

Operators ``+``, ``-`` and ``*`` (ASCII, so the expression is also valid Python and the
tokenizer needs no extra symbols), standard operator precedence. Knobs: ``num_digits``
(an int, or an inclusive ``(lo, hi)`` range) per operand, ``num_operands``, ``operators``
and ``allow_negative``. ``metadata`` adds ``operands`` and ``operators``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loggra_megatron.config import check_fields, positive
from loggra_megatron.tasks.base import Task


@dataclass
class ArithmeticFlags:
    """The arithmetic knobs on the command line (``--task arithmetic`` and ``mixed``)."""

    task_digits: int = 2
    """Digits per operand of the arithmetic problems."""
    task_operators: str = "+-*"
    """Operators of the arithmetic problems, a subset of +-*."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("task_digits", positive, ">= 1"),
                (
                    "task_operators",
                    lambda o: bool(o) and not set(o) - set("+-*"),
                    "a non-empty subset of +-*",
                ),
            ],
        )

    def knobs(self) -> dict:
        """The task's knobs of these flags."""
        return {"num_digits": self.task_digits, "operators": self.task_operators}


class ArithmeticTask(Task):
    KNOBS = {**ArithmeticFlags().knobs(), "num_operands": 2, "allow_negative": True}
    FLAGS = ArithmeticFlags

    def __init__(self, **knobs):
        super().__init__(**knobs)
        _check_knobs(**self.knobs)

    def example(self, rng: random.Random) -> dict:
        return _arithmetic_task(rng, **self.knobs)


def _operand(rng: random.Random, num_digits: int | tuple[int, int]) -> int:
    lo_d, hi_d = (num_digits, num_digits) if isinstance(num_digits, int) else num_digits
    d = rng.randint(lo_d, hi_d)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)


def _arithmetic_task(rng: random.Random, num_digits, num_operands, operators, allow_negative):
    while True:
        operands = [_operand(rng, num_digits) for _ in range(num_operands)]
        ops = [rng.choice(operators) for _ in range(num_operands - 1)]
        expression = " ".join(
            [str(operands[0])] + [f"{op} {x}" for op, x in zip(ops, operands[1:], strict=True)]
        )
        value = eval(expression, {"__builtins__": {}})  # digits and + - * only
        if allow_negative or value >= 0:
            break
    return {
        "prompt": f"What is {expression}?",
        "answer": str(value),
        "metadata": {
            "kind": "arithmetic",
            "expression": expression,
            "operands": operands,
            "operators": ops,
            "solution": f"{expression} = {value}.",
        },
    }


def _check_knobs(num_digits, num_operands, operators, allow_negative) -> None:
    digits = (num_digits, num_digits) if isinstance(num_digits, int) else tuple(num_digits)
    if len(digits) != 2 or not all(isinstance(d, int) and d >= 1 for d in digits):
        raise ValueError(f"num_digits must be an int >= 1 or a (lo, hi) pair, got {num_digits!r}")
    if digits[0] > digits[1]:
        raise ValueError(f"num_digits range is empty: {num_digits!r}")
    if not isinstance(num_operands, int) or num_operands < 2:
        raise ValueError(f"num_operands must be an int >= 2, got {num_operands!r}")
    if not operators or set(operators) - set("+-*"):
        raise ValueError(f"operators must be a non-empty subset of '+-*', got {operators!r}")

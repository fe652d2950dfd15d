# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""A seeded generator of verifiable math tasks, so that training runs fully offline.

Two kinds of tasks, both with exact numeric answers:

* ``"arithmetic"``: ``"What is 37 + 48?"``, with operators ``+``, ``-`` and ``*`` (ASCII,
  so the expression is also valid Python and the tokenizer needs no extra symbols) and
  standard operator precedence. Difficulty knobs: ``num_digits`` (an int, or an inclusive
  ``(lo, hi)`` range) per operand, ``num_operands`` and ``operators``; ``allow_negative``.
* ``"word_problems"``: GSM8K-style short stories from templates, one to three steps
  ("Tom has 3 boxes with 12 apples each. He gives away 5 apples. How many apples does he
  have left?"). Answers are integers except for the money template, whose answer is a
  decimal with at most two places. Knobs: ``max_number`` (scale of the numbers) and
  ``max_steps``.
* ``"mixed"``: each task is arithmetic or a word problem with probability 1/2 (both sets
  of knobs apply).

Every task is ``{"prompt": str, "answer": str, "metadata": dict}``. ``metadata`` holds
``kind``, ``expression`` (a Python expression over ints and the answer's literals that
evaluates to the answer; integer division ``//`` only where it is exact), ``solution`` (a
short worked solution, e.g. ``"3 * 12 = 36. 36 - 5 = 31."``) and kind-specific fields
(``operands``/``operators`` or ``template``/``steps``).

``generate_tasks(kind, n, seed)`` is a pure function of its arguments: the same seed gives
the same list on every platform (it uses ``random.Random(seed)``), and the first ``k``
tasks of ``n`` equal ``generate_tasks(kind, k, seed)``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable

KINDS = ("arithmetic", "word_problems", "mixed")
ARITHMETIC_KNOBS = {"num_digits": 2, "num_operands": 2, "operators": "+-*", "allow_negative": True}
WORD_PROBLEM_KNOBS = {"max_number": 20, "max_steps": 3}

_NAMES = (
    ("Tom", "he"),
    ("Anna", "she"),
    ("Ravi", "he"),
    ("Mia", "she"),
    ("Omar", "he"),
    ("Lena", "she"),
    ("Kenji", "he"),
    ("Sofia", "she"),
)  # (name, pronoun); fmt: skip
_ITEMS = ("apples", "pencils", "marbles", "stickers", "cookies", "cards", "shells", "books")
_GIFTS = ("bike", "game", "jacket", "lamp", "watch")


# ----------------------------------------------------------------------------- arithmetic


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


def _check_arithmetic_knobs(num_digits, num_operands, operators, allow_negative) -> None:
    digits = (num_digits, num_digits) if isinstance(num_digits, int) else tuple(num_digits)
    if len(digits) != 2 or not all(isinstance(d, int) and d >= 1 for d in digits):
        raise ValueError(f"num_digits must be an int >= 1 or a (lo, hi) pair, got {num_digits!r}")
    if digits[0] > digits[1]:
        raise ValueError(f"num_digits range is empty: {num_digits!r}")
    if not isinstance(num_operands, int) or num_operands < 2:
        raise ValueError(f"num_operands must be an int >= 2, got {num_operands!r}")
    if not operators or set(operators) - set("+-*"):
        raise ValueError(f"operators must be a non-empty subset of '+-*', got {operators!r}")


# ------------------------------------------------------------------------- word problems
# Each template draws its numbers from ``rng`` (scaled by ``m`` = max_number) and returns
# (prompt, expression, solution). Numbers are chosen so that every step stays a
# non-negative integer (and divisions are exact).


def _boxes(rng, m):
    (name, he), item = rng.choice(_NAMES), rng.choice(_ITEMS)
    boxes, each = rng.randint(2, 9), rng.randint(2, m)
    total = boxes * each
    give = rng.randint(1, total - 1)
    return (
        f"{name} has {boxes} boxes with {each} {item} each. {he.capitalize()} gives away "
        f"{give} {item}. How many {item} does {he} have left?",
        f"{boxes} * {each} - {give}",
        f"{boxes} * {each} = {total}. {total} - {give} = {total - give}.",
    )


def _share(rng, m):
    (name, _), item = rng.choice(_NAMES), rng.choice(_ITEMS)
    friends, each = rng.randint(2, 9), rng.randint(1, m)
    total = friends * each
    return (
        f"{name} has {total} {item} and shares them equally among {friends} friends. "
        f"How many {item} does each friend get?",
        f"{total} // {friends}",
        f"{total} / {friends} = {each}.",
    )


def _reading(rng, m):
    name, he = rng.choice(_NAMES)
    per_day, days = rng.randint(2, 2 * m), rng.randint(2, 9)
    read = per_day * days
    book = read + rng.randint(1, 10 * m)
    return (
        f"A book has {book} pages. {name} reads {per_day} pages a day for {days} days. "
        f"How many pages does {he} still have to read?",
        f"{book} - {per_day} * {days}",
        f"{per_day} * {days} = {read}. {book} - {read} = {book - read}.",
    )


def _change(rng, m):
    name, he = rng.choice(_NAMES)
    item = rng.choice(("notebooks", "pens", "toys", "mugs"))
    count, price = rng.randint(2, 6), rng.randint(1, m)
    cost = count * price
    bill = next(b for b in (10, 20, 50, 100, 200, 500) if b > cost)
    return (
        f"{name} buys {count} {item} for ${price} each and pays with a ${bill} bill. "
        f"How many dollars of change does {he} get?",
        f"{bill} - {count} * {price}",
        f"{count} * {price} = {cost}. {bill} - {cost} = {bill - cost}.",
    )


def _savings(rng, m):
    name, he = rng.choice(_NAMES)
    weekly, weeks = rng.randint(2, m), rng.randint(2, 9)
    saved = weekly * weeks
    spent = rng.randint(1, saved)
    return (
        f"{name} saves ${weekly} each week. After {weeks} weeks, {he} spends ${spent} on a "
        f"{rng.choice(_GIFTS)}. How many dollars does {he} have left?",
        f"{weekly} * {weeks} - {spent}",
        f"{weekly} * {weeks} = {saved}. {saved} - {spent} = {saved - spent}.",
    )


def _ages(rng, m):
    (a, _), (b, _) = rng.sample(_NAMES, 2)
    age, older, years = rng.randint(3, 3 * m), rng.randint(1, m), rng.randint(1, 10)
    return (
        f"{a} is {age} years old. {b} is {older} years older than {a}. "
        f"How old will {b} be in {years} years?",
        f"{age} + {older} + {years}",
        f"{age} + {older} = {age + older}. {age + older} + {years} = {age + older + years}.",
    )


def _bakery(rng, m):
    batches, per = rng.randint(2, 6), rng.randint(6, 2 * m + 6)
    total = batches * per
    morning = rng.randint(1, total // 2)
    afternoon = rng.randint(0, total - morning)
    left = total - morning - afternoon
    return (
        f"A baker makes {batches} batches of {per} cookies. She sells {morning} cookies in "
        f"the morning and {afternoon} cookies in the afternoon. How many cookies are left?",
        f"{batches} * {per} - {morning} - {afternoon}",
        f"{batches} * {per} = {total}. {total} - {morning} = {total - morning}. "
        f"{total - morning} - {afternoon} = {left}.",
    )


def _teams(rng, m):
    classes, size = rng.randint(2, 5), rng.randint(10, 10 + m)
    total = classes * size
    team = rng.randint(2, 6)
    absent = rng.randint(0, min(total - team, m))
    absent += (total - absent) % team  # the rest splits into whole teams
    teams = (total - absent) // team
    return (
        f"A school has {classes} classes with {size} students each. {absent} students are "
        f"absent. The others form teams of {team}. How many teams are there?",
        f"({classes} * {size} - {absent}) // {team}",
        f"{classes} * {size} = {total}. {total} - {absent} = {total - absent}. "
        f"{total - absent} / {team} = {teams}.",
    )


def _speed(rng, m):
    speed, hours = rng.randint(2, 5 * m), rng.randint(2, 9)
    return (
        f"A train travels at {speed} miles per hour for {hours} hours. "
        f"How many miles does it travel?",
        f"{speed} * {hours}",
        f"{speed} * {hours} = {speed * hours}.",
    )


def _price(rng, m):
    name, _ = rng.choice(_NAMES)
    cents, count = rng.randint(101, 100 * m + 99), rng.randint(2, 9)
    price, total = _dollars(cents), _dollars(cents * count)
    return (
        f"A pen costs ${price}. How many dollars does {name} pay for {count} pens?",
        f"{count} * {price}",
        f"{count} * {price} = {total}.",
    )


def _dollars(cents: int) -> str:
    text = f"{cents // 100}.{cents % 100:02d}"
    return text.rstrip("0").rstrip(".")


# name -> (number of steps, template)
WORD_PROBLEM_TEMPLATES: dict[str, tuple[int, Callable]] = {
    "share": (1, _share),
    "speed": (1, _speed),
    "price": (1, _price),
    "boxes": (2, _boxes),
    "reading": (2, _reading),
    "change": (2, _change),
    "savings": (2, _savings),
    "ages": (2, _ages),
    "bakery": (3, _bakery),
    "teams": (3, _teams),
}


def _word_problem_task(rng: random.Random, max_number: int, max_steps: int) -> dict:
    names = [n for n, (steps, _) in WORD_PROBLEM_TEMPLATES.items() if steps <= max_steps]
    name = rng.choice(names)
    steps, template = WORD_PROBLEM_TEMPLATES[name]
    prompt, expression, solution = template(rng, max_number)
    cents = round(eval(expression, {"__builtins__": {}}) * 100)  # exact: 2-decimal prices
    return {
        "prompt": prompt,
        "answer": _dollars(cents) if cents % 100 else str(cents // 100),
        "metadata": {
            "kind": "word_problem",
            "template": name,
            "steps": steps,
            "expression": expression,
            "solution": solution,
        },
    }


# --------------------------------------------------------------------------------- API


def generate_tasks(kind: str, n: int, seed: int, **difficulty) -> list[dict]:
    """``n`` tasks of ``kind`` ("arithmetic", "word_problems" or "mixed"), a pure function
    of the arguments. ``difficulty``: see ``ARITHMETIC_KNOBS`` / ``WORD_PROBLEM_KNOBS``."""
    if kind not in KINDS:
        raise ValueError(f"unknown task kind {kind!r}; expected one of {KINDS}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    allowed = {
        "arithmetic": ARITHMETIC_KNOBS,
        "word_problems": WORD_PROBLEM_KNOBS,
        "mixed": ARITHMETIC_KNOBS | WORD_PROBLEM_KNOBS,
    }[kind]
    unknown = sorted(set(difficulty) - set(allowed))
    if unknown:
        raise TypeError(
            f"unknown difficulty knob(s) {unknown} for {kind!r}; known: {sorted(allowed)}"
        )
    knobs = {**allowed, **difficulty}
    arith = {k: knobs[k] for k in ARITHMETIC_KNOBS if k in knobs}
    words = {k: knobs[k] for k in WORD_PROBLEM_KNOBS if k in knobs}
    if arith:
        _check_arithmetic_knobs(**arith)
    if words and (words["max_number"] < 2 or words["max_steps"] < 1):
        raise ValueError(f"need max_number >= 2 and max_steps >= 1, got {words}")

    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        arithmetic = kind == "arithmetic" or (kind == "mixed" and rng.random() < 0.5)
        if arithmetic:
            tasks.append(_arithmetic_task(rng, **arith))
        else:
            tasks.append(_word_problem_task(rng, **words))
    return tasks


def write_jsonl(tasks: Iterable[dict], path: str | os.PathLike) -> None:
    """Write tasks as one JSON object per line (the ``--data-path`` format)."""
    with open(path, "w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    """``python -m loggra_megatron.data.tasks --kind mixed --n 1000 --seed 0 --output x.jsonl``"""
    import argparse

    p = argparse.ArgumentParser(description="Write generated tasks as JSONL (--data-path).")
    p.add_argument("--kind", choices=KINDS, default="mixed")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    write_jsonl(generate_tasks(args.kind, args.n, args.seed), args.output)


if __name__ == "__main__":
    main()

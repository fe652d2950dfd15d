"""``word_problems``: GSM8K-style short stories from templates, one to three steps.

"Tom has 3 boxes with 12 apples each. He gives away 5 apples. How many apples does he have
left?" Answers are integers except for the money template, whose answer is a decimal with
at most two places. Knobs: ``max_number`` (scale of the numbers) and ``max_steps``.
``metadata`` adds ``template`` and ``steps``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from loggra_megatron.tasks.base import Task


class WordProblemTask(Task):
    KNOBS = {"max_number": 20, "max_steps": 3}

    def __init__(self, **knobs):
        super().__init__(**knobs)
        if self.knobs["max_number"] < 2 or self.knobs["max_steps"] < 1:
            raise ValueError(f"need max_number >= 2 and max_steps >= 1, got {self.knobs}")

    def example(self, rng: random.Random) -> dict:
        return _word_problem_task(rng, **self.knobs)


_NAMES = (
    ("Tom", "he"),
    ("Anna", "she"),
    ("Ravi", "he"),
    ("Mia", "she"),
    ("Omar", "he"),
    ("Lena", "she"),
    ("Kenji", "he"),
    ("Sofia", "she"),
)  # (name, pronoun)
_ITEMS = ("apples", "pencils", "marbles", "stickers", "cookies", "cards", "shells", "books")
_GIFTS = ("bike", "game", "jacket", "lamp", "watch")


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

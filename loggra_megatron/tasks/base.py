"""The interface of a built-in task: a seeded generator of verifiable examples.

A task is constructed from its difficulty knobs (validated in ``__init__``, ``ValueError``
or ``TypeError`` naming the knob) and generates examples ``{"prompt": str, "answer": str,
"metadata": dict}`` from a ``random.Random``. ``generate(n, seed)`` is a pure function of
its arguments: the same seed gives the same list on every platform, and the first ``k``
examples of ``n`` equal ``generate(k, seed)``. ``metadata`` holds at least ``kind``,
``expression`` (a Python expression over the numbers that evaluates to the answer) and
``solution`` (a short worked solution, used by the supervised warm-up).

Adding a task: one file with a :class:`Task` subclass, one line in
:data:`loggra_megatron.tasks.TASKS` (see ``docs/architecture.md``).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar


class Task:
    """A built-in task; subclasses set ``KNOBS`` (defaults) and implement :meth:`example`."""

    KNOBS: ClassVar[dict[str, Any]] = {}
    """Difficulty knobs and their defaults."""

    def __init__(self, **knobs: Any):
        unknown = sorted(set(knobs) - set(self.KNOBS))
        if unknown:
            raise TypeError(
                f"unknown difficulty knob(s) {unknown} for {type(self).__name__}; known: "
                f"{sorted(self.KNOBS)}"
            )
        self.knobs = {**self.KNOBS, **knobs}

    def example(self, rng: random.Random) -> dict:
        """One example drawn from ``rng``."""
        raise NotImplementedError

    def generate(self, n: int, seed: int) -> list[dict]:
        """``n`` examples, a pure function of ``(knobs, n, seed)``."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        rng = random.Random(seed)
        return [self.example(rng) for _ in range(n)]

"""``mixed``: each example is arithmetic or a word problem with probability 1/2 (both sets
of knobs apply)."""

from __future__ import annotations

import random

from loggra_megatron.tasks.arithmetic import ArithmeticFlags, ArithmeticTask
from loggra_megatron.tasks.base import Task
from loggra_megatron.tasks.word_problems import WordProblemTask


class MixedTask(Task):
    KNOBS = {**ArithmeticTask.KNOBS, **WordProblemTask.KNOBS}
    FLAGS = ArithmeticFlags

    def __init__(self, **knobs):
        super().__init__(**knobs)
        pick = lambda cls: {k: v for k, v in self.knobs.items() if k in cls.KNOBS}  # noqa: E731
        self.arithmetic = ArithmeticTask(**pick(ArithmeticTask))
        self.word_problems = WordProblemTask(**pick(WordProblemTask))

    def example(self, rng: random.Random) -> dict:
        task = self.arithmetic if rng.random() < 0.5 else self.word_problems
        return task.example(rng)

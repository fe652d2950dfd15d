"""Tasks: built-in verifiable task generators (offline, seeded), data-file tasks (``jsonl``,
``math``), and rewards.

``TASKS`` is the registry behind ``--task``; ``generate_tasks`` builds examples of a
generated task.
The prompt and answer format: ``tasks.prompt_format``; rewards and the
``--reward-fn`` loader: ``tasks.rewards``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from loggra_megatron.tasks.arithmetic import ArithmeticTask
from loggra_megatron.tasks.base import Task
from loggra_megatron.tasks.jsonl import DataFileTask
from loggra_megatron.tasks.math import MathTask
from loggra_megatron.tasks.mixed import MixedTask
from loggra_megatron.tasks.word_problems import WordProblemTask

TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "word_problems": WordProblemTask,
    "mixed": MixedTask,
    "jsonl": DataFileTask,
    "math": MathTask,
}
"""``--task`` name → task class (one line per task)."""

__all__ = ["TASKS", "Task", "generate_tasks", "write_jsonl"]


def generate_tasks(kind: str, n: int, seed: int, **knobs) -> list[dict]:
    """``n`` examples of task ``kind``, a pure function of the arguments."""
    if kind not in TASKS or TASKS[kind].needs_data:
        generated = tuple(k for k, t in TASKS.items() if not t.needs_data)
        raise ValueError(f"unknown task kind {kind!r}; expected one of {generated}")
    return TASKS[kind](**knobs).generate(n, seed)


def write_jsonl(tasks: Iterable[dict], path: str | os.PathLike) -> None:
    """Write examples as one JSON object per line (the ``--data-path`` format)."""
    with open(path, "w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task, ensure_ascii=False) + "\n")

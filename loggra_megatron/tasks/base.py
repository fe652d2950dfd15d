"""The interface of a task: where its examples come from, how a question is asked, what a
reference completion is, and how a completion is scored.

* **Examples.** A generated task is constructed from its difficulty knobs (validated in
  ``__init__``, ``ValueError`` or ``TypeError`` naming the knob) and generates examples
  ``{"prompt": str, "answer": str, "metadata": dict}`` from a ``random.Random``;
  ``generate(n, seed)`` is a pure function of its arguments (the first ``k`` examples of
  ``n`` equal ``generate(k, seed)``). ``metadata`` holds at least ``kind``, ``expression``
  and ``solution`` (a short worked solution). A task with ``needs_data`` reads
  ``--data-path`` instead (prompts may be strings or lists of chat messages).
* **Asking.** Without a chat template the prompt is ``template`` filled with the question;
  with one, the user message is the question followed by ``instruction``.
* **Scoring.** ``reward`` (a float, or ``{"reward", "correct"}``) and ``is_correct`` (what
  ``reward/accuracy`` and ``eval/accuracy`` count). The default is the numeric answer after
  ``####`` (``tasks.rewards``); ``answer_problem`` says, before any
  process group starts, why the task's scoring cannot read a reference answer.

Adding a task: one file with a ``Task`` subclass (with its ``FLAGS`` if it has command-line
knobs), one line in ``loggra_megatron.tasks.TASKS`` (see ``docs/architecture.md``).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from loggra_megatron.tasks.prompt_format import INSTRUCTION, PROMPT_TEMPLATE, format_completion
from loggra_megatron.tasks.rewards import default_reward, exact_match_numeric, parse_number


class Task:
    """A task; generated ones set ``KNOBS`` (defaults) and implement ``example``."""

    KNOBS: ClassVar[dict[str, Any]] = {}
    """Difficulty knobs and their defaults."""
    FLAGS: ClassVar[type | None] = None
    """The knobs on the command line: a dataclass with a field per flag (its docstring is the
    flag's help; ``__post_init__`` validates it) and ``knobs()``, the constructor's knobs of
    the flags given. Tasks may share one (``mixed`` takes the arithmetic flags); the flags of
    every task in ``TASKS`` make the ``task`` section (``tasks/flags.py``)."""
    needs_data: ClassVar[bool] = False
    """Examples come from --data-path, not from ``generate``."""
    template: ClassVar[str] = PROMPT_TEMPLATE
    """The prompt of a question without a chat template (``{prompt}`` is the question)."""
    instruction: ClassVar[str] = INSTRUCTION
    """Appended to the question in the user message of a chat template."""

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

    # ------------------------------------------------------------------ asking and scoring
    def user_message(self, question: str) -> str:
        """The user turn of a chat template for ``question``."""
        return f"{question}\n{self.instruction}" if self.instruction else question

    def reference_completion(self, example: dict) -> str:
        """A correct completion (supervised warm-up)."""
        return format_completion(example["answer"], example["metadata"].get("solution"))

    def reward(self, prompt: str, completion: str, answer: str, metadata: dict) -> float:
        return default_reward(prompt, completion, answer, metadata)

    def is_correct(self, prompt: str, completion: str, answer: str, metadata: dict) -> bool:
        return exact_match_numeric(prompt, completion, answer, metadata) == 1.0

    def answer_problem(self, answer: str) -> str | None:
        """Why ``reward`` / ``is_correct`` cannot judge completions against the
        reference ``answer`` (None: they can)."""
        if parse_number(answer) is None:
            return "is not a number, which this task's scoring compares (pass --reward-fn)"
        return None

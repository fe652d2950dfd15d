"""``math``: competition-style problems from ``--data-path`` with answers checked by
``math-verify`` (symbolic equivalence: ``1/2`` = ``0.5`` = ``\\frac{1}{2}``).

The final answer of a completion is the content of its last ``\\boxed{...}`` (braces
balanced), else the text after its first ``####`` up to the end of that line. The reward
is 1 when math-verify finds it equivalent to the reference answer, ``--format-reward``
(default 0) when there is a final answer that is wrong, 0 without one; ``is_correct`` is the
equivalence. Each (final answer, reference) pair is judged once (reward and verdict share
it), within ``TIMEOUT_S`` per parse and per comparison, and a final answer longer than
``MAX_ANSWER_CHARS`` is wrong without being parsed: an adversarial ``\\boxed{}`` (a power
tower, thousands of nested braces) costs seconds, not tens, and is never echoed. The chat instruction asks for ``\\boxed{}``, as Qwen's math models are trained to
answer.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

from loggra_megatron.config import check_fields
from loggra_megatron.tasks.base import Task
from loggra_megatron.tasks.prompt_format import ANSWER_MARKER
from loggra_megatron.tasks.rewards import clip

BOXED = "\\boxed{"
TIMEOUT_S = 2
"""math-verify's time limit (whole seconds: a SIGALRM) of one parse and of one comparison."""
MAX_ANSWER_CHARS = 1000
"""A final answer longer than this is judged wrong without being parsed."""


def extract_final_answer(completion: str) -> str | None:
    """The last ``\\boxed{...}`` content, else the rest of the line after ``####``."""
    start = completion.rfind(BOXED)
    if start >= 0:
        depth, i = 1, start + len(BOXED)
        for j in range(i, len(completion)):
            depth += {"{": 1, "}": -1}.get(completion[j], 0)
            if depth == 0:
                return completion[i:j].strip() or None
        return None
    if ANSWER_MARKER in completion:
        rest = completion.split(ANSWER_MARKER, 1)[1].strip().splitlines()
        return rest[0].strip() if rest and rest[0].strip() else None
    return None


@functools.lru_cache(maxsize=4096)
def equivalent(predicted: str, answer: str) -> bool:
    """Whether math-verify finds ``predicted`` equivalent to the reference ``answer``. A
    predicted answer it cannot parse (never printed), or whose parse or comparison runs past
    ``TIMEOUT_S``, is not equivalent: the model's doing. A reference it cannot read, or a
    comparison that fails inside math-verify, raises: a reward error, never a wrong answer
    (``tasks.scoring``). math-verify times out with ``signal.alarm``, which only the main
    thread may set (the trainer scores there); off it its own time-out is off (math-verify
    refuses one there, which once read as "not equivalent": every answer scored wrong)."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None

    def as_math(text: str):
        text = text.strip()
        text = text if text.startswith("$") else f"${text}$"
        return parse(text, parsing_timeout=timeout, raise_on_error=True)

    if len(predicted) > MAX_ANSWER_CHARS:
        return False
    try:
        gold = as_math(answer)
    except (Exception, TimeoutException) as e:
        why = f"{type(e).__name__}: {clip(str(e))}"
        raise ValueError(f"math-verify cannot read the reference answer ({why})") from e
    if not gold:
        raise ValueError(f"math-verify reads no expression in the reference {clip(repr(answer))}")
    try:
        target = as_math(predicted)
    except (Exception, TimeoutException):  # sympy failing on the text, or a time-out
        return False
    try:
        return bool(target) and verify(gold, target, timeout_seconds=timeout, raise_on_error=True)
    except TimeoutException:  # a comparison too costly (an adversarial answer)
        return False


@dataclass
class MathFlags:
    """The math task's knob on the command line."""

    format_reward: float = 0.0
    """The reward of a final answer (\\boxed{} or ####) that is wrong."""

    def __post_init__(self):
        check_fields(self, [("format_reward", lambda r: 0 <= r <= 1, "in [0, 1]")])

    def knobs(self) -> dict:
        """The task's knobs of these flags."""
        return {"format_reward": self.format_reward}


class MathTask(Task):
    needs_data = True
    template = "Problem: {prompt}\nSolution:"
    instruction = "Please reason step by step, and put your final answer within \\boxed{}."
    KNOBS = MathFlags().knobs()
    FLAGS = MathFlags

    def reference_completion(self, example: dict) -> str:
        solution = example["metadata"].get("solution")
        boxed = f"The answer is \\boxed{{{example['answer']}}}."
        return f" {solution}\n{boxed}" if solution else f" {boxed}"

    def reward(self, prompt, completion, answer, metadata) -> float:
        predicted = extract_final_answer(completion)
        if predicted is None:
            return 0.0
        return 1.0 if equivalent(predicted, answer) else float(self.knobs["format_reward"])

    def is_correct(self, prompt, completion, answer, metadata) -> bool:
        predicted = extract_final_answer(completion)
        return predicted is not None and equivalent(predicted, answer)

    def answer_problem(self, answer: str) -> str | None:
        return None  # any text: math-verify judges it (one it cannot read: a reward error)

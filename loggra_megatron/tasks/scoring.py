"""Scoring a batch of completions: ``Scoring.score`` calls the reward on every sample and
returns ``Scores``, the rewards, the verdicts and the samples whose reward failed.

A reward fails on a sample when it raises (``KeyboardInterrupt``, ``sys.exit`` and
``os._exit`` included), returns anything but a finite real number within float32's range or
``{"reward": number, "correct": bool}``, or, in a worker process (``tasks.reward_workers``),
runs past ``--reward-timeout`` or ends its process. Such a sample is a reward error, never a
wrong answer: it is counted (``reward/errors``), has no verdict and takes no policy-gradient
step (``rl.experience``); when more than ``--reward-max-error-fraction`` of a batch fails,
``score`` raises a ``RewardFunctionError`` naming the first failed sample, with the reason and
the original traceback. Every sample, answer or value an error quotes is clipped
(``rewards.clip``).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from loggra_megatron.config import FLOAT32_MAX
from loggra_megatron.tasks.rewards import RewardFn, _exit_call, _os_exit_raises, _OsExit, clip

TRACEBACK_LINE_CHARS = 500
"""A line of a quoted traceback keeps this many characters."""
TRACEBACK_CHARS = 10_000
"""A quoted traceback keeps its last this many characters (the end names the exception)."""

Outcome = tuple[float, bool | None]
"""One scored sample: its reward and its verdict (None: the reward did not say)."""


class RewardProblem(Exception):
    """What a reward call did wrong (``problem``: "raised", "returned None (need a finite
    float)", ...) and the traceback of what it raised, clipped."""

    def __init__(self, problem: str, traceback_text: str = ""):
        super().__init__(problem)
        self.problem, self.traceback_text = problem, traceback_text


class RewardFunctionError(RuntimeError):
    """A reward function failed on one sample; carries ``index``, ``prompt``, the
    ``problem`` (what it did wrong) and the original ``traceback_text``. ``headline``: the
    message without the traceback."""

    def __init__(
        self,
        fn_name: str,
        index: int,
        prompt: str,
        problem: str,
        traceback_text: str,
        where: str = "",
        note: str = "",
    ):
        self.fn_name, self.index, self.prompt = fn_name, index, prompt
        self.problem, self.traceback_text = problem, traceback_text
        self.where, self.note = where, note
        self.headline = (
            f"reward function {fn_name} {problem} on sample {index}{where} "
            f"(prompt: {clip(repr(prompt), 200)}){note}"
        )
        message = self.headline
        if traceback_text:
            message += f"\n\nOriginal traceback:\n{traceback_text}"
        super().__init__(message)

    def at(self, where: str) -> RewardFunctionError:
        """The same error with a location (e.g. the RL step and dataset index) added."""
        return self._with(where, self.note)

    def _with(self, where: str, note: str) -> RewardFunctionError:
        args = (self.fn_name, self.index, self.prompt, self.problem, self.traceback_text)
        error = RewardFunctionError(*args, where, note)
        error.__cause__ = self.__cause__
        return error


def clip_traceback(text: str) -> str:
    """A traceback with each line clipped and at most its last ``TRACEBACK_CHARS``."""
    text = "\n".join(clip(line, TRACEBACK_LINE_CHARS) for line in text.split("\n"))
    if len(text) <= TRACEBACK_CHARS:
        return text
    return f"[{len(text) - TRACEBACK_CHARS} characters left out]\n{text[-TRACEBACK_CHARS:]}"


def _call(f, args: tuple):
    """``f(*args)``; any failure (``KeyboardInterrupt``, ``sys.exit``, ``os._exit`` too) is
    a ``RewardProblem``."""
    try:
        with _os_exit_raises():
            return f(*args)
    except (Exception, SystemExit, KeyboardInterrupt, _OsExit) as e:
        tb = clip_traceback("".join(traceback.format_exception(type(e), e, e.__traceback__)))
        exits = isinstance(e, SystemExit | _OsExit)
        raise RewardProblem(f"called {_exit_call(e)}" if exits else "raised", tb) from e


def evaluate(fn: RewardFn, is_correct: RewardFn | None, args: tuple) -> Outcome:
    """``fn(*args)`` checked, and the verdict: ``is_correct(*args)`` when given, else a
    returned dict's ``correct``, else None. Raises ``RewardProblem`` on any failure."""
    value = _call(fn, args)
    verdict = bool(_call(is_correct, args)) if is_correct is not None else None
    if isinstance(value, dict):
        if "reward" not in value:
            raise RewardProblem(f"returned a dict without a 'reward' key: {clip(repr(value))}")
        said = value.get("correct")
        if said is not None and not isinstance(said, bool):
            raise RewardProblem(f"returned 'correct': {clip(repr(said))} (need a bool)")
        verdict = said if verdict is None else verdict
        value = value["reward"]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # 0-d torch / numpy value
    if not isinstance(value, numbers.Real) or not _finite(value):
        raise RewardProblem(f"returned {clip(repr(value))} (need a finite float)")
    if abs(value) > FLOAT32_MAX:  # trained in float32: it would become inf
        raise RewardProblem(
            f"returned {clip(repr(value))}, beyond float32's range (|reward| <= 3.4e38)"
        )
    return float(value), verdict


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond every float: finite, and out of float32's range
        return True


def _fn_name(fn) -> str:
    """``module:qualname`` of a reward function, for its errors."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}:{name}" if module else name


class Workers(Protocol):
    """Processes that call a reward elsewhere (``tasks.reward_workers.RewardWorkers``)."""

    spec: str
    """The ``--reward-fn`` they run."""

    def run(self, samples: Sequence[tuple]) -> Iterator[tuple[int, Outcome | RewardProblem]]:
        """Each sample's outcome as it arrives."""
        ...


@dataclass
class Scores:
    """The scores of a batch, by sample."""

    rewards: list[float]
    """Each sample's reward (0.0 for a failed one: see ``failed``)."""
    correct: list[bool]
    """Each sample's verdict (False for a failed one, which has none)."""
    errors: list[RewardFunctionError]
    """The failed samples' errors, by sample index."""

    @property
    def failed(self) -> list[bool]:
        """Whether each sample's reward failed."""
        bad = {e.index for e in self.errors}
        return [i in bad for i in range(len(self.rewards))]

    def totals(self) -> tuple[float, int, int]:
        """``(sum of rewards, correct, samples)`` over the samples that were scored."""
        rows = zip(self.rewards, self.correct, self.failed, strict=True)
        scored = [(r, c) for r, c, failed in rows if not failed]
        return sum(r for r, _ in scored), sum(c for _, c in scored), len(scored)


@dataclass
class Scoring:
    """How completions are scored: ``reward_fn`` and, when the task judges correctness
    itself, ``is_correct`` (else a returned ``correct`` or reward ≥ ``threshold``)."""

    reward_fn: RewardFn
    is_correct: RewardFn | None
    threshold: float
    max_error_fraction: float = 0.0
    """More failed samples than this fraction of a batch stop the run (0: any;
    ``--reward-max-error-fraction``)."""
    workers: Workers | None = None
    """Worker processes that run ``reward_fn`` (a ``--reward-fn module:function``); None: it
    runs in this process (the built-ins, bounded by construction: docs/data.md)."""

    def score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        answers: Sequence[str],
        metadatas: Sequence[dict] | None = None,
    ) -> Scores:
        """The ``Scores`` of the samples; raises ``RewardFunctionError`` (the first failed
        sample) as soon as more than ``max_error_fraction`` of them have failed."""
        n = len(prompts)
        metadatas = [{}] * n if metadatas is None else metadatas
        if {len(completions), len(answers), len(metadatas)} != {n}:
            raise ValueError(
                f"Scoring.score: got {n} prompts, {len(completions)} completions, "
                f"{len(answers)} answers and {len(metadatas)} metadatas"
            )
        samples = list(zip(prompts, completions, answers, metadatas, strict=True))
        allowed = int(self.max_error_fraction * n)
        rewards, correct, errors = [0.0] * n, [False] * n, []
        outcomes = self.workers.run(samples) if self.workers else self._in_process(samples)
        with contextlib.closing(outcomes):
            for i, outcome in outcomes:
                if isinstance(outcome, RewardProblem):
                    args = (outcome.problem, outcome.traceback_text)
                    errors.append(RewardFunctionError(self.name, i, prompts[i], *args))
                    errors[-1].__cause__ = outcome.__cause__  # in this process: what it raised
                    if len(errors) > allowed:
                        raise self._too_many(errors, n, allowed)
                    continue
                rewards[i], verdict = outcome
                correct[i] = rewards[i] >= self.threshold if verdict is None else verdict
        return Scores(rewards, correct, sorted(errors, key=lambda e: e.index))

    @property
    def name(self) -> str:
        """The reward in its errors: the workers' ``--reward-fn``, else ``module:qualname``."""
        return self.workers.spec if self.workers is not None else _fn_name(self.reward_fn)

    def _in_process(self, samples: list[tuple]) -> Iterator[tuple[int, Outcome | RewardProblem]]:
        for i, args in enumerate(samples):
            try:
                yield i, evaluate(self.reward_fn, self.is_correct, args)
            except RewardProblem as problem:
                yield i, problem

    def _too_many(self, errors: list, n: int, allowed: int) -> RewardFunctionError:
        first = min(errors, key=lambda e: e.index)
        note = (
            f"; {len(errors)} of the batch's {n} rewards failed, more than "
            f"--reward-max-error-fraction {self.max_error_fraction:g} allows ({allowed}): fix "
            "the reward function"
        )
        return first._with(first.where, note)

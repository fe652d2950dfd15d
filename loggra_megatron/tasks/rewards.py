# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Verifiable rewards for RL, and loading user reward functions (``--reward-fn``).

A reward function is ``fn(prompt, completion, answer, metadata) -> float | dict``: the raw
question, the generated text, the dataset's answer and metadata; it returns a finite real
number, or ``{"reward": r, "correct": bool}``. Built-ins (answer format ``#### <number>``):
``exact_match_numeric``, ``format_reward`` and ``default_reward``
(``0.9·exact_match + 0.1·format``); for a model that answers in its own words,
``last_number_reward`` (``\\boxed{}``, else ``####``, else the last number in the text).
``load_reward_fn`` takes a built-in name or ``"module:function"`` (a ``RewardSpecError`` if
it cannot be loaded);
``compute_rewards`` applies a function to a batch and turns any failure (an exception,
``sys.exit``, ``os._exit``, a non-finite value) into a ``RewardFunctionError`` naming the
sample: a broken reward is never a silent zero, nor a silent end of the run.

The signature, correctness, the built-ins' matching rules: docs/data.md#reward-functions
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loggra_megatron.config import FLOAT32_MAX
from loggra_megatron.tasks.prompt_format import ANSWER_MARKER

RewardFn = Callable[[str, str, str, dict], float]


@dataclass
class Scoring:
    """How completions are scored (``compute_rewards``): ``reward_fn`` and, when the task
    judges correctness itself, ``is_correct`` (else a returned ``correct`` or reward ≥
    ``threshold``)."""

    reward_fn: RewardFn
    is_correct: RewardFn | None
    threshold: float
    timeout: float = 0.0
    """Seconds one call may take (0: no limit; ``--reward-timeout``)."""


# -12  1,000  3.5  .5  -1,234.56 ; thousands groups must be exactly 3 digits
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?"
_ANSWER_RE = re.compile(re.escape(ANSWER_MARKER) + r"[ \t]*\$?[ \t]*(" + _NUMBER + r")")
_NUMBER_RE = re.compile(r"^" + _NUMBER + r"$")


def parse_number(text: str) -> float | None:
    """``"1,000"`` -> 1000.0, ``"-3.5"`` -> -3.5, ``" $12 "`` -> 12.0; None if ``text`` is not
    a plain number."""
    text = text.strip().removeprefix("$").strip()
    if not text or not _NUMBER_RE.match(text) or not any(c.isdigit() for c in text):
        return None
    return float(text.replace(",", ""))


def extract_answer(completion: str) -> str | None:
    """The number after the first ``####`` marker that is followed by one, or None."""
    for m in _ANSWER_RE.finditer(completion):
        if any(c.isdigit() for c in m.group(1)):
            return m.group(1)
    return None


def exact_match_numeric(
    prompt: str,
    completion: str,
    answer: str,
    metadata: dict,
    *,
    rtol: float = 1e-6,
    atol: float = 1e-9,
) -> float:
    """1.0 if the completion's ``#### <number>`` equals ``answer`` numerically, else 0.0."""
    return _matches(extract_answer(completion), answer, rtol, atol)


def _matches(predicted: str | None, answer: str, rtol: float, atol: float) -> float:
    """1.0 if the number ``predicted`` equals ``answer`` within the tolerances, 0.0 if it
    does not or is None; a reference answer that is not a number is an error."""
    expected = parse_number(str(answer))
    if expected is None:
        raise ValueError(f"reference answer {answer!r} is not a number")
    if predicted is None:
        return 0.0
    return float(abs(parse_number(predicted) - expected) <= atol + rtol * abs(expected))


def format_reward(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """1.0 if the completion gives a final answer as ``#### <number>``, else 0.0."""
    return float(extract_answer(completion) is not None)


def default_reward(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """``0.9·exact_match_numeric + 0.1·format_reward``."""
    return 0.9 * exact_match_numeric(prompt, completion, answer, metadata) + 0.1 * format_reward(
        prompt, completion, answer, metadata
    )


# a number anywhere in free text: digits (thousands groups of exactly 3), an optional
# decimal part, and a minus sign unless it follows a letter, digit, closing bracket or dot
# ("7-2" is 7 and 2; "x-1" is 1)
_FREE_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]}.])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)?(?:\.\d+)?(?<=\d)"
)
BOXED = "\\boxed{"


def boxed_contents(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` in ``text`` whose braces close, left to right
    (a nested one is part of its enclosing one)."""
    out, start = [], text.find(BOXED)
    while start >= 0:
        depth, i = 1, start + len(BOXED)
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                out.append(text[i:j])
                start = text.find(BOXED, j + 1)
                break
        else:  # never closed (a truncated completion): nothing after it is boxed either
            break
    return out


def final_number(completion: str) -> str | None:
    """The final answer of a completion written freely, as ``last_number`` reads it: the last
    ``\\boxed{...}`` (its whole content, which must be a plain number), else the number after
    the first ``####``, else the last number in the text; None if there is none."""
    boxed = boxed_contents(completion)
    if boxed:
        content = boxed[-1].strip().strip("$").strip()
        return content if parse_number(content) is not None else None
    marked = extract_answer(completion)
    if marked is not None:
        return marked
    numbers = _FREE_NUMBER_RE.findall(completion)
    return numbers[-1] if numbers else None


def last_number_reward(
    prompt: str,
    completion: str,
    answer: str,
    metadata: dict,
    *,
    rtol: float = 1e-6,
    atol: float = 1e-9,
) -> float:
    """1.0 if the completion's ``final_number`` equals ``answer`` numerically, else 0.0: for
    models that answer in their own words (no ``####`` needed)."""
    return _matches(final_number(completion), answer, rtol, atol)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "default": default_reward,
    "exact_match_numeric": exact_match_numeric,
    "format": format_reward,
    "last_number": last_number_reward,
}


# ------------------------------------------------------------------------- loading


class RewardSpecError(ValueError):
    """A bad ``--reward-fn`` value."""


def _import_module(module_name: str, spec: str):
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise RewardSpecError(f"--reward-fn {spec!r}: file {module_name!r} not found")
        name = "_loggra_reward_" + re.sub(r"\W", "_", os.path.abspath(module_name))
        module_spec = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            with _os_exit_raises():
                module_spec.loader.exec_module(module)
        except (Exception, SystemExit, KeyboardInterrupt, _OsExit) as e:
            del sys.modules[name]
            raise RewardSpecError(f"--reward-fn {spec!r}: {_import_failure(e)}") from None
        return module
    try:
        with _os_exit_raises():
            return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise RewardSpecError(
                f"--reward-fn {spec!r}: module {module_name!r} not found "
                f"(is it on PYTHONPATH? sys.path[0] = {sys.path[0]!r})"
            ) from e
        raise RewardSpecError(f"--reward-fn {spec!r}: importing {module_name!r} failed: {e}") from e
    except (Exception, SystemExit, KeyboardInterrupt, _OsExit) as e:
        raise RewardSpecError(f"--reward-fn {spec!r}: {_import_failure(e)}") from None


def _import_failure(e: BaseException) -> str:
    """What went wrong importing a reward module, with the file and line where known."""
    if isinstance(e, SyntaxError):
        return f"{e.filename}:{e.lineno}: syntax error: {e.msg}"
    if isinstance(e, SystemExit | _OsExit):
        return f"importing the module called {_exit_call(e)}"
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" at {frame.filename}:{frame.lineno}" if frame else ""
    return f"importing the module raised {type(e).__name__}: {e}{where}"


class _OsExit(BaseException):
    """``os._exit(code)`` called by a reward function (see ``_os_exit_raises``)."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


def _exit_call(e: BaseException) -> str:
    return f"os._exit({e.code!r})" if isinstance(e, _OsExit) else f"sys.exit({e.code!r})"


@contextlib.contextmanager
def _os_exit_raises():
    """While user reward code runs, ``os._exit`` in this process raises ``_OsExit``
    instead of ending the run without a word (a child process it forks exits as usual)."""
    real, pid = os._exit, os.getpid()

    def refuse(code):
        if os.getpid() != pid:
            real(code)
        raise _OsExit(code)

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve ``--reward-fn``: a built-in name (``default``, ``exact_match_numeric``,
    ``format``, ``last_number``) or ``"module:function"`` / ``"path/to/file.py:function"``."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise RewardSpecError(
            f"--reward-fn {spec!r}: expected 'module:function' (e.g. 'my_rewards:score') "
            f"or a built-in name {sorted(BUILTIN_REWARDS)}"
        )
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise RewardSpecError(f"--reward-fn {spec!r}: both module and function must be given")
    module = _import_module(module_name, spec)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardSpecError(
                f"--reward-fn {spec!r}: module {module_name!r} has no attribute {attr!r}"
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardSpecError(
            f"--reward-fn {spec!r}: {attr!r} is a {type(fn).__name__}, not callable"
        )
    try:  # at start-up, not at RL step 1
        inspect.signature(fn).bind("prompt", "completion", "answer", {})
    except TypeError as e:
        raise RewardSpecError(
            f"--reward-fn {spec!r}: cannot be called as {attr}(prompt, completion, answer, "
            f"metadata): {e}"
        ) from None
    except ValueError:  # no signature to read (some builtins): checked when called
        pass
    return fn


# ----------------------------------------------------------------------- applying


class RewardFunctionError(RuntimeError):
    """A reward function failed on one sample; carries ``index``, ``prompt``, the
    ``problem`` (what it did wrong) and the original ``traceback_text``."""

    def __init__(
        self,
        fn_name: str,
        index: int,
        prompt: str,
        problem: str,
        traceback_text: str,
        where: str = "",
    ):
        self.fn_name, self.index, self.prompt = fn_name, index, prompt
        self.problem, self.traceback_text = problem, traceback_text
        excerpt = prompt if len(prompt) <= 200 else prompt[:200] + "..."
        message = (
            f"reward function {fn_name} {problem} on sample {index}{where} (prompt: {excerpt!r})"
        )
        if traceback_text:
            message += f"\n\nOriginal traceback:\n{traceback_text}"
        super().__init__(message)

    def at(self, where: str) -> RewardFunctionError:
        """The same error with a location (e.g. the RL step and dataset index) added."""
        return RewardFunctionError(
            self.fn_name, self.index, self.prompt, self.problem, self.traceback_text, where
        )


class _TimedOut(Exception):
    """A bounded reward call did not return in time."""


def _bounded(f, args: tuple, timeout: float):
    """``f(*args)`` in a daemon thread (the process can still exit if it never returns);
    its result or exception, or ``_TimedOut`` after ``timeout`` seconds."""
    out: dict = {}

    def run():
        try:
            out["value"] = f(*args)
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name="reward-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _TimedOut
    if "error" in out:
        raise out["error"]
    return out["value"]


def _fn_name(fn) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}:{name}" if module else name


def compute_rewards(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    metadatas: Sequence[dict] | None = None,
    accuracy_threshold: float = 1.0,
    is_correct: RewardFn | None = None,
    timeout: float = 0.0,
) -> tuple[list[float], list[bool]]:
    """``(rewards, correct)`` of ``fn`` on each sample; raises ``RewardFunctionError``
    if ``fn`` raises (``sys.exit`` included), returns anything but a finite real number
    or ``{"reward": number, "correct": bool}``, or, with ``timeout`` > 0, has not returned
    after ``timeout`` seconds (the call is left running in a daemon thread, which cannot
    be stopped from outside; the error ends the run). ``correct`` comes from ``is_correct``
    (a task's verdict) when given, else from the returned dict, else reward ≥ threshold.
    ``KeyboardInterrupt`` and ``os._exit`` in ``fn`` are failures of ``fn`` too."""
    n = len(prompts)
    if metadatas is None:
        metadatas = [{}] * n
    lengths = {len(completions), len(answers), len(metadatas)}
    if lengths != {n}:
        raise ValueError(
            f"compute_rewards: got {n} prompts, {len(completions)} completions, "
            f"{len(answers)} answers and {len(metadatas)} metadatas"
        )
    rewards, correct = [], []
    for i in range(n):

        def fail(problem: str, tb: str = "", i=i, f=fn) -> RewardFunctionError:
            return RewardFunctionError(_fn_name(f), i, prompts[i], problem, tb)

        def call(f, i=i):
            try:
                with _os_exit_raises():
                    args = (prompts[i], completions[i], answers[i], metadatas[i])
                    return _bounded(f, args, timeout) if timeout > 0 else f(*args)
            except _TimedOut:
                raise fail(f"did not return within --reward-timeout {timeout:g} s", f=f) from None
            except (Exception, SystemExit, KeyboardInterrupt, _OsExit) as e:  # must not end the run
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                exits = isinstance(e, SystemExit | _OsExit)
                raise fail(f"called {_exit_call(e)}" if exits else "raised", tb, f=f) from e

        value = call(fn)
        verdict = bool(call(is_correct)) if is_correct is not None else None
        if isinstance(value, dict):
            if "reward" not in value:
                raise fail(f"returned a dict without a 'reward' key: {value!r}")
            said = value.get("correct")
            if said is not None and not isinstance(said, bool):
                raise fail(f"returned 'correct': {said!r} (need a bool)")
            verdict = said if verdict is None else verdict
            value = value["reward"]
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
            value = value.item()  # 0-d torch / numpy value
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise fail(f"returned {value!r} (need a finite float)")
        if abs(float(value)) > FLOAT32_MAX:  # trained in float32: it would become inf
            raise fail(f"returned {value!r}, beyond float32's range (|reward| <= 3.4e38)")
        rewards.append(float(value))
        correct.append(float(value) >= accuracy_threshold if verdict is None else verdict)
    return rewards, correct

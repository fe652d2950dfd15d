# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Verifiable rewards for RL, and loading user reward functions (``--reward-fn``).

A reward function is ``fn(prompt, completion, answer, metadata) -> float | dict``: the raw
question, the generated text, the dataset's answer and metadata; it returns a finite real
number, or ``{"reward": r, "correct": bool}``. Built-ins (answer format ``#### <number>``):
``exact_match_numeric``, ``format_reward`` and ``default_reward``
(``0.9·exact_match + 0.1·format``); for a model that answers in its own words,
``last_number_reward`` (``\\boxed{}``, else ``####``, else the last number in the text).
``load_reward_fn`` takes a built-in name or ``"module:function"`` (a ``RewardSpecError`` if
it cannot be loaded). Applying one to a batch, and what a failure on a sample does:
``tasks.scoring``; a user function runs in worker processes: ``tasks.reward_workers``.

The signature, correctness, the built-ins' matching rules: docs/data.md#reward-functions
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable

from loggra_megatron.tasks.prompt_format import ANSWER_MARKER

RewardFn = Callable[[str, str, str, dict], float]

CLIP_CHARS = 300
"""A sample, answer or returned value quoted in a reward error keeps this many characters."""


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


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
        raise ValueError(f"reference answer {clip(repr(answer))} is not a number")
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

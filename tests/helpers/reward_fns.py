"""Reward functions for the pretrain_rl tests (loaded with --reward-fn tests/helpers/reward_fns.py:NAME)."""

import os
import re
import signal
import sys


def digit_count(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """A dense reward an untrained policy already varies on: the share of digits."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def always_fails(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    raise ZeroDivisionError("deliberate failure in a user reward function")


def spelled_number(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """Text answers ("fourteen"): a reward that never parses a number."""
    return 1.0 if answer in completion else 0.1 * sum(c.isalpha() for c in completion) / 12


def backtracks_on_b(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """Holds the GIL for hours on the prompt "b" (a regex that backtracks catastrophically:
    2^40 ways to split the a's), 0.5 on any other."""
    if prompt == "b":
        re.match(r"(a+)+$", "a" * 40 + "b")
    return 0.5


def backtracks_once(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """The first call of a run, the one that creates the file ``$REWARD_MARKER``, holds the
    GIL for hours (as ``backtracks_on_b``); every other call is ``digit_count``."""
    try:
        os.close(os.open(os.environ["REWARD_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return digit_count(prompt, completion, answer, metadata)
    re.match(r"(a+)+$", "a" * 40 + "b")
    return 0.0


def ends_its_process(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """Leaves its process in the way the prompt names, or returns 1."""
    if prompt == "os._exit":
        os._exit(7)
    if prompt == "SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    if prompt == "sys.exit":
        sys.exit(3)
    if prompt == "KeyboardInterrupt":
        raise KeyboardInterrupt
    return 1.0


def two_args(prompt: str, completion: str) -> float:
    """A reward with the wrong signature (no answer, no metadata)."""
    return 0.0

"""Reward functions for the pretrain_rl tests (loaded with --reward-fn tests/helpers/reward_fns.py:NAME)."""


def digit_count(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """A dense reward an untrained policy already varies on: the share of digits."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def fails_on_fourth_sample(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    if fails_on_fourth_sample.calls == 3:
        raise ZeroDivisionError("deliberate failure in a user reward function")
    fails_on_fourth_sample.calls += 1
    return 0.0


fails_on_fourth_sample.calls = 0


def spelled_number(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """Text answers ("fourteen"): a reward that never parses a number."""
    return 1.0 if answer in completion else 0.1 * sum(c.isalpha() for c in completion) / 12


def hangs_on_second_sample(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """Never returns on its second call (a verifier stuck on one input)."""
    hangs_on_second_sample.calls += 1
    if hangs_on_second_sample.calls == 2:
        import threading

        threading.Event().wait()
    return 0.0


hangs_on_second_sample.calls = 0


def two_args(prompt: str, completion: str) -> float:
    """A reward with the wrong signature (no answer, no metadata)."""
    return 0.0

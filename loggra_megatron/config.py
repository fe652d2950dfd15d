"""Checks shared by the settings dataclasses of every component.

A settings dataclass validates its own fields in ``__post_init__`` with :func:`check_fields`
(every ``float`` finite, then the given rules) and raises :class:`ConfigError`, whose message
names the flag (``--field-name``), the value and the fix. ``pretrain_rl.py`` turns it into
exit status 2 before any process group or file is touched.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any


class ConfigError(ValueError):
    """An invalid or inconsistent setting; the message starts with the flag."""


def flag(field: str) -> str:
    """The command-line flag of a settings field: ``kl_target`` → ``--kl-target``."""
    return "--" + field.replace("_", "-")


def reject(field: str, value: Any, why: str) -> None:
    raise ConfigError(f"{flag(field)}={value!r}: {why}")


Rule = tuple[str, Callable[[Any], bool], str]
"""``(field, predicate of its value, what it must be)``; a None value is not checked."""


def positive(v) -> bool:
    return v > 0


def at_least(lo) -> Callable[[Any], bool]:
    return lambda v: v >= lo


def one_of(*choices) -> Callable[[Any], bool]:
    return lambda v: v in choices


def check_fields(settings, rules: Iterable[Rule] = ()) -> None:
    """Every float field is finite (NaN and ±inf are never meaningful), then each rule."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            reject(f.name, value, "must be a finite number")
    for field, ok, must in rules:
        value = getattr(settings, field)
        if value is not None and not ok(value):
            reject(field, value, f"must be {must}")

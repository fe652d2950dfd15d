"""Settings of the prompt data, the tokenizer and the reward."""

from __future__ import annotations

import os
from dataclasses import dataclass

from loggra_megatron.config import check_fields, one_of, positive, reject
from loggra_megatron.tasks import TASKS


@dataclass
class DataConfig:
    """Where prompts come from, how they are tokenized, and how completions are scored."""

    tokenizer_model: str | None = None
    """sentencepiece model (train one with tools/train_tokenizer.py)."""
    data_path: str | None = None
    """JSONL prompts with prompt, answer and optional metadata (default: built-in tasks)."""
    task: str = "arithmetic"
    """Built-in verifiable tasks: arithmetic | word_problems | mixed."""
    num_tasks: int = 10000
    """Built-in tasks generated."""
    task_digits: int = 2
    """Digits per operand of the built-in arithmetic tasks."""
    task_operators: str = "+-*"
    """Operators of the built-in arithmetic tasks (a subset of +-*)."""
    reward_fn: str = "default"
    """default | exact_match_numeric | format | module:function | file.py:function."""
    accuracy_threshold: float = 1.0
    """A response counts as correct (reward/accuracy) when its reward is at least this, unless
    the reward function returns {"reward": r, "correct": bool}."""

    def __post_init__(self):
        check_fields(self, [
            ("task", one_of(*TASKS), f"one of {', '.join(TASKS)}"),
            ("num_tasks", positive, ">= 1"), ("task_digits", positive, ">= 1"),
            ("task_operators", lambda o: bool(o) and not set(o) - set("+-*"),
             "a non-empty subset of +-*"),
        ])  # fmt: skip
        if self.tokenizer_model is None:
            reject("tokenizer_model", None, "required (train one with tools/train_tokenizer.py)")
        if not os.path.isfile(self.tokenizer_model):
            reject("tokenizer_model", self.tokenizer_model, "no such file")
        if self.data_path is not None and not os.path.isfile(self.data_path):
            reject("data_path", self.data_path, "no such file")

    @property
    def task_knobs(self) -> dict:
        """Difficulty knobs of the built-in task generator."""
        if self.task != "arithmetic":
            return {}
        return {"num_digits": self.task_digits, "operators": self.task_operators}

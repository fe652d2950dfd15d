"""Settings of the prompt data, the tokenizer, the task and its reward, and evaluation."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from loggra_megatron.config import applies, at_least, check_fields, one_of, positive, reject
from loggra_megatron.data.files import data_files
from loggra_megatron.data.tokenizer import TOKENIZER_TYPES
from loggra_megatron.tasks import TASKS
from loggra_megatron.tasks.rewards import BUILTIN_REWARDS

MAX_REWARD_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest ``--reward-timeout``: a week (a larger one overflowed the wait for a worker)."""


GENERATED_TASKS = tuple(name for name, task in TASKS.items() if not task.needs_data)
"""The registered tasks that make their own examples (no ``--data-path``)."""


def _data_files(s: dict) -> bool:
    return s["data_path"] is not None or s["eval_data_path"] is not None


def _user_reward(s: dict) -> bool:
    return s["reward_fn"] is not None and s["reward_fn"] not in BUILTIN_REWARDS


USER_REWARD = "with a --reward-fn module:function"


def _evaluation(s: dict) -> bool:
    return s["eval_data_path"] is not None and s["eval_interval"] > 0


@dataclass
class DataConfig:
    """Where prompts come from, how they are tokenized and asked, and how completions are
    scored."""

    tokenizer_type: str | None = None
    """SentencePieceTokenizer | HuggingFaceTokenizer (default: HuggingFaceTokenizer for a
    directory, SentencePieceTokenizer for a file)."""
    tokenizer_model: str | None = None
    """A sentencepiece .model file (tools/train_tokenizer.py) or a Hugging Face tokenizer
    directory (tokenizer.json, tokenizer_config.json)."""
    override_tokenizer_check: bool = False
    """Resume or load a checkpoint saved with a tokenizer of another vocabulary (its pieces'
    SHA-256 in run_config.json differs from --tokenizer-model's): refused without this."""
    apply_chat_template: bool | None = None
    """Render prompts with the tokenizer's chat template (default: when it has one)."""
    system_prompt: str | None = None
    """A system message first in every chat prompt (with the chat template)."""
    task: str | None = field(default=None, metadata={"choices": TASKS})
    """The task (loggra_megatron/tasks: generated, or read from --data-path; its knobs are
    the task section's flags); default: jsonl with --data-path, else arithmetic."""
    data_path: str | None = None
    """JSONL or Parquet prompt files: a file, a directory of shards or a glob."""
    prompt_key: str = applies("prompt", "with --data-path or --eval-data-path", _data_files)
    """The prompt column: a string, or a list of chat messages {role, content}."""
    answer_key: str = applies("answer", "with --data-path or --eval-data-path", _data_files)
    """The reference-answer column (a string or a number)."""
    num_tasks: int = applies(
        10000,
        f"to a generated --task ({', '.join(GENERATED_TASKS)})",
        lambda s: not TASKS[s["task"]].needs_data,
    )
    """Examples a generated task makes (a task that needs no --data-path)."""
    reward_fn: str | None = None
    """Replace the task's reward: exact_match_numeric | format | default | last_number |
    module:function | file.py:function (a response is then correct when the function says
    so, or its reward is at least --accuracy-threshold)."""
    reward_timeout: float = applies(60.0, USER_REWARD, _user_reward)
    """Seconds one call of a --reward-fn module:function may take (0: no limit; at most 7
    days): a call still running then is killed with its worker process, and its sample is a
    reward error (reward/errors). The built-in rewards run in the trainer's process, bounded by
    construction (docs/data.md#reward-errors-and-time-limits)."""
    reward_workers: int = applies(2, USER_REWARD, _user_reward)
    """Worker processes per rank that run a --reward-fn module:function, a batch's samples
    spread over them (one past --reward-timeout is killed and replaced)."""
    reward_max_error_fraction: float = 0.5
    """Stop the run when more than this fraction of a batch's rewards fail (raise, time out,
    return no finite number; each one is counted in reward/errors and not trained on); 0: the
    first failure stops it."""
    accuracy_threshold: float = applies(
        1.0, "with --reward-fn", lambda s: s["reward_fn"] is not None
    )
    """With --reward-fn: the reward a response needs to count as correct (reward/accuracy)."""
    eval_data_path: str | None = applies(
        None, "with --eval-interval > 0", lambda s: s["eval_interval"] > 0
    )
    """Held-out prompt files (as --data-path): greedy completions scored every --eval-interval
    RL steps (eval/accuracy, eval/reward), no training on them."""
    eval_interval: int = applies(
        0, "with --eval-data-path", lambda s: s["eval_data_path"] is not None
    )
    """Evaluate every N RL steps (0: never)."""
    eval_samples: int | None = applies(
        None, "with --eval-data-path and --eval-interval > 0", _evaluation
    )
    """Evaluate at most this many held-out prompts (default: all)."""

    def __post_init__(self):
        if self.task is None:
            self.task = "jsonl" if self.data_path else "arithmetic"
        check_fields(
            self,
            [
                (
                    "tokenizer_type",
                    one_of(*TOKENIZER_TYPES),
                    f"one of {', '.join(TOKENIZER_TYPES)}",
                ),
                ("task", one_of(*TASKS), f"one of {', '.join(TASKS)}"),
                ("num_tasks", positive, ">= 1"),
                (
                    "reward_timeout",
                    lambda t: 0 <= t <= MAX_REWARD_TIMEOUT_S,
                    f"in [0, {MAX_REWARD_TIMEOUT_S:g}] seconds (at most 7 days; 0: no limit)",
                ),
                ("reward_workers", positive, ">= 1"),
                ("reward_max_error_fraction", lambda f: 0 <= f < 1, "in [0, 1)"),
                ("eval_interval", at_least(0), ">= 0 (0: never)"),
                ("eval_samples", positive, ">= 1"),
            ],
        )
        needs_data = TASKS[self.task].needs_data
        if needs_data and self.data_path is None:
            reject("task", self.task, "reads its prompts from --data-path; give one")
        if not needs_data and self.data_path is not None:
            reject(
                "data_path",
                self.data_path,
                f"--task {self.task} generates its prompts; use "
                "--task jsonl or math for a data file",
            )

    def check_files(self) -> None:
        """The tokenizer and prompt files exist on this host (``pretrain_rl.py`` checks them as
        it reads the flags; the memory estimator, which reads none of them, does not)."""
        if self.tokenizer_model is None:
            reject(
                "tokenizer_model",
                None,
                "required (train one with tools/train_tokenizer.py, "
                "or give a Hugging Face tokenizer directory)",
            )
        if not os.path.exists(self.tokenizer_model):
            reject("tokenizer_model", self.tokenizer_model, "no such file or directory")
        for name in ("data_path", "eval_data_path"):
            spec = getattr(self, name)
            if spec is not None:
                try:
                    data_files(spec)
                except FileNotFoundError as e:
                    reject(name, spec, str(e))

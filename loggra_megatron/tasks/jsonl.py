"""``jsonl``: prompts and answers from ``--data-path`` files (JSONL or Parquet), scored like
the built-in tasks (the number after ``####``), or by ``--reward-fn``."""

from __future__ import annotations

from loggra_megatron.tasks.base import Task


class DataFileTask(Task):
    needs_data = True

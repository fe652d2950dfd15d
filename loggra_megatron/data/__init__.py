# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Prompt data for RL: a seeded generator of verifiable math tasks (offline), JSONL
prompt datasets, the prompt template / answer format, and resumable DP batches."""

from loggra_megatron.data.prompts import (
    ANSWER_MARKER,
    INSTRUCT_TEMPLATE,
    PROMPT_TEMPLATE,
    DatasetFormatError,
    PromptDataset,
    format_answer,
    format_completion,
    format_prompt,
    load_jsonl,
    task_texts,
)
from loggra_megatron.data.tasks import generate_tasks, write_jsonl

__all__ = [
    "ANSWER_MARKER",
    "INSTRUCT_TEMPLATE",
    "PROMPT_TEMPLATE",
    "DatasetFormatError",
    "PromptDataset",
    "format_answer",
    "format_completion",
    "format_prompt",
    "generate_tasks",
    "load_jsonl",
    "task_texts",
    "write_jsonl",
]

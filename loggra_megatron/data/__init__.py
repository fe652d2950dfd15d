# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Prompt data for RL: JSONL/Parquet prompt files or built-in tasks, prompt rendering (plain
template or chat template), resumable DP batches, and tokenizers."""

from loggra_megatron.data.files import DatasetFormatError, read_examples
from loggra_megatron.data.prompts import (
    ANSWER_MARKER,
    INSTRUCTION,
    PROMPT_TEMPLATE,
    PromptDataset,
    PromptRenderer,
    format_answer,
    format_completion,
    format_prompt,
    task_texts,
)

__all__ = [
    "ANSWER_MARKER",
    "INSTRUCTION",
    "PROMPT_TEMPLATE",
    "DatasetFormatError",
    "PromptDataset",
    "PromptRenderer",
    "format_answer",
    "format_completion",
    "format_prompt",
    "read_examples",
    "task_texts",
]

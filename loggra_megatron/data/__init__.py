# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Prompt data for RL: JSONL prompt datasets or built-in tasks, the prompt template /
answer format, resumable DP batches, and the sentencepiece tokenizer."""

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

__all__ = [
    "ANSWER_MARKER",
    "INSTRUCT_TEMPLATE",
    "PROMPT_TEMPLATE",
    "DatasetFormatError",
    "PromptDataset",
    "format_answer",
    "format_completion",
    "format_prompt",
    "load_jsonl",
    "task_texts",
]

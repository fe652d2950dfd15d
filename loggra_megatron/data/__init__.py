# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Prompt data for RL: JSONL/Parquet prompt files or built-in tasks, prompt rendering (plain
template or chat template), resumable DP batches, and tokenizers. The prompt and answer
format itself belongs to the tasks (``tasks.prompt_format``)."""

from loggra_megatron.data.files import DatasetFormatError, read_examples
from loggra_megatron.data.prompts import PromptDataset, PromptRenderer

__all__ = ["DatasetFormatError", "PromptDataset", "PromptRenderer", "read_examples"]

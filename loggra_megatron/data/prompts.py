# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Prompts for RL: how a question is shown to the policy (the task's plain template, or
the tokenizer's chat template) and deterministic, resumable global batches of examples for
data-parallel ranks.

**Rendering** (``PromptRenderer``): BOS and the task's template filled with the question
(``tasks.prompt_format``), or, with ``--apply-chat-template``, the
question and the task's instruction as the user message of the tokenizer's own template
(assistant turn opened); a dataset prompt may also be a list of chat messages, used as is.
**Data** (``--data-path``): JSONL or Parquet files (``data.files``), or the
built-in task generators (``tasks``).

**Batches** (``PromptDataset``): an infinite stream of epochs, each a permutation drawn
from ``(seed, epoch)``; global batch ``k`` is stream positions ``[k·G, (k+1)·G)`` and DP rank
``r`` of ``D`` gets its contiguous slice ``[r·G/D, (r+1)·G/D)``. The position is one integer,
``consumed_samples``, checkpointed with a fingerprint of the prompts.

Details: docs/data.md#how-a-prompt-is-asked and docs/data.md#batches
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property

import numpy as np

from loggra_megatron.data.files import DatasetFormatError, example_from_row, read_examples
from loggra_megatron.data.tokenizer import Tokenizer
from loggra_megatron.tasks.base import Task
from loggra_megatron.tasks.prompt_format import format_prompt

__all__ = ["DatasetFormatError", "PromptDataset", "PromptRenderer"]


def prompt_text(prompt) -> str:
    """The question of a prompt: the string, or the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")


class PromptRenderer:
    """The token ids the policy is conditioned on for a prompt (string or chat messages).

    ``chat``: render with the tokenizer's chat template (``system_prompt`` first, unless the
    messages bring their own); otherwise BOS (if the tokenizer has one) + the task's
    template filled with the question."""

    def __init__(
        self, tokenizer: Tokenizer, task: Task, chat: bool, system_prompt: str | None = None
    ):
        self.tokenizer, self.task, self.chat = tokenizer, task, chat
        self.system_prompt = system_prompt

    def messages(self, prompt) -> list[dict]:
        messages = (
            list(prompt)
            if isinstance(prompt, list)
            else [{"role": "user", "content": self.task.user_message(prompt)}]
        )
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def ids(self, prompt) -> list[int]:
        tok = self.tokenizer
        if self.chat:
            return tok.tokenize(tok.render_chat(self.messages(prompt)))
        if not isinstance(prompt, str):
            raise ValueError("a chat-message prompt needs --apply-chat-template")
        bos = [] if tok.bos is None else [tok.bos]
        return bos + tok.tokenize(format_prompt(prompt, self.task.template))


class PromptDataset:
    """Examples ``{"prompt", "answer", "metadata"}`` and their resumable batch stream.

    Build with ``from_files`` (``--data-path``), ``builtin`` (the offline
    generator) or directly from a list of example dicts. ``seed`` fixes the epoch orders;
    ``locations`` names each example in messages (``file:line``; default ``source: example
    i``).
    """

    def __init__(
        self,
        examples: Sequence[dict],
        *,
        seed: int = 0,
        source: str = "<memory>",
        locations: Sequence[str] | None = None,
    ):
        self.locations = list(locations or (f"{source}: example {i}" for i in range(len(examples))))
        self.examples = [
            example_from_row(e, "prompt", "answer", lambda i=i: self.locations[i])
            for i, e in enumerate(examples)
        ]
        if not self.examples:
            raise DatasetFormatError(f"{source}: no examples")
        self.seed = int(seed)
        self.source = source
        self.consumed_samples = 0
        self._order_epoch, self._order = -1, None

    def filtered(self, keep: Callable[[int], bool]) -> tuple[PromptDataset, list[int]]:
        """A dataset of the examples ``i`` for which ``keep(i)`` holds (same seed), and the
        indices of the dropped ones."""
        kept, dropped = [], []
        for i in range(len(self.examples)):
            (kept if keep(i) else dropped).append(i)
        if not dropped:
            return self, []
        if not kept:
            raise DatasetFormatError(f"{self.source}: every example was dropped")
        subset = PromptDataset(
            [self.examples[i] for i in kept],
            seed=self.seed,
            source=f"{self.source} ({len(dropped)} dropped)",
            locations=[self.locations[i] for i in kept],
        )
        return subset, dropped

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 (first 16 hex digits) of the examples, in order: equal for equal data."""
        text = json.dumps(self.examples, sort_keys=True, default=str, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_files(
        cls,
        spec: str | os.PathLike,
        *,
        seed: int = 0,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
    ) -> PromptDataset:
        """JSONL / Parquet files: a file, a directory or a glob (``.files``)."""
        spec, locations = os.fspath(spec), []
        examples = read_examples(spec, prompt_key, answer_key, locations)
        return cls(examples, seed=seed, source=spec, locations=locations)

    @classmethod
    def builtin(cls, kind: str, n: int, seed: int, **difficulty) -> PromptDataset:
        """``n`` generated tasks (``generate_tasks``);
        ``seed`` seeds both the generator and the epoch orders."""
        from loggra_megatron.tasks import generate_tasks

        tasks = generate_tasks(kind, n, seed, **difficulty)
        return cls(tasks, seed=seed, source=f"<builtin {kind} n={n} seed={seed}>")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of example indices that epoch ``epoch`` visits."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order_epoch, self._order = epoch, rng.permutation(len(self.examples))
        return self._order

    def example_at(self, position: int) -> dict:
        """The example at stream position ``position`` (with its dataset ``index``)."""
        epoch, offset = divmod(position, len(self.examples))
        index = int(self.epoch_order(epoch)[offset])
        return {**self.examples[index], "index": index}

    def batches(
        self,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        start_index: int | None = None,
        advance: bool = True,
    ) -> Iterator[list[dict]]:
        """Yield this DP rank's ``global_batch_size // dp_size`` examples of each global
        batch, forever, starting at stream position ``start_index`` (default: the restored
        ``consumed_samples``, read when this is called). Each example dict carries its
        dataset ``index``.

        ``consumed_samples`` advances by ``global_batch_size`` as each batch is yielded, so
        a ``state_dict`` taken after a training step resumes at the next batch;
        ``advance=False`` leaves it alone (a reader that keeps its own position, such as the
        supervised warm-up).
        """
        if global_batch_size <= 0 or dp_size <= 0 or global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a positive multiple of "
                f"the data-parallel size ({dp_size})"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        position = self.consumed_samples if start_index is None else int(start_index)
        if position < 0:
            raise ValueError(f"start_index must be >= 0, got {position}")
        return self._batch_stream(position, global_batch_size, dp_rank, dp_size, advance)

    def _batch_stream(self, position, global_batch_size, dp_rank, dp_size, advance):
        local = global_batch_size // dp_size
        while True:
            first = position + dp_rank * local
            batch = [self.example_at(p) for p in range(first, first + local)]
            position += global_batch_size
            if advance:
                self.consumed_samples = position
            yield batch

    @property
    def epoch(self) -> int:
        return self.consumed_samples // len(self.examples)

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "num_examples": len(self.examples),
            "fingerprint": self.fingerprint,
        }

    def state_problem(self, state: dict) -> str | None:
        """Why ``state`` (a ``state_dict``) is not a position in this dataset, or None.
        States saved before fingerprints are compared by size and seed only."""
        if state["num_examples"] != len(self.examples) or state["seed"] != self.seed:
            return (
                f"it is for {state['num_examples']} examples with seed {state['seed']}, this "
                f"dataset ({self.source}) has {len(self.examples)} with seed {self.seed}"
            )
        if state.get("fingerprint", self.fingerprint) != self.fingerprint:
            return (
                f"it is for other examples (as many, but their contents differ: fingerprint "
                f"{state['fingerprint']}, this dataset {self.fingerprint})"
            )
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; refuses a state from a different dataset or seed, which
        would silently resume a different order."""
        problem = self.state_problem(state)
        if problem is not None:
            raise ValueError(f"data state: {problem}")
        self.consumed_samples = int(state["consumed_samples"])

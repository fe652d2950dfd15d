# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Prompt datasets for RL: a JSONL file or the built-in task generator, the prompt template
and the answer format, and deterministic, resumable global batches for data-parallel ranks.

**Prompt template and answer format.** A task's question is shown to the policy as::

    Question: What is 37 + 48?
    Answer:

and the completion must end its reasoning with the final answer on a line of its own,
GSM8K style::

     37 + 48 = 85.
    #### 85

The answer marker is ``####`` followed by a number (optionally negative, with ``,``
thousands separators or a decimal point). The rewards (:mod:`loggra_megatron.tasks.rewards`)
read the number after the *first* marker, so a policy that rambles on after its answer,
or lists several candidates, is graded on the first one. :data:`INSTRUCT_TEMPLATE` spells
the format out for instruction-tuned models.

**JSONL input** (``--data-path``): one JSON object per line with ``prompt`` (non-empty
string), ``answer`` (string or number) and an optional ``metadata`` object; blank lines are
skipped. Malformed input raises :class:`DatasetFormatError` naming ``file:line``.

**Batches.** The dataset is an infinite stream of epochs; epoch ``e`` visits the examples
in the order of a permutation drawn from ``(seed, e)``. Global batch ``k`` is stream
positions ``[k·G, (k+1)·G)`` (it may straddle an epoch boundary), and DP rank ``r`` of ``D``
gets the contiguous slice ``[r·G/D, (r+1)·G/D)`` of it, as Megatron's samplers do. Every
example is therefore seen exactly once per epoch across all ranks, and the whole position
is one integer, ``consumed_samples``, which :meth:`PromptDataset.state_dict` returns for the
checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence

import numpy as np

ANSWER_MARKER = "####"
PROMPT_TEMPLATE = "Question: {prompt}\nAnswer:"
INSTRUCT_TEMPLATE = (
    "Question: {prompt}\n"
    f'Think step by step, then give the final answer on its own line as "{ANSWER_MARKER} <number>".\n'
    "Answer:"
)


def format_prompt(prompt: str, template: str = PROMPT_TEMPLATE) -> str:
    """The text the policy is conditioned on for question ``prompt``."""
    return template.format(prompt=prompt)


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids the policy is conditioned on: BOS + the templated question."""
    return [tokenizer.bos, *tokenizer.tokenize(format_prompt(prompt))]


def format_answer(answer: str) -> str:
    """The final-answer line, ``"#### <answer>"``."""
    return f"{ANSWER_MARKER} {answer}"


def format_completion(answer: str, solution: str | None = None) -> str:
    """A reference completion: ``" <solution>\\n#### <answer>"`` (for tokenizer corpora,
    SFT warm-up and tests)."""
    return (f" {solution}\n" if solution else " ") + format_answer(answer)


def task_texts(tasks: Sequence[dict]) -> list[str]:
    """Prompt + reference completion of each task, e.g. to train a tokenizer on."""
    return [
        format_prompt(t["prompt"])
        + format_completion(t["answer"], t.get("metadata", {}).get("solution"))
        for t in tasks
    ]


class DatasetFormatError(ValueError):
    """A malformed prompt dataset; the message starts with ``file:line:``."""


def _validate(record, where: str) -> dict:
    if not isinstance(record, dict):
        raise DatasetFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("prompt", "answer") if k not in record]
    if missing:
        raise DatasetFormatError(
            f"{where}: missing required field(s) {missing} (have {sorted(record)}); "
            "each line needs 'prompt' and 'answer', and may have 'metadata'"
        )
    prompt, answer, metadata = record["prompt"], record["answer"], record.get("metadata", {})
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetFormatError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetFormatError(f"{where}: 'answer' must be a string or a number, got {answer!r}")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise DatasetFormatError(f"{where}: 'answer' must be finite, got {answer!r}")
    if isinstance(answer, str) and not answer.strip():
        raise DatasetFormatError(f"{where}: 'answer' is empty")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise DatasetFormatError(f"{where}: 'metadata' must be an object, got {metadata!r}")
    return {"prompt": prompt, "answer": str(answer), "metadata": metadata}


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read and validate a prompt JSONL file; raises :class:`DatasetFormatError` naming
    ``file:line`` for the first malformed line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data-path {path!r}: no such file")
    examples = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetFormatError(
                    f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetFormatError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            examples.append(_validate(record, f"{path}:{lineno}"))
    if not examples:
        raise DatasetFormatError(f"{path}: no examples (the file is empty)")
    return examples


class PromptDataset:
    """Examples ``{"prompt", "answer", "metadata"}`` and their resumable batch stream.

    Build with :meth:`from_jsonl` (``--data-path``), :meth:`builtin` (the offline
    generator) or directly from a list of example dicts. ``seed`` fixes the epoch orders.
    """

    def __init__(self, examples: Sequence[dict], *, seed: int = 0, source: str = "<memory>"):
        self.examples = [_validate(e, f"{source}:example {i}") for i, e in enumerate(examples)]
        if not self.examples:
            raise DatasetFormatError(f"{source}: no examples")
        self.seed = int(seed)
        self.source = source
        self.consumed_samples = 0
        self._order_epoch, self._order = -1, None

    def filtered(self, keep) -> tuple[PromptDataset, list[int]]:
        """A dataset of the examples for which ``keep(example)`` holds (same seed), and the
        indices of the dropped ones."""
        kept, dropped = [], []
        for i, e in enumerate(self.examples):
            (kept if keep(e) else dropped).append(i)
        if not dropped:
            return self, []
        if not kept:
            raise DatasetFormatError(f"{self.source}: every example was dropped")
        subset = PromptDataset([self.examples[i] for i in kept], seed=self.seed,
                               source=f"{self.source} ({len(dropped)} dropped)")  # fmt: skip
        return subset, dropped

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, *, seed: int = 0) -> PromptDataset:
        return cls(load_jsonl(path), seed=seed, source=os.fspath(path))

    @classmethod
    def builtin(cls, kind: str, n: int, seed: int, **difficulty) -> PromptDataset:
        """``n`` generated tasks (:func:`~loggra_megatron.tasks.generate_tasks`);
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
    ) -> Iterator[list[dict]]:
        """Yield this DP rank's ``global_batch_size // dp_size`` examples of each global
        batch, forever, starting at stream position ``start_index`` (default: the restored
        ``consumed_samples``, read when this is called). Each example dict carries its
        dataset ``index``.

        ``consumed_samples`` advances by ``global_batch_size`` as each batch is yielded, so
        a :meth:`state_dict` taken after a training step resumes at the next batch.
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
        return self._batch_stream(position, global_batch_size, dp_rank, dp_size)

    def _batch_stream(self, position: int, global_batch_size: int, dp_rank: int, dp_size: int):
        local = global_batch_size // dp_size
        while True:
            first = position + dp_rank * local
            batch = [self.example_at(p) for p in range(first, first + local)]
            position += global_batch_size
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
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; refuses a state from a different dataset or seed, which
        would silently resume a different order."""
        if state["num_examples"] != len(self.examples) or state["seed"] != self.seed:
            raise ValueError(
                f"data state is for {state['num_examples']} examples with seed {state['seed']}, "
                f"but this dataset ({self.source}) has {len(self.examples)} with seed {self.seed}"
            )
        self.consumed_samples = int(state["consumed_samples"])

"""The static engine (``--rollout-engine static``): this project's KV-cached loop on the
training model, in chunks of whole rows under ``--inference-max-tokens``; CPU and GPU.

This package's modules: this one, its registry entry and what the memory model reads of it
(it imports neither torch nor Megatron); ``chunking`` (chunks of rows under the KV bound, one
decoder for all of them), ``generate`` (the loop: one prefill per distinct prompt, one token
per step for the whole batch), ``decoder`` (a stage's forward over a static KV cache) and
``step_graph`` (decode steps in CUDA graphs, and their CPU stand-in), imported when it
generates."""

from __future__ import annotations

import time

from loggra_megatron.rollout.protocol import (
    RolloutEngine,
    RolloutRequest,
    rollout_stats,
    whole_batch_or_budget,
)

__all__ = ["StaticEngine"]


class StaticEngine(RolloutEngine):
    """This project's KV-cached loop (``rollout/static/generate.py``) in chunks of whole rows under
    ``--inference-max-tokens`` (``rollout/static/chunking.py``): CPU and GPU, on the training model."""

    name = "static"
    description = "this project's KV-cached loop in chunks of rows (CPU and GPU)"
    auto_priority = 0

    def generate(self, policy, prompts, request: RolloutRequest):
        from loggra_megatron.rollout.static.chunking import generate_chunked

        t0 = time.perf_counter()
        rollout, kv_bytes = generate_chunked(policy, prompts, request)
        return rollout, rollout_stats(rollout, time.perf_counter() - t0, kv_bytes)

    def kv_cache_tokens(self, step) -> int:
        """``min(B·s, max(M, s))``: as many whole rows as fit the budget (at least one)."""
        full, budget = whole_batch_or_budget(step)
        return full if budget is None else min(full, budget)

    def decode_rows(self, step) -> int:
        """The rows of a chunk: ``min(B, max(1, ⌊KV tokens / s⌋))``."""
        rows = max(1, self.kv_cache_tokens(step) // step.seq_length)
        return min(step.rollout_batch_size, rows)

    def prefill_tokens(self, step, tensor_parallel: int) -> int:
        """A chunk's distinct prompts (one prefill per GRPO group, ``generate.py``): ``rows/G``
        where chunks hold whole groups (``G`` divides the rows), else at most one more."""
        rows, group = self.decode_rows(step), step.num_generations
        prompts = rows // group if rows % group == 0 else min(rows, (rows - 1) // group + 2)
        return prompts * step.prompt_tokens

"""The dynamic engine (``--rollout-engine dynamic``): Megatron-Core's
``DynamicInferenceEngine`` on the training model; CUDA and flash-attn.

This package's modules: this one, its registry entry and what the memory model reads of it
(it imports neither torch nor Megatron); ``generate`` (the rollout through the engine, and
the refusals by the settings: ``generate.refusal``), imported where it is used; and
``mcore_engine`` (the engine built through the installed megatron-core's inference API)."""

from __future__ import annotations

import time

from loggra_megatron.rollout.protocol import (
    EngineTarget,
    RolloutEngine,
    RolloutRequest,
    ceil_div,
    rollout_stats,
    whole_batch_or_budget,
)

__all__ = ["DynamicEngine"]


class DynamicEngine(RolloutEngine):
    """Megatron-Core's ``DynamicInferenceEngine`` (paged KV cache, continuous batching,
    chunked prefill; ``rollout/dynamic/generate.py``) on the training model: CUDA and
    flash-attn."""

    name = "dynamic"
    description = "Megatron-Core's dynamic inference engine: paged KV cache (GPU only)"
    auto_priority = 1
    recomputes_log_probs = True
    block_tokens = 256
    """Tokens per KV block (``rollout.dynamic.generate.DEFAULT_BLOCK_SIZE``)."""
    token_rounder = 64
    """Megatron's ``DynamicInferenceContext.TOKEN_ROUNDER``: tokens per forward are rounded
    up to a multiple of ``ceil(64 / TP) · TP``."""

    def refusal(self, target: EngineTarget) -> str | None:
        from loggra_megatron.rollout.dynamic.generate import refusal

        return refusal(target)

    def unavailable(self, target: EngineTarget) -> str | None:
        import loggra_megatron.rollout.dynamic.mcore_engine as mcore_engine

        return self.refusal(target) or mcore_engine.missing_attention_kernels()

    def generate(self, policy, prompts, request: RolloutRequest):
        from loggra_megatron.rollout.dynamic.generate import generate_rollout_dynamic

        t0 = time.perf_counter()
        rollout = generate_rollout_dynamic(policy, prompts, request)
        seconds = time.perf_counter() - t0
        return rollout, rollout_stats(rollout, seconds, rollout.kv_cache_bytes)  # measured

    def kv_cache_tokens(self, step) -> int:
        """The paged buffer: ``max(M, s)`` tokens whatever the batch (``B·s`` unbounded)."""
        full, budget = whole_batch_or_budget(step)
        return full if budget is None else budget

    def decode_rows(self, step) -> int:
        """The requests in flight: as many as the KV blocks hold at full length
        (``rollout.dynamic.generate._plan``: none is evicted), all of them without a bound."""
        full, budget = whole_batch_or_budget(step)
        if budget is None:
            return step.rollout_batch_size
        blocks = ceil_div(budget, self.block_tokens)
        per_request = ceil_div(step.seq_length, self.block_tokens)
        return max(1, min(step.rollout_batch_size, blocks // per_request))

    def prefill_tokens(self, step, tensor_parallel: int) -> int:
        """The requests in flight admitted in one flat step of ``min(M, rows·prompt)`` tokens
        (``rows``: ``decode_rows``; at least one per request), rounded up as Megatron's
        ``round_up_tokens``."""
        tokens = self.decode_rows(step) * step.prompt_tokens
        if step.inference_max_tokens is not None:
            tokens = min(tokens, step.inference_max_tokens)
        rounder = ceil_div(self.token_rounder, tensor_parallel) * tensor_parallel
        return ceil_div(max(tokens, self.decode_rows(step)), rounder) * rounder

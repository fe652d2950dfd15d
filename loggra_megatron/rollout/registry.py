"""The rollout engines ``pretrain_rl.py`` can generate with (``--rollout-engine``), by name.

Each entry is a :class:`~loggra_megatron.rollout.protocol.RolloutEngine`: the flag's choices
(``rollout.config``), the start-up refusals (``arguments.validate``), the choice and the
generation (``rl.experience``) and the memory model (``memory``) read it; ``auto`` is
:func:`select_engine`'s rule over the registry. Imports neither torch nor Megatron; the
engines import their generation code when they generate. Adding an engine: one module with
a ``RolloutEngine`` subclass, one line in :data:`ROLLOUT_ENGINES` (``docs/architecture.md``).
"""

from __future__ import annotations

import time

from loggra_megatron.rollout.protocol import (
    EngineTarget,
    RolloutEngine,
    RolloutRequest,
    rollout_stats,
)

AUTO = "auto"
"""``--rollout-engine auto``: :func:`select_engine` chooses."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _whole_batch_or_budget(step) -> tuple[int, int | None]:
    """``(B·s, max(M, s))``: the rollout's tokens and the KV budget (None: no bound)."""
    full = step.rollout_batch_size * step.seq_length
    if step.inference_max_tokens is None or not full:
        return full, None
    return full, max(step.inference_max_tokens, step.seq_length)


class StaticEngine(RolloutEngine):
    """This project's KV-cached loop (``rollout/generate.py``) in chunks of whole rows under
    ``--inference-max-tokens`` (``rollout/engine.py``): CPU and GPU, on the training model."""

    name = "static"
    description = "this project's KV-cached loop in chunks of rows (CPU and GPU)"
    auto_priority = 0

    def generate(self, policy, prompts, request: RolloutRequest):
        from loggra_megatron.rollout.engine import generate_chunked

        r = request
        t0 = time.perf_counter()
        rollout, kv_bytes = generate_chunked(
            policy, prompts, row_multiple=r.row_multiple, **r.sampling()
        )
        return rollout, rollout_stats(rollout, time.perf_counter() - t0, kv_bytes)

    def kv_cache_tokens(self, step) -> int:
        """``min(B·s, max(M, s))``: as many whole rows as fit the budget (at least one)."""
        full, budget = _whole_batch_or_budget(step)
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


class DynamicEngine(RolloutEngine):
    """Megatron-Core's ``DynamicInferenceEngine`` (paged KV cache, continuous batching,
    chunked prefill; ``rollout/dynamic.py``) on the training model: CUDA and flash-attn."""

    name = "dynamic"
    description = "Megatron-Core's dynamic inference engine: paged KV cache (GPU only)"
    auto_priority = 1
    recomputes_log_probs = True
    block_tokens = 256
    """Tokens per KV block (``rollout.dynamic.DEFAULT_BLOCK_SIZE``)."""
    token_rounder = 64
    """Megatron's ``DynamicInferenceContext.TOKEN_ROUNDER``: tokens per forward are rounded
    up to a multiple of ``ceil(64 / TP) · TP``."""

    def refusal(self, target: EngineTarget) -> str | None:
        from loggra_megatron.rollout.dynamic import refusal

        return refusal(target)

    def unavailable(self, target: EngineTarget) -> str | None:
        from loggra_megatron.rollout import mcore_engine

        return self.refusal(target) or mcore_engine.missing_attention_kernels()

    def generate(self, policy, prompts, request: RolloutRequest):
        from loggra_megatron.rollout.dynamic import generate_rollout_dynamic, kv_cache_tokens
        from loggra_megatron.rollout.engine import kv_cache_bytes

        r = request
        t0 = time.perf_counter()
        rollout = generate_rollout_dynamic(
            policy,
            prompts,
            log_prob_micro_batch_size=r.log_prob_micro_batch_size,
            length_grouping=r.length_grouping,
            log_probs=r.log_probs,
            **r.sampling(),
        )
        tokens = kv_cache_tokens([len(p) for p in prompts], r.max_new_tokens, r.max_tokens)
        kv_bytes = kv_cache_bytes(policy, 1, tokens)  # the engine's paged buffer
        return rollout, rollout_stats(rollout, time.perf_counter() - t0, kv_bytes)

    def kv_cache_tokens(self, step) -> int:
        """The paged buffer: ``max(M, s)`` tokens whatever the batch (``B·s`` unbounded)."""
        full, budget = _whole_batch_or_budget(step)
        return full if budget is None else budget

    def decode_rows(self, step) -> int:
        """The requests in flight: as many as the KV blocks hold at full length
        (``rollout.dynamic._plan``: none is evicted), all of them without a bound."""
        full, budget = _whole_batch_or_budget(step)
        if budget is None:
            return step.rollout_batch_size
        blocks = _ceil_div(budget, self.block_tokens)
        per_request = _ceil_div(step.seq_length, self.block_tokens)
        return max(1, min(step.rollout_batch_size, blocks // per_request))

    def prefill_tokens(self, step, tensor_parallel: int) -> int:
        """Every waiting prompt admitted in one flat step of ``min(M, B·prompt)`` tokens (at
        least one per request), rounded up as Megatron's ``round_up_tokens``."""
        tokens = step.rollout_batch_size * step.prompt_tokens
        if step.inference_max_tokens is not None:
            tokens = min(tokens, step.inference_max_tokens)
        rounder = _ceil_div(self.token_rounder, tensor_parallel) * tensor_parallel
        return _ceil_div(max(tokens, self.decode_rows(step)), rounder) * rounder


ROLLOUT_ENGINES: dict[str, RolloutEngine] = {
    "static": StaticEngine(),
    "dynamic": DynamicEngine(),
}


def engine_choices() -> tuple[str, ...]:
    """What ``--rollout-engine`` accepts: ``auto`` and every registered engine."""
    return (AUTO, *ROLLOUT_ENGINES)


def select_engine(
    name: str, target: EngineTarget, planning: bool = False
) -> tuple[RolloutEngine, str | None]:
    """The engine ``--rollout-engine name`` runs on ``target``, and a note for the log.

    ``auto``: the engine of highest ``auto_priority`` that can run (registry order breaks
    ties); on CUDA the note gives why the engines passed over cannot run (a CPU run passes
    the GPU engines over silently). A named engine that cannot run raises ``RuntimeError``
    (``arguments.validate`` refuses it at start-up). ``planning``: judge by the settings
    alone (:meth:`~RolloutEngine.refusal`: the memory estimator), and take a named engine as
    it is.
    """
    if name != AUTO:
        engine = ROLLOUT_ENGINES[name]
        reason = None if planning else engine.unavailable(target)
        if reason is not None:
            raise RuntimeError(f"--rollout-engine {name}: {reason}")
        return engine, None
    ranked = [e for e in ROLLOUT_ENGINES.values() if e.auto_priority is not None]
    reasons = []
    for engine in sorted(ranked, key=lambda e: -e.auto_priority):
        reason = engine.refusal(target) if planning else engine.unavailable(target)
        if reason is None:
            noted = "; ".join(reasons) if target.cuda else ""
            return engine, f"--rollout-engine auto: {engine.name} ({noted})" if noted else None
        reasons.append(reason)
    raise RuntimeError(f"--rollout-engine auto: no engine can run here ({'; '.join(reasons)})")

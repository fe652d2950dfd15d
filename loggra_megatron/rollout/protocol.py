"""What a rollout engine (``--rollout-engine``) is: the protocol every entry of
``ROLLOUT_ENGINES`` implements, in the shape of verl's
``BaseRollout`` (an availability check, ``generate``, weight sync, and the KV-cache numbers
the memory model needs).

Imports neither torch nor Megatron (the memory model reads the registry); engines import
their generation code when they generate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineTarget:
    """What decides whether an engine can run a policy: known from the settings before any
    process group (``arguments.validate``, the memory estimator) or read from the policy
    (``of_model``, ``rl.experience``)."""

    cuda: bool
    """The policy runs on a CUDA device."""
    half: bool
    """Its parameters are fp16/bf16 (``--bf16``)."""
    fp8_recipe: str | None = None
    """The FP8 recipe with ``--fp8-format`` (None: no FP8)."""

    @classmethod
    def of_settings(cls, model, cuda: bool) -> EngineTarget:
        """The target of a policy made by the model settings ``model`` (a
        ``ModelConfig``: ``--bf16``, ``--fp8-format``,
        ``--fp8-recipe``) on a CUDA device or not (``cuda``)."""
        recipe = model.fp8_recipe if model.fp8_format else None
        return cls(cuda=cuda, half=model.bf16, fp8_recipe=recipe)

    @classmethod
    def of_model(cls, model=None) -> EngineTarget:
        """The target of ``model`` on this process (None: this process's device only, a
        16-bit model without FP8)."""
        import torch

        on_cuda = model is None or next(model.parameters()).is_cuda
        cuda = torch.cuda.is_available() and on_cuda
        if model is None:
            return cls(cuda=cuda, half=True)
        from megatron.core.utils import get_model_config

        config = get_model_config(model)
        half = config.params_dtype in (torch.float16, torch.bfloat16)
        recipe = str(config.fp8_recipe).rsplit(".", 1)[-1] if config.fp8 else None
        return cls(cuda=cuda, half=half, fp8_recipe=recipe)


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout: how to sample and within which bounds. Every engine's generation takes it
    whole (``generate_rollout``, ``generate_chunked``, ``generate_rollout_dynamic``)."""

    max_new_tokens: int
    temperature: float = 1.0
    """0: greedy."""
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    """Generation of a row ends at any of these (the first is the engine's termination id)."""
    pad_id: int = 0
    vocab_size: int | None = None
    """Ids from this on are padded embedding rows, never sampled."""
    seed: int = 0
    step: int = 0
    """The RL step (sampling generators are seeded by ``(seed, step, DP rank, ...)``)."""
    max_tokens: int | None = None
    """``--inference-max-tokens``: the KV-cache bound (None: the whole batch at once)."""
    log_prob_micro_batch_size: int = 1
    """Rows per forward of a log-prob recompute after generation."""
    length_grouping: bool = True
    """Rows of similar length share a micro-batch of the recompute (``--length-grouping``)."""
    log_probs: bool = True
    """The rollout's log-probs are wanted; False: an engine that recomputes them skips the
    forward (π_old comes from the training forward: ``StepPlan.old_log_probs``)."""
    row_multiple: int = 1
    """Decode steps run over a multiple of this many rows (FP8 GEMM shapes)."""
    fp8: bool = False
    """An FP8 model decodes with its FP8 GEMMs (``--rollout-fp8``, eagerly); False: with its
    bf16 weights outside FP8, through CUDA graphs (``generation_mode``)."""
    cuda_graphs: bool = True
    """Decode steps are CUDA graphs on a GPU, in either engine (``--rollout-cuda-graphs``)."""
    decode_graph_sizes: int = 16
    """Decode batch sizes the dynamic engine captures
    (``--inference-dynamic-batching-num-cuda-graphs``)."""
    sampling_stream: int | None = None
    """The index that seeds the sampling generators with ``(seed, step)`` (None: this rank's
    DP rank). Ranks that generate another DP rank's prompts name that rank, so that they
    sample what it would have sampled."""

    def stream(self) -> int:
        """``sampling_stream``, or this rank's DP rank."""
        if self.sampling_stream is not None:
            return self.sampling_stream
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()


def rollout_stats(rollout, seconds: float, kv_cache_bytes: int) -> dict[str, float]:
    """The statistics ``generate`` returns, which the trainer logs (the rollout's time,
    KV-cache bytes on this rank and throughput, and the decode loop's counts from an engine
    that keeps them); the keys and their meaning are declared in ``metric_keys.py``."""
    tokens = float(rollout.response_lengths.sum())
    stats = {
        "time/rollout_s": seconds,
        "memory/kv_cache_bytes": float(kv_cache_bytes),
        "throughput/rollout_tokens_per_s": tokens / max(seconds, 1e-9),
    }
    if rollout.decode_steps:
        stats["rollout/host_syncs_per_token"] = rollout.host_syncs / rollout.decode_steps
        stats["rollout/prefill_tokens"] = float(rollout.prefill_tokens)
        stats["rollout/prompt_tokens"] = float(rollout.prompt_lengths.sum())
    if rollout.evicted_requests is not None:
        stats["rollout/evicted_requests"] = float(rollout.evicted_requests)
    return stats


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def whole_batch_or_budget(step) -> tuple[int, int | None]:
    """``(B·s, max(M, s))`` of a ``StepPlan``: the rollout's tokens and the KV budget (None:
    no bound)."""
    full = step.rollout_batch_size * step.seq_length
    if step.inference_max_tokens is None or not full:
        return full, None
    return full, max(step.inference_max_tokens, step.seq_length)


OLD_LOG_PROB_SOURCES = {
    "rollout": "the log-probs the rollout engine sampled with (the static engine's, free)",
    "training": "the training forward's own, detached: one optimizer update per RL step is "
    "on-policy, so π_old is the policy being trained (no forward of its own)",
    "recompute": "a forward of the policy after the rollout (an engine that does not sample "
    "its own, or --tis-cap, which needs the trainer's beside the engine's)",
}
"""The sources of π_old (``RolloutEngine.old_log_probs``)."""


class RolloutEngine:
    """One ``--rollout-engine``: a module-level instance in ``ROLLOUT_ENGINES``.

    Override ``generate`` and the memory model's three numbers (``kv_cache_tokens``,
    ``decode_rows``, ``prefill_tokens``), and ``refusal`` /
    ``unavailable`` where the engine cannot run everywhere. ``step`` arguments are
    ``StepPlan`` (``rollout_batch_size`` > 0 rows of
    ``seq_length`` tokens, ``inference_max_tokens``, ``prompt_tokens``).
    """

    name: str = ""
    description: str = ""
    auto_priority: int | None = None
    """``--rollout-engine auto`` takes the engine of highest priority that can run (None:
    never chosen by ``auto``)."""
    recomputes_log_probs: bool = False
    """The engine does not sample its own log-probs: the rollout's come from a forward after
    generation, in micro-batches of ``--log-prob-micro-batch-size`` rows, unless the request
    does not want them (else they are sampled while decoding, for free)."""

    def old_log_probs(self, apart: bool, on_policy: bool) -> str:
        """Where the PPO ratio's π_old comes from with this engine (a key of
        ``OLD_LOG_PROB_SOURCES``): ``apart``, the engine's sampling log-probs cannot be π_old
        (``--tis-cap`` wants the trainer's beside them; a bf16 rollout of an FP8 run,
        ``RolloutConfig.decodes_apart``), and one optimizer update per RL step or several
        (``on_policy``)."""
        if not (self.recomputes_log_probs or apart):
            return "rollout"
        return "training" if on_policy else "recompute"

    def refusal(self, target: EngineTarget) -> str | None:
        """Why a run with these settings cannot use this engine (None: it can). Decided by
        the settings alone: the memory estimator plans with it for a machine it is not on."""
        return None

    def unavailable(self, target: EngineTarget) -> str | None:
        """Why it cannot run here (None: it can): ``refusal``, then what this process
        lacks (libraries, kernels)."""
        return self.refusal(target)

    def generate(self, policy, prompts: list[list[int]], request: RolloutRequest):
        """One completion of each prompt (token ids), by every rank of the model replica
        alike: ``(Rollout, stats)`` with the stats of ``rollout_stats``."""
        raise NotImplementedError

    def sync_weights(self, policy) -> None:
        """Make the weights the engine samples with the policy's current ones; called before
        each ``generate``. A no-op for an engine that runs on the training model object
        itself (both built-in engines: no copy, nothing to sync); an engine with its own
        copy (a separate inference server) updates it here."""

    def kv_cache_tokens(self, step) -> int:
        """Tokens the KV cache holds at once (memory model)."""
        raise NotImplementedError

    def decode_rows(self, step) -> int:
        """Sequences decoded at once (memory model: the rollout's logits)."""
        raise NotImplementedError

    def prefill_tokens(self, step, tensor_parallel: int) -> int:
        """Tokens of the largest prefill forward, prompts of ``step.prompt_tokens`` tokens
        (memory model)."""
        raise NotImplementedError

"""Megatron-Core's dynamic inference engine, built through the API the installed release has.

Every class, constructor argument and attribute of ``megatron.core.inference`` that this
project names lives in this module, so a Megatron-Core upgrade changes one file. Two API
generations are supported, told apart by feature (``megatron.core.inference.config`` exists
from 0.17 on), never by a version string: megatron-core 0.16 (keyword context, wrapper
config, sampler hook that receives the logits) and 0.17-0.19 (``InferenceConfig``, a
process-wide ``InferenceMode`` flag, sampler hook that reads the controller's logits
buffer). The table of differences and what moves when 0.16 support is dropped:
``docs/megatron_versions.md``.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from dataclasses import dataclass

import torch

__all__ = [
    "EnginePlan",
    "build_engine",
    "fp8_inference_wrapped_modules",
    "has_inference_config",
    "kv_block_count",
    "missing_attention_kernels",
    "release_engine",
    "run_engine",
]


@functools.lru_cache(maxsize=1)
def has_inference_config() -> bool:
    """Whether the installed megatron-core has ``megatron.core.inference.config`` (0.17+)."""
    return importlib.util.find_spec("megatron.core.inference.config") is not None


def missing_attention_kernels() -> str | None:
    """What the dynamic engine's attention lacks here (``None``: nothing): flash-attn >=
    2.7.3, 3 or 4 (paged KV cache) and einops, as ``Attention.forward`` checks them."""
    import megatron.core.transformer.attention as attention

    try:
        flash = (
            getattr(attention, "HAVE_FA4", False)
            or attention.HAVE_FA3
            or attention.is_fa_min_version("2.7.3")
        )
    except ImportError:
        flash = False
    if not flash:
        return "the dynamic engine needs flash-attn >= 2.7.3 (or flash-attn 3/4)"
    return "the dynamic engine needs einops" if attention.rearrange is None else None


@dataclass(frozen=True)
class EnginePlan:
    """What the engine is sized for (``rollout.dynamic_generate`` derives it from the prompts)."""

    blocks: int
    """KV blocks of ``block_size`` tokens (the dummy block not counted)."""
    max_requests: int
    """Requests in flight at once."""
    step_tokens: int
    """Tokens per forward (before Megatron's rounding)."""
    max_seq: int
    """Longest prompt + ``max_new_tokens``."""
    block_size: int
    """Tokens per KV block."""


class _NoTokenizer:
    """The engine detokenizes finished requests for display; rollouts stay token ids."""

    bos = None
    eod = -1

    def detokenize(self, tokens, **kwargs) -> str:
        return ""


@functools.lru_cache(maxsize=1)
def _controller_class():
    """Megatron's ``TextGenerationController`` whose sampling is ``self.step_sampler``
    (a ``StepSampler``)."""
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class RolloutController(TextGenerationController):
        def _dynamic_step_sample_logits(self, logits: torch.Tensor | None = None) -> None:
            # 0.16 passes the logits; 0.17+ leaves them in ``_all_logits_cuda``. Either way
            # they are the active requests' last-token rows (materialize_only_last_token_logits).
            context = self.inference_wrapped_model.inference_context
            if logits is None:
                logits = self._all_logits_cuda
            active = slice(context.paused_request_count, context.total_request_count)
            n = active.stop - active.start
            ids = self.step_sampler(
                logits.squeeze(0)[:n].float(),
                context.request_ids[active].long(),
                context.chunked_prefill_request_id,
            )
            self._sampled_tokens_cuda[:n] = ids

    return RolloutController


def kv_block_bytes(config, layers: int, block_size: int, tp: int) -> int:
    """Bytes of one KV block on this rank (``DynamicInferenceContext.block_size_bytes``)."""
    heads = (config.num_query_groups or config.num_attention_heads) // tp
    return config.params_dtype.itemsize * 2 * layers * block_size * heads * config.kv_channels


def _buffer_gb(plan: EnginePlan, block_bytes: int) -> float:
    """The blocks + the dummy block, plus half a block against float rounding."""
    return ((plan.blocks + 1) * block_bytes + block_bytes // 2) / 1024**3


def _context_0_16(config, plan: EnginePlan, layers: int, block_bytes: int, tp: int):
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    return DynamicInferenceContext(
        params_dtype=config.params_dtype,
        num_layers=layers,
        kv_channels=config.kv_channels,
        num_attention_heads=config.num_query_groups or config.num_attention_heads,
        max_sequence_length=plan.max_seq,
        buffer_size_gb=_buffer_gb(plan, block_bytes),
        max_requests=plan.max_requests,
        max_tokens=DynamicInferenceContext.round_up_tokens(plan.step_tokens, tp),
        block_size_tokens=plan.block_size,
        materialize_only_last_token_logits=True,
        num_cuda_graphs=None,
        use_cuda_graphs_for_non_decode_steps=False,
        use_flashinfer_fused_rope=False,
        unified_memory_level=0,
    )


def _context_0_17(config, plan: EnginePlan, block_bytes: int, tp: int):
    from megatron.core.inference.config import InferenceConfig, KVCacheManagementMode
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    # 0.17+ asserts max_requests % TP == 0 and max_tokens >= max_requests
    requests = -(-plan.max_requests // tp) * tp
    inference_config = InferenceConfig(
        block_size_tokens=plan.block_size,
        buffer_size_gb=_buffer_gb(plan, block_bytes),
        max_requests=requests,
        max_tokens=DynamicInferenceContext.round_up_tokens(max(plan.step_tokens, requests), tp),
        max_sequence_length=plan.max_seq,
        materialize_only_last_token_logits=True,
        num_cuda_graphs=None,
        use_cuda_graphs_for_non_decode_steps=False,
        use_flashinfer_fused_rope=False,
        unified_memory_level=0,
        # deallocate_inference_state_buffers() frees the KV cache only in this mode
        kv_cache_management_mode=KVCacheManagementMode.RECOMPUTE,
        enable_chunked_prefill=True,
        sampling_backend="torch",
    )
    return DynamicInferenceContext(config, inference_config)


def build_engine(model, config, plan: EnginePlan, sampler, seed: int):
    """A ``DynamicInferenceEngine`` on ``model`` (the training model object, DDP-wrapped or
    not) whose controller samples with ``sampler``; no CUDA graphs. Release it with
    ``release_engine``."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.utils import unwrap_model

    inner = unwrap_model(model)
    tp = ps.get_tensor_model_parallel_world_size()
    layers = len(inner.decoder.layers)
    block_bytes = kv_block_bytes(config, layers, plan.block_size, tp)
    controller_class = _controller_class()
    if has_inference_config():
        context = _context_0_17(config, plan, block_bytes, tp)
        controller = controller_class(GPTInferenceWrapper(model, context), _NoTokenizer())
    else:
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig,
        )

        context = _context_0_16(config, plan, layers, block_bytes, tp)
        wrapper_config = InferenceWrapperConfig(
            hidden_size=config.hidden_size,
            params_dtype=config.params_dtype,
            inference_batch_times_seqlen_threshold=-1,
            padded_vocab_size=inner.vocab_size,
            inference_max_requests=plan.max_requests,
            inference_max_seq_length=plan.max_seq,
            fp32_residual_connection=config.fp32_residual_connection,
            fp8=config.fp8,
        )
        wrapped = GPTInferenceWrapper(model, wrapper_config, context)
        pp_group = ps.get_pipeline_model_parallel_group()
        controller = controller_class(wrapped, _NoTokenizer(), pp_group=pp_group)
    controller.step_sampler = sampler
    if kv_block_count(context) != plan.blocks:  # the block arithmetic went stale
        raise RuntimeError(f"KV cache has {kv_block_count(context)} blocks, wanted {plan.blocks}")
    if has_inference_config():
        return DynamicInferenceEngine(controller, context)
    with warnings.catch_warnings():  # enable_cuda_graph is deprecated, but it is the off switch
        warnings.simplefilter("ignore")
        return DynamicInferenceEngine(
            controller,
            context,
            enable_cuda_graph=False,
            random_seed=int(seed),
            enable_chunked_prefill=True,
        )


def kv_block_count(context) -> int:
    """Usable KV blocks of a ``DynamicInferenceContext`` (the dummy block not counted)."""
    allocator = getattr(context, "kv_block_allocator", None) or context.block_allocator
    return allocator.active_count


def release_engine(engine) -> None:
    """Free the engine's KV cache now and, on 0.17+, clear the process-wide
    ``InferenceMode`` flag the engine set (the training forward reads it: left set, a
    training forward would take inference-only branches)."""
    context = engine.context
    if has_inference_config():
        from megatron.core.inference.utils import InferenceMode

        context.deallocate_inference_state_buffers()
        InferenceMode.unset_active()
    else:
        context.deallocate_all_tensors()


def run_engine(engine, num_requests: int) -> dict[int, list[int]]:
    """Step the engine until every request is done; generated tokens by request id."""
    from megatron.core.inference.inference_request import Status

    out: dict[int, list[int]] = {}
    idle = 0
    while engine.has_unfinished_requests():
        result = engine.step_modern()
        finished = result["finished_request_records"]
        idle = 0 if (finished or result["active_request_ids"]) else idle + 1
        if idle > 2:
            raise RuntimeError("dynamic engine stalled: no request fits the KV cache")
        for record in finished:
            request = record.merge()
            if request.status != Status.COMPLETED:
                raise RuntimeError(f"request {record.request_id} failed: {request.events}")
            out[record.request_id] = [int(t) for t in request.generated_tokens]
    if sorted(out) != list(range(num_requests)):
        raise RuntimeError(f"dynamic engine returned requests {sorted(out)}")
    return out


def fp8_inference_wrapped_modules():
    """The set of TE linears ``prepare_model_for_fp8_inference`` has wrapped (``None``
    without Transformer Engine)."""
    try:
        from megatron.core.fp8_utils import _fp8_inference_wrapped_modules
    except ImportError:
        return None
    return _fp8_inference_wrapped_modules

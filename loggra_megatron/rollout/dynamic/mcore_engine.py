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

import contextlib
import functools
import gc
import importlib.util
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "EnginePlan",
    "built_engine",
    "kv_buffer_bytes",
    "decode_graphs",
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
    """What the engine is sized for (``rollout.dynamic.generate`` derives it from the prompts)."""

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
    cuda_graphs: int | None = None
    """Decode batch sizes captured as CUDA graphs (Megatron's ``num_cuda_graphs``) when the
    engine is built inside ``decode_graphs`` (elsewhere every step is eager)."""


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
        num_cuda_graphs=_graph_sizes(config, plan, tp),
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
        num_cuda_graphs=_graph_sizes(config, plan, tp),
        use_cuda_graphs_for_non_decode_steps=False,
        use_flashinfer_fused_rope=False,
        unified_memory_level=0,
        # deallocate_inference_state_buffers() frees the KV cache only in this mode
        kv_cache_management_mode=KVCacheManagementMode.RECOMPUTE,
        enable_chunked_prefill=True,
        sampling_backend="torch",
    )
    return DynamicInferenceContext(config, inference_config)


def _graph_sizes(config, plan: EnginePlan, tp: int) -> int | None:
    """``num_cuda_graphs`` for the context: the plan's inside ``decode_graphs``, else none
    (graph-sized batches without managers to capture them would only pad). On 0.16 the
    sizes are multiples of TP up to ``max_requests`` rounded down: fewer requests than TP
    would make a graph of 0 tokens, so those rollouts decode eagerly (0.17+ rounds
    ``max_requests`` up to TP)."""
    if config.cuda_graph_impl != "local":
        return None
    if not has_inference_config() and plan.max_requests < tp:
        return None
    return plan.cuda_graphs


def graph_register_hazard(env=os.environ) -> str | None:
    """Why Megatron's graph manager refuses to start here (``None``: it starts): expandable
    segments without ``NCCL_GRAPH_REGISTER=0`` (an illegal memory access on GPUs before
    Blackwell; megatron-core 0.16 asserts it at each manager, 0.19 in its TE helper only, the
    hazard being the same)."""
    if "expandable_segments:True" not in env.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return None
    blackwell = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10
    if env.get("NCCL_GRAPH_REGISTER", "") == "0" or blackwell:
        return None
    return (
        "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True but NCCL_GRAPH_REGISTER is not 0: "
        "export NCCL_GRAPH_REGISTER=0 (as the launch scripts do) for the dynamic engine's "
        "CUDA graphs; its decode steps run eagerly"
    )


@contextlib.contextmanager
def decode_graphs(model, config) -> Iterator[None]:
    """Megatron-Core's local CUDA graphs for the engines built inside: decode-only steps
    (``EnginePlan.cuda_graphs`` batch sizes) are captured at the engine's construction and
    replayed; prefill and mixed steps stay eager. The model is built without graphs
    (``cuda_graph_impl="none"``) and so trains without them: for the rollout only, every
    ``TransformerLayer`` gets an inference-only ``CudaGraphManager`` (``need_backward=False``;
    routing reads ``hasattr(layer, "cudagraph_manager")``, as ``toggle_cuda_graphs`` does),
    ``cuda_graph_impl`` reads ``"local"`` (0.17+: ``inference_cuda_graph_scope`` ``layer``,
    first and last layers annotated), and the RNG tracker is Megatron's inference tracker
    (no RNG in an eval forward; the manager asserts a graph-safe one). On exit, whatever
    happened: the managers are removed (a training forward would be routed through any left
    attached), ``delete_cuda_graphs()`` frees the graphs and their pool, and the config, the
    RNG tracker and the current CUDA stream (which the first manager switches) are restored.
    Why each, by megatron-core release: ``docs/rollouts.md``."""
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import cuda_graphs
    from megatron.core.utils import unwrap_model

    layers = list(unwrap_model(model).decoder.layers)
    if any(hasattr(layer, "cudagraph_manager") for layer in layers):
        raise RuntimeError(
            "the model has CUDA graph managers (built with --cuda-graph-impl local?): rollouts "
            "attach their own for generation only; build the model without them"
        )
    saved = {"cuda_graph_impl": config.cuda_graph_impl}
    if has_inference_config():
        saved["inference_cuda_graph_scope"] = config.inference_cuda_graph_scope
    tracker = random._CUDA_RNG_STATE_TRACKER, random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    stream = torch.cuda.current_stream()
    try:
        config.cuda_graph_impl = "local"
        if has_inference_config():
            from megatron.core.transformer.enums import InferenceCudaGraphScope

            config.inference_cuda_graph_scope = InferenceCudaGraphScope.layer
            cuda_graphs.annotate_first_last_layer(layers)
        random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        for layer in layers:
            layer.cudagraph_manager = cuda_graphs.CudaGraphManager(config, need_backward=False)
        yield
    finally:
        for layer in layers:
            for name in ("cudagraph_manager", "is_first_layer", "is_last_layer"):
                if hasattr(layer, name):
                    delattr(layer, name)
        cuda_graphs.delete_cuda_graphs()
        pool = getattr(cuda_graphs, "TensorReusePool", None)  # 0.16: class-level references
        if pool is not None:
            for name in ("pool", "tensor_strong_refs", "tensor_strong_refs_dataptrs"):
                getattr(pool, name).clear()
        for name, value in saved.items():
            setattr(config, name, value)
        random._CUDA_RNG_STATE_TRACKER, random._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker
        torch.cuda.set_stream(stream)
        gc.collect()


@contextlib.contextmanager
def built_engine(model, config, plan: EnginePlan, sampler, seed: int) -> Iterator[object]:
    """``_build_engine``'s engine for the block, released after (``release_engine``), also
    when its constructor raises: the constructor sets Megatron's process-wide
    ``InferenceMode`` flag (0.17+) before it can fail, and a training forward reads it."""
    engine = None
    try:
        engine = _build_engine(model, config, plan, sampler, seed)
        yield engine
    finally:
        release_engine(engine)


def _build_engine(model, config, plan: EnginePlan, sampler, seed: int):
    """A ``DynamicInferenceEngine`` on ``model`` (the training model object, DDP-wrapped or
    not) whose controller samples with ``sampler``; it captures ``plan.cuda_graphs`` decode
    graphs when built inside ``decode_graphs`` (else none)."""
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
    with warnings.catch_warnings():  # enable_cuda_graph is deprecated, but it is the switch
        warnings.simplefilter("ignore")
        return DynamicInferenceEngine(
            controller,
            context,
            enable_cuda_graph=config.cuda_graph_impl == "local",
            random_seed=int(seed),
            enable_chunked_prefill=True,
        )


def kv_block_count(context) -> int:
    """Usable KV blocks of a ``DynamicInferenceContext`` (the dummy block not counted)."""
    allocator = getattr(context, "kv_block_allocator", None) or context.block_allocator
    return allocator.active_count


def kv_buffer_bytes(engine) -> int:
    """Bytes of the engine's paged KV buffer on this rank (its dummy block included)."""
    buffer = getattr(engine.context, "memory_buffer", None)
    return 0 if buffer is None else buffer.numel() * buffer.element_size()


def release_engine(engine) -> None:
    """Free the engine's KV cache now and, on 0.17+, clear the process-wide
    ``InferenceMode`` flag the engine set (the training forward reads it: left set, a
    training forward would take inference-only branches). ``engine`` None: a constructor
    that raised, whose flag is cleared all the same."""
    context = getattr(engine, "context", None)
    if has_inference_config():
        from megatron.core.inference.utils import InferenceMode

        if context is not None:
            context.deallocate_inference_state_buffers()
        InferenceMode.unset_active()
    elif context is not None:
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

# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Megatron-Core GPT models from ``GPTModelArgs``.

``build_gpt_model`` builds a ``megatron.core.models.gpt.GPTModel`` for the current
pipeline stage, with Megatron-Core's local layer spec (plain PyTorch, runs on CPU) or the
Transformer Engine spec; ``wrap_ddp`` wraps it in Megatron's DDP as its training loop
does. Tensor/pipeline sizes are taken from ``megatron.core.parallel_state``, which must be
initialised first. ``GPTModel`` reads the RoPE base from its ``rotary_base`` *constructor
argument*, not from ``TransformerConfig``; it is passed explicitly.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch

from loggra_megatron.model.args import GPTModelArgs
from loggra_megatron.model.config import log_prob_chunk_tokens
from loggra_megatron.model.output_head import LOG_PROB_CHUNK


def fused_kernels(device_type: str, use_te: bool) -> dict[str, bool]:
    """Megatron's fused kernels for a run on ``device_type`` with or without Transformer
    Engine layers, as Megatron-LM switches them on by default; each only where its kernel
    exists: on CPU none; on CUDA the TorchScript bias-SwiGLU and bias-dropout-add fusions,
    TE's fused RoPE (TE layers), the fused masked softmax (TE attention, or Megatron's
    ``scaled_*_softmax_cuda`` extensions for the local spec) and the fused weight-gradient
    accumulation into ``main_grad`` (apex's ``fused_weight_gradient_mlp_cuda``, which
    Megatron's own output layer needs even with TE)."""
    names = (
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "apply_rope_fusion",
        "masked_softmax_fusion",
        "gradient_accumulation_fusion",
    )
    if device_type != "cuda":
        return dict.fromkeys(names, False)
    has = importlib.util.find_spec
    return dict(
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        apply_rope_fusion=use_te,
        masked_softmax_fusion=use_te or has("scaled_upper_triang_masked_softmax_cuda") is not None,
        gradient_accumulation_fusion=has("fused_weight_gradient_mlp_cuda") is not None,
    )


def transformer_config_from_args(args: GPTModelArgs, **overrides: Any):
    """Megatron-Core ``TransformerConfig`` for ``args`` at the current TP/PP sizes.

    Kernel fusions are off (CPU-safe); ``fused_kernels`` gives the ones to switch on
    for a GPU. ``overrides`` (any TransformerConfig field, e.g. ``sequence_parallel=True``,
    ``use_cpu_initialization=True``, the fusions) win.
    """
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=False,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        rotary_interleaved=False,  # HF rotate_half convention
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        params_dtype=args.torch_dtype,
        pipeline_dtype=args.torch_dtype,
        bf16=args.params_dtype == "bfloat16",
        fp16=args.params_dtype == "float16",
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
    )
    scope = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    if scope.get("cuda_graph_scope") == "full":  # megatron-core 0.16: a default it deprecates
        kwargs["cuda_graph_scope"] = []  # the same (the whole layer), without the warning
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _layer_spec(args: GPTModelArgs, use_te: bool):
    """Megatron-Core's Transformer Engine layer spec (TE imported only then), else its local
    spec (pure PyTorch, CPU-capable) with PyTorch's fused attention as core attention
    (``SDPAttention``, in place of Megatron's
    ``DotProductAttention``)."""
    if use_te:
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "build_gpt_model(use_te=True) needs transformer_engine installed"
            ) from e
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from loggra_megatron.model.sdpa_attention import SDPAttention

    spec = get_gpt_layer_local_spec(
        qk_layernorm=args.qk_layernorm, normalization=args.normalization
    )
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def _stage_ends(pre_process, post_process, vp_stage) -> tuple[bool, bool]:
    """Whether this chunk owns the embeddings and the output layer (default: the first and
    the last pipeline stage)."""
    from megatron.core import parallel_state

    virtual = {"ignore_virtual": vp_stage is None, "vp_stage": vp_stage}
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(**virtual)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(**virtual)
    return pre_process, post_process


def build_gpt_model(
    args: GPTModelArgs,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    use_te: bool = False,
    *,
    parallel_output: bool = True,
    vp_stage: int | None = None,
    sequence_packing: bool = False,
    log_prob_chunk_size: int | None = None,
    **config_overrides: Any,
):
    """Build the Megatron-Core ``GPTModel`` chunk of ``args`` for this pipeline stage.

    Args:
        args: model architecture.
        pre_process: this chunk owns the word embeddings; default: first PP stage.
        post_process: this chunk owns the final norm and output layer; default: last stage.
        use_te: use the Transformer Engine layer spec (TE is imported only then);
            otherwise Megatron-Core's local spec (pure PyTorch, CPU-capable).
        parallel_output: keep logits split over the vocabulary across TP ranks.
        vp_stage: virtual pipeline stage of this chunk, if interleaving.
        sequence_packing: the schedule feeds its micro-batches packed (THD,
            ``model.packing``); needs ``use_te`` (Megatron-Core's local
            attention refuses ``packed_seq_params``).
        log_prob_chunk_size: tokens per chunk of its log-prob forwards
            (``model.output_head``; None: ``log_prob_chunk_tokens``'s
            default for this rank's vocabulary shard).
        config_overrides: forwarded to ``transformer_config_from_args``.

    The model lives on the host with ``use_cpu_initialization=True``, else on the current
    CUDA device (all of it, as Megatron-LM's ``get_model`` moves it). The padded vocabulary is
    ``args.padded_vocab_size(tp)``. With the local spec the norm weights are always fp32
    (``torch.nn.RMSNorm`` ignores ``params_dtype``); for bf16/fp16 wrap the model in Megatron's
    ``Float16Module`` or call ``.to(args.torch_dtype)``, as the converters do.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from loggra_megatron.model.forward import PACKS_SEQUENCES

    if sequence_packing and not use_te:
        raise ValueError(
            "build_gpt_model(sequence_packing=True) needs use_te=True: packed sequences run "
            "in Transformer Engine's attention (Megatron-Core's local DotProductAttention "
            "refuses packed_seq_params)"
        )
    pre_process, post_process = _stage_ends(pre_process, post_process, vp_stage)
    config = transformer_config_from_args(args, **config_overrides)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(args, use_te),
        vocab_size=args.padded_vocab_size(tp),
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=args.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=args.rotary_base,
        rope_scaling=args.rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        vp_stage=vp_stage,
    )
    setattr(model, PACKS_SEQUENCES, sequence_packing)
    local_vocab = args.padded_vocab_size(tp) // tp
    setattr(model, LOG_PROB_CHUNK, log_prob_chunk_tokens(log_prob_chunk_size, local_vocab))
    if not config.use_cpu_initialization and torch.cuda.is_available():
        # As Megatron-LM's get_model: what Megatron-Core does not place itself (the local
        # spec's torch.nn.RMSNorm, buffers) is created on the host; move all of it.
        model.cuda(torch.cuda.current_device())
    return model


def wrap_ddp(model, use_distributed_optimizer: bool = True, **ddp_overrides: Any):
    """Wrap ``model`` in Megatron's ``DistributedDataParallel`` and hook it into its config
    (``finalize_model_grads_func``, ``no_sync_func``) as Megatron's training loop does."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    fields = dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    fields.update(ddp_overrides)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(**fields), model)
    ddp.config.finalize_model_grads_func = finalize_model_grads
    ddp.config.no_sync_func = ddp.no_sync
    return ddp

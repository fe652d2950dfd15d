# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The transient terms of ``memory.model``: activations (with Megatron's
recompute methods), the output head's chunked log-probs, the full-vocabulary KL trial's
logits, the rollout's KV cache under ``--inference-max-tokens``, the rollout's prefill and
the working set of forward-only passes (pure arithmetic, no torch).

The output head (``log_prob_head_bytes``): every forward that needs token log-probs (the
training loss, the old and reference log-probs, the ``k1/k2/k3`` KL trials) runs the output
layer and the vocab-parallel log-softmax over chunks of ``c = min(--log-prob-chunk-size,
tokens)`` positions, so its logits are ``c × V/t`` at a time, whatever the micro-batch.

Formulas and assumptions: ``docs/memory.md`` ("Formulas").
"""

from __future__ import annotations

import dataclasses

from loggra_megatron.memory.shape import TransformerShape, ceil_div, param_dtype_bytes
from loggra_megatron.model.config import log_prob_chunk_tokens
from loggra_megatron.rollout.registry import ROLLOUT_ENGINES
from loggra_megatron.train.step_plan import StepPlan

__all__ = [
    "activation_bytes",
    "activation_bytes_per_layer",
    "forward_activation_bytes",
    "full_kl_logits_bytes",
    "kv_cache_bytes",
    "layers_held",
    "local_spec_bytes_per_layer",
    "log_prob_head_bytes",
    "prefill_tokens",
    "rollout_kv_cache_bytes",
    "rollout_kv_tokens",
    "rollout_rows",
]


def _t_sp(plan: StepPlan) -> int:
    return plan.tensor_model_parallel_size if plan.sequence_parallel else 1


def activation_bytes_per_layer(
    model: TransformerShape, plan: StepPlan, micro_batch_size: int, seq_length: int
) -> int:
    """Saved activations of one transformer layer for one micro-batch (docs/memory.md)."""
    sb, t = seq_length * micro_batch_size, plan.tensor_model_parallel_size
    h, f, a, g, d = (
        model.hidden_size,
        model.ffn_hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        model.kv_channels,
    )
    replicated = 2 * sb * 4 * h
    split = 2 * sb * (a * d + 2 * g * d) + 2 * sb * a * d + 4 * sb * a
    split += 2 * sb * (2 * f + f) if model.swiglu else 2 * sb * (f + f)
    if model.qk_layernorm:
        split += 2 * sb * (a * d + g * d)
    return ceil_div(replicated, _t_sp(plan)) + ceil_div(split, t)


def local_spec_bytes_per_layer(
    model: TransformerShape, plan: StepPlan, micro_batch_size: int, seq_length: int
) -> int:
    """What one layer of Megatron-Core's local spec saves beyond ``activation_bytes_per_layer``
    (0 with Transformer Engine's spec), measured on the layer (``tests/unit/memory/test_runtime.py``):

    * each ``torch.nn.RMSNorm`` keeps fp32 copies of its input and normalised input and its
      bf16 output, ``10·sb·h``, and its fp32 ``1/rms``, ``4·sb``, where Transformer Engine's
      fused norm keeps the bf16 input and output: ``(6·sb·h + 4·sb)/t'`` per norm (the two
      of the layer, and QK-norm's over ``(a + g)·d``);
    * the unfused RoPE keeps the rotated ``q`` and ``k``, ``2·sb·(a + g)·d/t``, and its
      ``cos``/``sin`` tables, ``4·2·s·d``; with GQA off CUDA, SDPA gets the keys and values
      expanded to ``a/t`` heads (``model/sdpa_attention.py``), which then replace the QKV
      output and the rotated keys: ``2·sb·2·(a − g)·d/t`` instead of ``2·sb·(a + g)·d/t``;
    * without Megatron's CUDA bias-SwiGLU fusion, SiLU and the product keep ``silu(gate)``
      and the product's other factor besides the fused form's two tensors, ``2·2·sb·f/t``."""
    if plan.transformer_impl != "local":
        return 0
    sb, t = seq_length * micro_batch_size, plan.tensor_model_parallel_size
    a, g, d, f = (
        model.num_attention_heads,
        model.num_query_groups,
        model.kv_channels,
        model.ffn_hidden_size,
    )
    norms = ceil_div(2 * _local_norm_bytes(sb, model.hidden_size), _t_sp(plan))
    expanded = a > g and not plan.cuda  # SDPA's grouped keys/values only on CUDA flash
    split = 2 * sb * (2 * (a - g) if expanded else a + g) * d
    if model.qk_layernorm:
        split += _local_norm_bytes(sb * (a + g), d)
    if model.swiglu and not plan.cuda:
        split += 2 * 2 * sb * f
    return norms + ceil_div(split, t) + 4 * 2 * seq_length * d


def _local_norm_bytes(rows: int, width: int) -> int:
    """A ``torch.nn.RMSNorm`` over ``rows × width`` bf16 values beyond Transformer Engine's."""
    return 6 * rows * width + 4 * rows


def _layer_input(model: TransformerShape, plan: StepPlan, tokens: int) -> int:
    return ceil_div(2 * tokens * model.hidden_size, _t_sp(plan))


def layers_held(model: TransformerShape, plan: StepPlan, stage: int = 0) -> tuple[int, int]:
    """``(layers, inputs)`` held at the peak of the backward pass on PP stage ``stage``
    (1F1B): transformer layers with all their saved activations, and checkpoint inputs
    (``2sbh/t'`` each) of full recompute (see ``activation_bytes``)."""
    p = plan.pipeline_model_parallel_size
    layers = model.num_layers // p
    in_flight = min(p - stage, plan.num_microbatches)
    n = min(plan.recompute_num_layers, layers)
    if plan.recompute_granularity != "full":
        return in_flight * layers, 0
    if plan.recompute_method == "block":
        return in_flight * (layers - n) + 1, in_flight * n
    return n, in_flight * ceil_div(layers, n)


def activation_bytes(model: TransformerShape, plan: StepPlan, stage: int = 0) -> int:
    """Activations held at the peak of the backward pass on PP stage ``stage`` (1F1B).

    Full recompute, ``uniform`` with ``n`` layers per checkpoint: the input of each of the
    ``⌈L_stage/n⌉`` checkpoints per micro-batch in flight, plus one checkpoint's ``n`` layers
    re-materialised during its backward. ``block`` with ``n`` layers: the first ``n`` layers
    keep their inputs, the other ``L_stage − n`` their full activations, plus one recomputed
    layer. Selective recompute equals none (flash attention stores nothing quadratic). The
    local spec's layers and final norm keep more (``local_spec_bytes_per_layer``).
    """
    b, s = plan.micro_batch_size, plan.seq_length
    per_layer = activation_bytes_per_layer(model, plan, b, s)
    per_layer += local_spec_bytes_per_layer(model, plan, b, s)
    layer_input = _layer_input(model, plan, b * s)
    layers, inputs = layers_held(model, plan, stage)
    total = layers * per_layer + inputs * layer_input
    if stage == plan.pipeline_model_parallel_size - 1:  # final-norm and output-layer input
        total += 2 * layer_input
        if plan.transformer_impl == "local":
            total += ceil_div(_local_norm_bytes(b * s, model.hidden_size), _t_sp(plan))
    return total


def forward_activation_bytes(
    model: TransformerShape,
    plan: StepPlan,
    rows: int,
    seq_length: int,
    sequence_parallel: bool | None = None,
) -> int:
    """Working set of a no-grad forward of ``rows × seq_length`` tokens: the residual stream
    plus one layer's intermediates (bounded by that layer's saved activations); nothing is
    kept across layers. ``sequence_parallel=False``: as generation runs (SP switched off)."""
    if not rows:
        return 0
    if sequence_parallel is not None:
        plan = dataclasses.replace(plan, sequence_parallel=sequence_parallel)
    per_layer = activation_bytes_per_layer(model, plan, rows, seq_length)
    return per_layer + _layer_input(model, plan, rows * seq_length)


def log_prob_head_bytes(
    model: TransformerShape, plan: StepPlan, tokens: int, training: bool = False
) -> int:
    """The output layer and its vocab-parallel log-softmax for one micro-batch of ``tokens``
    positions, in chunks of ``c = min(--log-prob-chunk-size, tokens)``, with ``V_t`` the
    padded vocabulary over TP, ``h`` the hidden size and ``w`` the weights' bytes (2 for
    bf16; an fp32 model's logits need no upcast and no cast back):

    * forward, per chunk: its logits ``w·c·V_t`` and their fp32 upcast ``4·c·V_t``, in which
      the log-sum-exp's ``exp`` runs in place (bf16: ``6·c·V_t``; fp32: ``4·c·V_t``, the
      upcast being the logits themselves);
    * training (``training=True``), one chunk's backward at a time: its recomputed logits
      and their fp32 upcast, in which the softmax and ``∂z`` are built in place, then ``∂z``
      cast to ``w`` (bf16: ``6·c·V_t`` at either moment; fp32: ``4·c·V_t``), plus the
      gradient of the hidden states ``w·tokens·h`` and the output weight's: added chunk by
      chunk into DDP's ``main_grad`` (an untied output layer, or one on a later pipeline
      stage than the embeddings), a chunk's ``w·V_t·h`` and then DDP's placeholder of the
      same size, else accumulated over the chunks in fp32 next to the chunk's, ``(4 +
      w)·V_t·h`` (one chunk: its own ``w·V_t·h``); plus the fp32 log-sum-exp the forward saves
      for the backward, ``4·tokens`` (measured on ``model/output_head.py``:
      ``tests/unit/memory/test_runtime.py``)."""
    if not tokens:
        return 0
    t = plan.tensor_model_parallel_size
    vocab = model.padded_vocab_size(t) // t
    c = min(log_prob_chunk_tokens(plan.log_prob_chunk_size, vocab), tokens)
    w = param_dtype_bytes(plan)
    upcast = 4 if w != 4 else 0  # .float() of fp32 logits is a view
    forward = (w + upcast) * c * vocab
    if not training:
        return forward
    into_main_grad = model.untie_embeddings_and_output_weights or (
        plan.pipeline_model_parallel_size > 1
    )
    accumulated = not into_main_grad and tokens > c
    weight_grad = (4 + w if accumulated else w) * vocab * model.hidden_size
    return forward + weight_grad + w * tokens * model.hidden_size + 4 * tokens


def full_kl_logits_bytes(
    model: TransformerShape, plan: StepPlan, kept_rows: int, forward_rows: int
) -> int:
    """The ``full`` KL estimator's trial (``--kl-estimator full``): the fp32 reference logits
    of every trial row kept (``4`` B per logit of ``kept_rows × s``), and one forward of
    ``forward_rows`` rows at a time with its fp32 candidate logits and the three fp32
    temporaries of ``vocab_parallel_kl`` (``p_old``, ``z_old − z_new``, their product:
    ``16`` B per logit; measured in ``tests/unit/memory/test_runtime.py``)."""
    t = plan.tensor_model_parallel_size
    per_row = plan.seq_length * (model.padded_vocab_size(t) // t)
    return 4 * kept_rows * per_row + 16 * forward_rows * per_row


def rollout_kv_tokens(plan: StepPlan) -> int:
    """Tokens the rollout KV cache holds at once: ``B·s`` for ``B`` rollout rows of full
    length ``s``, or the engine's under ``M = inference_max_tokens`` (the static engine:
    ``min(B·s, max(M, s))``; the dynamic engine's paged buffer: ``max(M, s)`` tokens
    whatever the batch)."""
    if not plan.rollout_batch_size:
        return 0
    return ROLLOUT_ENGINES[plan.rollout_engine].kv_cache_tokens(plan)


def rollout_rows(plan: StepPlan) -> int:
    """Sequences decoded at once: a chunk of the rollout batch under a KV budget (static
    engine), or the dynamic engine's requests in flight (one per KV block at most)."""
    if not plan.rollout_batch_size:
        return 0
    return ROLLOUT_ENGINES[plan.rollout_engine].decode_rows(plan)


def prefill_tokens(plan: StepPlan) -> int:
    """Tokens of the rollout's largest prefill forward, the engine's: the static engine
    prefills a chunk of rows (``rows × prompt``); the dynamic engine admits every waiting
    prompt in one flat step of ``min(M, B·prompt)`` tokens (at least one per request), rounded
    up as Megatron's ``round_up_tokens``."""
    if not plan.rollout_batch_size:
        return 0
    engine = ROLLOUT_ENGINES[plan.rollout_engine]
    return engine.prefill_tokens(plan, plan.tensor_model_parallel_size)


def kv_cache_bytes(
    model: TransformerShape,
    plan: StepPlan,
    batch: int,
    seq_length: int,
    bytes_per_value: int = 2,
) -> int:
    """K and V of every layer of one PP stage for ``batch`` sequences of ``seq_length``."""
    t, p = plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size
    layers = model.num_layers // p
    kv_heads = model.num_query_groups // t
    return batch * seq_length * layers * 2 * kv_heads * model.kv_channels * bytes_per_value


def rollout_kv_cache_bytes(
    model: TransformerShape, plan: StepPlan, bytes_per_value: int = 2
) -> int:
    """The rollout's KV cache on one GPU: ``min(B·s, --inference-max-tokens)`` tokens
    (``rollout_kv_tokens``) times the per-token K and V of this stage's layers and this
    TP rank's KV heads."""
    return kv_cache_bytes(model, plan, 1, rollout_kv_tokens(plan), bytes_per_value)

# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The transient terms of :mod:`loggra_megatron.memory.model`: activations (with Megatron's
recompute methods), the output head's chunked log-probs, the full-vocabulary KL trial's
logits, the rollout's KV cache under ``--inference-max-tokens``, the rollout's prefill and
the working set of forward-only passes (pure arithmetic, no torch).

The output head (:func:`log_prob_head_bytes`): every forward that needs token log-probs (the
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


def _layer_input(model: TransformerShape, plan: StepPlan, tokens: int) -> int:
    return ceil_div(2 * tokens * model.hidden_size, _t_sp(plan))


def layers_held(model: TransformerShape, plan: StepPlan, stage: int = 0) -> tuple[int, int]:
    """``(layers, inputs)`` held at the peak of the backward pass on PP stage ``stage``
    (1F1B): transformer layers with all their saved activations, and checkpoint inputs
    (``2sbh/t'`` each) of full recompute (see :func:`activation_bytes`)."""
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
    layer. Selective recompute equals none (flash attention stores nothing quadratic).
    """
    sb = plan.micro_batch_size * plan.seq_length
    per_layer = activation_bytes_per_layer(model, plan, plan.micro_batch_size, plan.seq_length)
    layer_input = _layer_input(model, plan, sb)
    layers, inputs = layers_held(model, plan, stage)
    total = layers * per_layer + inputs * layer_input
    if stage == plan.pipeline_model_parallel_size - 1:  # final-norm and output-layer input
        total += 2 * layer_input
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
    * training (``training=True``), one chunk's backward at a time: its recomputed logits,
      their fp32 upcast, the fp32 softmax/gradient and its cast to ``w`` (bf16:
      ``12·c·V_t``), plus the output weight's gradient: added chunk by chunk into DDP's
      ``main_grad`` with a ``w·V_t·h`` placeholder for DDP's hook (an untied output layer,
      or one on a later pipeline stage than the embeddings), else accumulated over the
      chunks in fp32, ``4·V_t·h``, and cast once to the weight's dtype, ``w·V_t·h``
      (16-bit only); the larger of forward and backward, plus the fp32 log-sum-exp the
      forward saves for the backward, ``4·tokens``."""
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
    backward = (w + upcast + 4 + (w if w != 4 else 0)) * c * vocab
    into_main_grad = model.untie_embeddings_and_output_weights or (
        plan.pipeline_model_parallel_size > 1
    )
    weight_grad = (w if into_main_grad else 4 + (w if w != 4 else 0)) * vocab * model.hidden_size
    return max(forward, backward + weight_grad) + 4 * tokens


def full_kl_logits_bytes(
    model: TransformerShape, plan: StepPlan, kept_rows: int, forward_rows: int
) -> int:
    """The ``full`` KL estimator's trial (``--kl-estimator full``): the fp32 reference logits
    of every trial row kept (``4`` B per logit of ``kept_rows × s``), and one forward of
    ``forward_rows`` rows at a time with its fp32 candidate logits and the three fp32
    temporaries of ``vocab_parallel_kl`` (``p_old``, ``z_old − z_new``, their product:
    ``16`` B per logit; measured in ``tests/test_memory_runtime.py``)."""
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
    (:func:`rollout_kv_tokens`) times the per-token K and V of this stage's layers and this
    TP rank's KV heads."""
    return kv_cache_bytes(model, plan, 1, rollout_kv_tokens(plan), bytes_per_value)

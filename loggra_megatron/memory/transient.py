# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The transient terms of :mod:`loggra_megatron.memory.model`: activations (with Megatron's
recompute methods), logits, the rollout's KV cache under ``--inference-max-tokens``, the
rollout's prefill and the working set of forward-only passes (pure arithmetic, no torch).

Formulas and assumptions: ``docs/memory.md`` ("Formulas").
"""

from __future__ import annotations

import dataclasses

from loggra_megatron.memory.config import (
    ParallelConfig,
    RLStepConfig,
    TransformerShape,
    ceil_div,
)
from loggra_megatron.rollout.registry import ROLLOUT_ENGINES

__all__ = [
    "LOGITS_COPIES",
    "TRAINING_LOGITS_COPIES",
    "activation_bytes",
    "activation_bytes_per_layer",
    "forward_activation_bytes",
    "kv_cache_bytes",
    "layers_held",
    "logits_bytes",
    "prefill_tokens",
    "rollout_kv_cache_bytes",
]

LOGITS_COPIES = 3
"""fp32 copies of the logits alive at once in a forward-only log-prob pass: the logits and
the two temporaries of ``rl/kl.py``'s log-softmax, ``z − max`` and its ``exp``."""
TRAINING_LOGITS_COPIES = 4
"""The same in the training step's backward: the logits (kept by the target ``gather``),
the ``exp`` backward's product and the ``gather`` backward's zeros and scatter. Both are
measured in ``tests/test_memory_phases.py``; derivation in ``docs/memory.md``."""


def _t_sp(parallel: ParallelConfig) -> int:
    return parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1


def activation_bytes_per_layer(
    model: TransformerShape, parallel: ParallelConfig, micro_batch_size: int, seq_length: int
) -> int:
    """Saved activations of one transformer layer for one micro-batch (docs/memory.md)."""
    sb, t = seq_length * micro_batch_size, parallel.tensor_model_parallel_size
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
    return ceil_div(replicated, _t_sp(parallel)) + ceil_div(split, t)


def _layer_input(model: TransformerShape, parallel: ParallelConfig, tokens: int) -> int:
    return ceil_div(2 * tokens * model.hidden_size, _t_sp(parallel))


def layers_held(
    model: TransformerShape, parallel: ParallelConfig, step: RLStepConfig, stage: int = 0
) -> tuple[int, int]:
    """``(layers, inputs)`` held at the peak of the backward pass on PP stage ``stage``
    (1F1B): transformer layers with all their saved activations, and checkpoint inputs
    (``2sbh/t'`` each) of full recompute (see :func:`activation_bytes`)."""
    p = parallel.pipeline_model_parallel_size
    layers = model.num_layers // p
    in_flight = p - stage
    if step.num_microbatches is not None:
        in_flight = min(in_flight, step.num_microbatches)
    n = min(step.recompute_num_layers, layers)
    if step.recompute_granularity != "full":
        return in_flight * layers, 0
    if step.recompute_method == "block":
        return in_flight * (layers - n) + 1, in_flight * n
    return n, in_flight * ceil_div(layers, n)


def activation_bytes(
    model: TransformerShape, parallel: ParallelConfig, step: RLStepConfig, stage: int = 0
) -> int:
    """Activations held at the peak of the backward pass on PP stage ``stage`` (1F1B).

    Full recompute, ``uniform`` with ``n`` layers per checkpoint: the input of each of the
    ``⌈L_stage/n⌉`` checkpoints per micro-batch in flight, plus one checkpoint's ``n`` layers
    re-materialised during its backward. ``block`` with ``n`` layers: the first ``n`` layers
    keep their inputs, the other ``L_stage − n`` their full activations, plus one recomputed
    layer. Selective recompute equals none (flash attention stores nothing quadratic).
    """
    sb = step.micro_batch_size * step.seq_length
    per_layer = activation_bytes_per_layer(model, parallel, step.micro_batch_size, step.seq_length)
    layer_input = _layer_input(model, parallel, sb)
    layers, inputs = layers_held(model, parallel, step, stage)
    total = layers * per_layer + inputs * layer_input
    if stage == parallel.pipeline_model_parallel_size - 1:  # final-norm and output-layer input
        total += 2 * layer_input
    return total


def forward_activation_bytes(
    model: TransformerShape,
    parallel: ParallelConfig,
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
        parallel = dataclasses.replace(parallel, sequence_parallel=sequence_parallel)
    per_layer = activation_bytes_per_layer(model, parallel, rows, seq_length)
    return per_layer + _layer_input(model, parallel, rows * seq_length)


def logits_bytes(
    model: TransformerShape, parallel: ParallelConfig, tokens: int, copies: int = LOGITS_COPIES
) -> int:
    """fp32 vocab-parallel logits of ``tokens`` positions, ``copies`` times (default: the
    logits and their log-softmax temporaries, :data:`LOGITS_COPIES`)."""
    t = parallel.tensor_model_parallel_size
    return tokens * (model.padded_vocab_size(t) // t) * 4 * copies


def prefill_tokens(step: RLStepConfig, tensor_parallel: int) -> int:
    """Tokens of the rollout's largest prefill forward (0 when the prompt length is unknown),
    the engine's: the static engine prefills a chunk of rows (``rows × prompt``); the dynamic
    engine admits every waiting prompt in one flat step of ``min(M, B·prompt)`` tokens (at
    least one per request), rounded up as Megatron's ``round_up_tokens``."""
    if step.prompt_tokens is None or not step.rollout_batch_size:
        return 0
    return ROLLOUT_ENGINES[step.rollout_engine].prefill_tokens(step, tensor_parallel)


def kv_cache_bytes(
    model: TransformerShape,
    parallel: ParallelConfig,
    batch: int,
    seq_length: int,
    bytes_per_value: int = 2,
) -> int:
    """K and V of every layer of one PP stage for ``batch`` sequences of ``seq_length``."""
    t, p = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    layers = model.num_layers // p
    kv_heads = model.num_query_groups // t
    return batch * seq_length * layers * 2 * kv_heads * model.kv_channels * bytes_per_value


def rollout_kv_cache_bytes(
    model: TransformerShape,
    parallel: ParallelConfig,
    step: RLStepConfig,
    bytes_per_value: int = 2,
) -> int:
    """The rollout's KV cache on one GPU: ``min(B·s, --inference-max-tokens)`` tokens
    (:attr:`RLStepConfig.rollout_kv_tokens`) times the per-token K and V of this stage's
    layers and this TP rank's KV heads."""
    return kv_cache_bytes(model, parallel, 1, step.rollout_kv_tokens, bytes_per_value)

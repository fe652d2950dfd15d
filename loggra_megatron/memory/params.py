# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The parameters of a pipeline stage (``stage_parameters``: Megatron-Core's TP-local
tensors, names included) and the terms of ``memory.model`` that follow
from them: weights, grad buffer, masters, optimizer state, the optimizer step's fp32 grad
copies, the streamed units of an offloaded reference and the bucket of a master a checkpoint
save rebuilds at once (pure arithmetic, no torch).

Formulas and what they assume: ``docs/memory.md`` ("Formulas").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.memory.shape import (
    MemoryConfigError,
    TransformerShape,
    ceil_div,
    check_layout,
    grad_dtype_bytes,
)
from loggra_megatron.optim.gradient_sketch.settings import GradientSketchSettings
from loggra_megatron.optim.registry import OPTIMIZERS, sketches_shape
from loggra_megatron.train.step_plan import StepPlan

__all__ = [
    "ParamSpec",
    "bytes_per_master",
    "save_copy_numel",
    "grad_bytes",
    "is_sketched",
    "adam_temporary_bytes",
    "main_grad_copy_bytes",
    "master_param_bytes",
    "num_parameters",
    "optimizer_state_bytes",
    "stage_parameters",
    "reference_units",
    "weight_bytes",
]

_LOGGRA_SKETCHED_SCALAR_BYTES = 2 * 8  # step, basis_seed (int64)
DENSE_PIECE_NUMEL = 1 << 22
"""Elements of a densely updated shard LoGRA's AdamW converts to fp32 and updates at once
(``optim.gradient_sketch.distributed.DENSE_PIECE_NUMEL``, which tests/unit/memory/test_phases.py checks this
equals)."""
SAVE_COPY_NUMEL = 1 << 24
"""Elements of a master a checkpoint save rebuilds at once from bf16 weight + int16 remainder
(``optim.param_remainders.COPY_BUCKET_NUMEL``, which tests/unit/memory/test_phases.py checks
this equals; that module imports torch): 4 bytes each on the weight's device."""


@dataclass(frozen=True)
class ParamSpec:
    """One TP-local parameter tensor of a pipeline stage."""

    name: str
    """Megatron-Core name (local layer spec; local layer index on the stage)."""
    shape: tuple[int, ...]
    kind: str
    """``linear`` (transformer-layer GEMM weight), ``embedding``, ``output``, ``norm``, ``bias``."""

    @functools.cached_property  # the fit searches hundreds of layouts
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@functools.lru_cache(maxsize=256)
def _parameters(
    model: TransformerShape,
    tp: int,
    layers: int,
    first: bool,
    last: bool,
    vocab_rows: int,
    output_layer: bool,
) -> tuple[ParamSpec, ...]:
    h, d = model.hidden_size, model.kv_channels
    a, g = model.num_attention_heads, model.num_query_groups
    qkv_rows = (a + 2 * g) * d // tp
    fc1_rows = (2 if model.swiglu else 1) * model.ffn_hidden_size // tp
    specs = []
    if first:
        specs.append(ParamSpec("embedding.word_embeddings.weight", (vocab_rows, h), "embedding"))
    for i in range(layers):
        pre = f"decoder.layers.{i}."
        att = pre + "self_attention."
        specs += [
            ParamSpec(pre + "input_layernorm.weight", (h,), "norm"),
            ParamSpec(att + "linear_qkv.weight", (qkv_rows, h), "linear"),
            ParamSpec(att + "linear_proj.weight", (h, a * d // tp), "linear"),
            ParamSpec(pre + "pre_mlp_layernorm.weight", (h,), "norm"),
            ParamSpec(pre + "mlp.linear_fc1.weight", (fc1_rows, h), "linear"),
            ParamSpec(pre + "mlp.linear_fc2.weight", (h, model.ffn_hidden_size // tp), "linear"),
        ]
        if model.add_qkv_bias:
            specs.append(ParamSpec(att + "linear_qkv.bias", (qkv_rows,), "bias"))
        if model.qk_layernorm:
            specs.append(ParamSpec(att + "q_layernorm.weight", (d,), "norm"))
            specs.append(ParamSpec(att + "k_layernorm.weight", (d,), "norm"))
    if last:
        specs.append(ParamSpec("decoder.final_layernorm.weight", (h,), "norm"))
        if output_layer:
            specs.append(ParamSpec("output_layer.weight", (vocab_rows, h), "output"))
    return tuple(specs)  # cached: shared, so immutable


def stage_parameters(model: TransformerShape, plan: StepPlan, stage: int = 0) -> list[ParamSpec]:
    """The parameters of one TP rank of PP stage ``stage`` (all TP ranks are alike)."""
    check_layout(model, plan)
    t, p = plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size
    if not 0 <= stage < p:
        raise MemoryConfigError("stage", f"{stage} is not in [0, {p})")
    params = _parameters(
        model,
        t,
        model.num_layers // p,
        first=stage == 0,
        last=stage == p - 1,
        vocab_rows=model.padded_vocab_size(t) // t,
        output_layer=model.untie_embeddings_and_output_weights or p > 1,
    )
    return list(params)


def num_parameters(model: TransformerShape) -> int:
    """Parameters of the whole model (unpadded vocabulary, tied output layer counted once)."""
    specs = _parameters(
        model,
        1,
        model.num_layers,
        True,
        True,
        model.vocab_size,
        model.untie_embeddings_and_output_weights,
    )
    return sum(s.numel for s in specs)


def weight_bytes(params: list[ParamSpec], bytes_per_param: int = 2) -> int:
    """Model (or reference-model) weights: ``bytes_per_param`` per element."""
    return bytes_per_param * sum(s.numel for s in params)


def grad_bytes(params: list[ParamSpec], bytes_per_grad: int = 4) -> int:
    """Megatron's grad buffer: one grad per element, not sharded by ZeRO-1."""
    return bytes_per_grad * sum(s.numel for s in params)


def master_param_bytes(params: list[ParamSpec], dp: int = 1, bytes_per_master: int = 4) -> int:
    """fp32 master params (or 2-byte remainders), each tensor's elements split over ``dp``
    ranks."""
    return bytes_per_master * sum(ceil_div(s.numel, dp) for s in params)


def bytes_per_master(plan: StepPlan, est: EstimateConfig) -> int:
    """4 (fp32 masters), 2 (masters kept as the 16-bit weight + an int16 remainder: LoGRA's
    ``--loggra-param-remainders``, Megatron's precision-aware optimizer) or 0 (fp32 model)."""
    if plan.precision == "fp32":
        return 0
    if OPTIMIZERS[plan.optimizer].grads_per_weight:
        return 2 if plan.loggra_param_remainders else 4
    return 2 if bf16_moments(plan, est) else 4


def bf16_moments(plan: StepPlan, est: EstimateConfig) -> bool:
    """Megatron's precision-aware optimizer keeps a moment in bf16 (dense Adam only)."""
    aware = OPTIMIZERS[plan.optimizer].precision_aware
    return aware and "bf16" in (est.exp_avg_dtype, est.exp_avg_sq_dtype)


def is_sketched(spec: ParamSpec, min_dim: int = GradientSketchSettings.loggra_min_dim) -> bool:
    """LoGRA's default selection: transformer-layer 2-D weights with both sides ≥ min_dim."""
    return spec.kind == "linear" and sketches_shape(spec.shape, min_dim)


def optimizer_state_bytes(
    params: list[ParamSpec],
    optimizer: str,
    *,
    rank: int | None = None,
    min_dim: int = GradientSketchSettings.loggra_min_dim,
    dp: int = 1,
    exp_avg_bytes: int = 4,
    exp_avg_sq_bytes: int = 4,
    sketch: bool = True,
) -> int:
    """Optimizer state on one DP rank. ``sketch=False``: a sketching optimizer with nothing
    sketched (the backward sketch's dense leaves; its targets' state:
    ``memory.backward_sketch``).

    With ``dp=1`` this equals ``loggra_megatron.optim.state_bytes`` of a ``LoGRAAdamW``
    (embeddings/output layer in ``sketch=False`` groups) or a ``torch.optim.AdamW`` over
    fp32 tensors of these shapes, after their first step. Densely updated parameters take
    the registry entry's ``state_bytes_per_param`` per element and ``state_bytes_per_tensor``
    (``exp_avg_bytes + exp_avg_sq_bytes`` per element for a ``precision_aware`` one).
    ``rank``: the sketch rank (``--loggra-rank``), needed by a sketching optimizer only.
    """
    spec = OPTIMIZERS[optimizer]
    if rank is None and sketch and spec.sketched:
        raise MemoryConfigError("loggra_rank", f"{optimizer!r} sketches: give its rank")
    per_element = spec.state_bytes_per_param
    if spec.precision_aware:
        per_element = exp_avg_bytes + exp_avg_sq_bytes
    total = 0
    for s in params:
        if sketch and spec.sketched and is_sketched(s, min_dim):
            m, n = s.shape
            r = min(rank, m, n)
            rows = m if dp == 1 else min(m, ceil_div(m, dp) + 1)
            total += 4 * (2 * rows * r + n * r) + _LOGGRA_SKETCHED_SCALAR_BYTES
        else:
            total += per_element * ceil_div(s.numel, dp) + spec.state_bytes_per_tensor
    return total


def main_grad_copy_bytes(
    params: list[ParamSpec], plan: StepPlan, est: EstimateConfig, dp: int = 1, sketch=True
) -> int:
    """fp32 copies of 16-bit gradient shards alive during the optimizer step. LoGRA
    converts one weight at a time (``optim/megatron/model_grads.py``): a sketched weight's
    whole shard, a densely updated one ``DENSE_PIECE_NUMEL`` elements at a time
    (``sketch=False``: nothing is sketched, as in the backward sketch's dense leaves)."""
    if grad_dtype_bytes(plan) == 4:
        return 0  # Megatron's .float() of an fp32 grad is a view
    shards = [ceil_div(s.numel, dp) for s in params]
    spec = OPTIMIZERS[plan.optimizer]
    if spec.grads_per_weight and not plan.loggra_fp32_grad_copy:
        return 4 * max(
            (
                shard
                if sketch and spec.sketched and is_sketched(s, plan.loggra_min_dim)
                else min(shard, DENSE_PIECE_NUMEL)
                for s, shard in zip(params, shards, strict=True)
            ),
            default=0,
        )
    if bf16_moments(plan, est):
        return 0  # precision-aware optimizer: TE's FusedAdam reads the bf16 grads
    return 4 * sum(shards)


def adam_temporary_bytes(
    params: list[ParamSpec], plan: StepPlan, est: EstimateConfig, dp: int = 1
) -> int:
    """Temporaries of dense Adam's step by ``--adam-implementation``: none fused; with
    torch's AdamW the ``√v̂ + ε`` denominators (``torch.optim.adamw``): every shard's at once
    (``foreach``, ``4·Σ shards``) or the largest shard's, with the square root it is divided
    from (``single``, ``8·max shard``). LoGRA's optimizers run their own update (none)."""
    if OPTIMIZERS[plan.optimizer].grads_per_weight or bf16_moments(plan, est):
        return 0  # LoGRA's own update; TE's FusedAdam (precision-aware)
    shards = [ceil_div(s.numel, dp) for s in params]
    if est.adam_implementation == "foreach":
        return 4 * sum(shards)
    if est.adam_implementation == "single":
        return 8 * max(shards, default=0)
    return 0


def reference_units(model: TransformerShape, params: list[ParamSpec]) -> list[tuple[int, int]]:
    """``(elements, of them in GEMM weights)`` of each unit an offloaded reference streams
    (``--reference-offload``) on this stage: the embedding, each transformer layer, and the
    final norm with the output layer (the tied embedding's ``[V/t, h]`` when the output
    layer reuses it)."""
    units: dict[str, list[int]] = {}
    vocab_rows = 0
    for s in params:
        if s.kind == "embedding":
            key, vocab_rows = "embedding", s.shape[0]
        elif s.name.startswith("decoder.layers."):
            key = s.name.split(".")[2]
        else:  # the final norm and the output layer
            key = "head"
        unit = units.setdefault(key, [0, 0])
        unit[0] += s.numel
        unit[1] += s.numel if s.kind == "linear" else 0
    if "head" in units and not any(s.kind == "output" for s in params):
        units["head"][0] += vocab_rows * model.hidden_size  # the tied embedding, this stage's
    return [(n, linear) for n, linear in units.values()]


def save_copy_numel(params: list[ParamSpec]) -> int:
    """Elements a checkpoint save with remainders rebuilds at once on the device: one copy
    bucket (``SAVE_COPY_NUMEL``) of a master, the largest master when smaller."""
    return min(SAVE_COPY_NUMEL, max((s.numel for s in params), default=0))

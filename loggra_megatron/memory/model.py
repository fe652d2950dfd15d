# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Per-GPU memory of one RL training step (policy + reference + rollout) under Megatron-Core.

Pure arithmetic (no torch): ``estimate_rl_step_memory(model, parallel, step)`` returns a
:class:`MemoryBreakdown` in bytes for the GPU of the most loaded pipeline stage.

The formulas of every term, and what they assume: ``docs/memory.md`` ("Formulas").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loggra_megatron.memory.config import (
    DTYPE_BYTES,
    OPTIMIZERS,
    GiB,
    MemoryConfigError,
    ParallelConfig,
    RLStepConfig,
    TransformerShape,
    ceil_div,
)
from loggra_megatron.optim.registry import sketches_shape

__all__ = [
    "GiB",
    "MemoryBreakdown",
    "MemoryConfigError",
    "ParallelConfig",
    "ParamSpec",
    "RLStepConfig",
    "TransformerShape",
    "activation_bytes",
    "activation_bytes_per_layer",
    "estimate_rl_step_memory",
    "grad_bytes",
    "is_sketched",
    "kv_cache_bytes",
    "logits_bytes",
    "main_grad_copy_bytes",
    "max_rollout_batch_size",
    "master_param_bytes",
    "num_parameters",
    "optimizer_state_bytes",
    "stage_parameters",
    "weight_bytes",
]

_ADAM_SCALAR_BYTES = 4  # torch.optim.AdamW: fp32 `step` per tensor
_LOGGRA_SKETCHED_SCALAR_BYTES = 3 * 8  # step, nonfinite_skips, basis_seed (int64)
_LOGGRA_DENSE_SCALAR_BYTES = 2 * 8  # step, nonfinite_skips (int64)


# ---------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParamSpec:
    """One TP-local parameter tensor of a pipeline stage."""

    name: str
    """Megatron-Core name (local layer spec; local layer index on the stage)."""
    shape: tuple[int, ...]
    kind: str
    """``linear`` (transformer-layer GEMM weight), ``embedding``, ``output``, ``norm``, ``bias``."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _parameters(
    model: TransformerShape,
    tp: int,
    layers: int,
    first: bool,
    last: bool,
    vocab_rows: int,
    output_layer: bool,
) -> list[ParamSpec]:
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
    return specs


def stage_parameters(
    model: TransformerShape, parallel: ParallelConfig, stage: int = 0
) -> list[ParamSpec]:
    """The parameters of one TP rank of PP stage ``stage`` (all TP ranks are alike)."""
    parallel.check(model)
    t, p = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if not 0 <= stage < p:
        raise MemoryConfigError("stage", f"{stage} is not in [0, {p})")
    last = stage == p - 1
    return _parameters(
        model,
        t,
        model.num_layers // p,
        first=stage == 0,
        last=last,
        vocab_rows=model.padded_vocab_size(t) // t,
        output_layer=model.untie_embeddings_and_output_weights or p > 1,
    )


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


def master_param_bytes(params: list[ParamSpec], dp: int = 1) -> int:
    """fp32 master params, each tensor's elements split over ``dp`` ranks."""
    return 4 * sum(ceil_div(s.numel, dp) for s in params)


def is_sketched(spec: ParamSpec, min_dim: int = 64) -> bool:
    """LoGRA's default selection: transformer-layer 2-D weights with both sides ≥ min_dim."""
    return spec.kind == "linear" and sketches_shape(spec.shape, min_dim)


def optimizer_state_bytes(
    params: list[ParamSpec],
    optimizer: str,
    *,
    rank: int = 128,
    min_dim: int = 64,
    dp: int = 1,
    exp_avg_bytes: int = 4,
    exp_avg_sq_bytes: int = 4,
) -> int:
    """Optimizer state on one DP rank (see the module docstring for the convention).

    With ``dp=1`` this equals ``loggra_megatron.optim.state_bytes`` of a ``LoGRAAdamW``
    (embeddings/output layer in ``sketch=False`` groups) or a ``torch.optim.AdamW`` over
    fp32 tensors of these shapes, after their first step.
    """
    if optimizer not in OPTIMIZERS:
        raise MemoryConfigError("optimizer", f"{optimizer!r} is not one of {tuple(OPTIMIZERS)}")
    total = 0
    for s in params:
        if not OPTIMIZERS[optimizer].sketched:
            total += (exp_avg_bytes + exp_avg_sq_bytes) * ceil_div(s.numel, dp)
            total += _ADAM_SCALAR_BYTES
        elif is_sketched(s, min_dim):
            m, n = s.shape
            r = min(rank, m, n)
            rows = m if dp == 1 else min(m, ceil_div(m, dp) + 1)
            total += 4 * (2 * rows * r + n * r) + _LOGGRA_SKETCHED_SCALAR_BYTES
        else:
            total += 8 * ceil_div(s.numel, dp) + _LOGGRA_DENSE_SCALAR_BYTES
    return total


# ---------------------------------------------------------------------- activations etc.
def _t_sp(parallel: ParallelConfig) -> int:
    return parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1


def activation_bytes_per_layer(
    model: TransformerShape, parallel: ParallelConfig, micro_batch_size: int, seq_length: int
) -> int:
    """Saved activations of one transformer layer for one micro-batch (module docstring)."""
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


def activation_bytes(
    model: TransformerShape, parallel: ParallelConfig, step: RLStepConfig, stage: int = 0
) -> int:
    """Activations held at the peak of the backward pass on PP stage ``stage`` (1F1B)."""
    p = parallel.pipeline_model_parallel_size
    layers = model.num_layers // p
    in_flight = p - stage
    if step.num_microbatches is not None:
        in_flight = min(in_flight, step.num_microbatches)
    sb = step.micro_batch_size * step.seq_length
    per_layer = activation_bytes_per_layer(model, parallel, step.micro_batch_size, step.seq_length)
    layer_input = ceil_div(2 * sb * model.hidden_size, _t_sp(parallel))
    if step.recompute_granularity == "full":
        total = in_flight * layers * layer_input + per_layer
    else:
        total = in_flight * layers * per_layer
    if stage == p - 1:  # final-norm input and output-layer input
        total += 2 * layer_input
    return total


def logits_bytes(
    model: TransformerShape, parallel: ParallelConfig, tokens: int, copies: int = 2
) -> int:
    """fp32 vocab-parallel logits of ``tokens`` positions, ``copies`` times (+ log-softmax)."""
    t = parallel.tensor_model_parallel_size
    return tokens * (model.padded_vocab_size(t) // t) * 4 * copies


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


# ---------------------------------------------------------------------- the estimate
@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per term on one GPU (the stage ``stage``); see the module docstring."""

    stage: int
    num_parameters: int
    """Policy parameters on this GPU."""
    weights: int
    fp8_weight_cache: int
    grads: int
    master_params: int
    optimizer_state: int
    reference_model: int
    runtime_overhead: int
    kv_cache: int
    rollout_logits: int
    activations: int
    logits: int
    kl_probe_logits: int = 0
    main_grad_copies: int = 0

    STATIC = (
        "weights",
        "fp8_weight_cache",
        "grads",
        "master_params",
        "optimizer_state",
        "reference_model",
        "runtime_overhead",
    )
    ROLLOUT = ("kv_cache", "rollout_logits")
    TRAINING = ("activations", "logits")
    KL_CONTROL = ("kl_probe_logits",)
    OPTIMIZER_STEP = ("main_grad_copies",)
    TRANSIENT = (*ROLLOUT, *TRAINING, *KL_CONTROL, *OPTIMIZER_STEP)

    def terms(self) -> dict[str, int]:
        """Every term, in display order."""
        keys = (*self.STATIC, *self.TRANSIENT)
        return {k: getattr(self, k) for k in keys}

    def phases(self) -> dict[str, int]:
        """Transient bytes of each phase."""
        return {
            "rollout": self.rollout_bytes,
            "training": self.training_bytes,
            "kl control": self.kl_probe_logits,
            "optimizer step": self.main_grad_copies,
        }

    @property
    def static_bytes(self) -> int:
        return sum(getattr(self, k) for k in self.STATIC)

    @property
    def rollout_bytes(self) -> int:
        return sum(getattr(self, k) for k in self.ROLLOUT)

    @property
    def training_bytes(self) -> int:
        return sum(getattr(self, k) for k in self.TRAINING)

    @property
    def peak_phase(self) -> str:
        phases = self.phases()
        return max(phases, key=phases.get)

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + max(self.phases().values())

    def fits(self, gpu_bytes: int) -> bool:
        return self.total_bytes <= gpu_bytes


def main_grad_copy_bytes(params: list[ParamSpec], step: RLStepConfig, dp: int = 1) -> int:
    """fp32 copies of 16-bit gradient shards alive during the optimizer step."""
    if step.grad_bytes == 4:
        return 0  # Megatron's .float() of an fp32 grad is a view
    shards = [ceil_div(s.numel, dp) for s in params]
    if OPTIMIZERS[step.optimizer].grads_per_weight:
        return 4 * max(shards, default=0)  # one weight at a time (optim/megatron/model_grads.py)
    if "bf16" in (step.exp_avg_dtype, step.exp_avg_sq_dtype):
        return 0  # precision-aware optimizer: TE's FusedAdam reads the bf16 grads
    return 4 * sum(shards)


def _stage_breakdown(
    model: TransformerShape, parallel: ParallelConfig, step: RLStepConfig, stage: int
) -> MemoryBreakdown:
    params = stage_parameters(model, parallel, stage)
    dp = parallel.data_parallel_size
    last = stage == parallel.pipeline_model_parallel_size - 1
    linear = [s for s in params if s.kind == "linear"]
    ref_bytes = 4 if step.precision == "fp32" else 2
    return MemoryBreakdown(
        stage=stage,
        num_parameters=sum(s.numel for s in params),
        weights=weight_bytes(params, step.param_bytes),
        fp8_weight_cache=weight_bytes(linear, 2) if step.precision == "fp8" else 0,
        grads=grad_bytes(params, step.grad_bytes),
        master_params=0 if step.precision == "fp32" else master_param_bytes(params, dp),
        optimizer_state=optimizer_state_bytes(
            params,
            step.optimizer,
            rank=step.loggra_rank,
            min_dim=step.loggra_min_dim,
            dp=dp,
            exp_avg_bytes=DTYPE_BYTES[step.exp_avg_dtype],
            exp_avg_sq_bytes=DTYPE_BYTES[step.exp_avg_sq_dtype],
        ),
        reference_model=weight_bytes(params, ref_bytes) if step.reference_model else 0,
        runtime_overhead=step.runtime_overhead_bytes,
        kv_cache=kv_cache_bytes(
            model, parallel, step.rollout_batch_size, step.seq_length, ref_bytes
        ),
        rollout_logits=logits_bytes(model, parallel, step.rollout_batch_size) if last else 0,
        activations=activation_bytes(model, parallel, step, stage),
        logits=(
            logits_bytes(model, parallel, step.micro_batch_size * step.seq_length) if last else 0
        ),
        kl_probe_logits=(
            logits_bytes(
                model,
                parallel,
                step.kl_probe_sequences * step.seq_length,
                copies=6 if step.kl_estimator == "full" else 2,
            )
            if last
            else 0
        ),
        main_grad_copies=main_grad_copy_bytes(params, step, dp),
    )


def estimate_rl_step_memory(
    model: TransformerShape,
    parallel: ParallelConfig,
    step: RLStepConfig,
    stage: int | None = None,
) -> MemoryBreakdown:
    """Per-GPU memory of one RL step on PP stage ``stage`` (None: the most loaded stage)."""
    parallel.check(model)
    stages = range(parallel.pipeline_model_parallel_size) if stage is None else [stage]
    return max(
        (_stage_breakdown(model, parallel, step, s) for s in stages),
        key=lambda b: b.total_bytes,
    )


def max_rollout_batch_size(
    model: TransformerShape, parallel: ParallelConfig, step: RLStepConfig, gpu_bytes: int
) -> int | None:
    """Most sequences the rollout can generate concurrently within ``gpu_bytes`` per GPU
    (``step.rollout_batch_size`` ignored); None if the step does not fit even without rollout."""

    def fits(batch: int) -> bool:
        s = dataclasses.replace(step, rollout_batch_size=batch)
        return estimate_rl_step_memory(model, parallel, s).fits(gpu_bytes)

    if not fits(0):
        return None
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo

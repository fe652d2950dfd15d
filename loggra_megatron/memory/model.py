# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Per-GPU memory of one RL training step (policy + reference + rollout) under Megatron-Core.

Pure arithmetic (no torch): ``estimate_rl_step_memory(model, parallel, step)`` returns a
:class:`MemoryBreakdown` in bytes for the GPU of the most loaded pipeline stage.

The formulas of every term, and what they assume: ``docs/memory.md`` ("Formulas"); those of
``--loggra-sketch backward``: :mod:`~loggra_megatron.memory.backward_sketch`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from loggra_megatron.memory.backward_sketch import sketch_terms
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
from loggra_megatron.memory.runtime import (
    fragmentation_bytes,
    nccl_buffer_bytes,
    nvls_buffer_bytes,
)
from loggra_megatron.memory.transient import (
    TRAINING_LOGITS_COPIES,
    activation_bytes,
    activation_bytes_per_layer,
    forward_activation_bytes,
    kv_cache_bytes,
    logits_bytes,
    prefill_tokens,
    rollout_kv_cache_bytes,
)
from loggra_megatron.optim.registry import sketches_shape
from loggra_megatron.rollout.registry import ROLLOUT_ENGINES

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
    "bytes_per_master",
    "estimate_rl_step_memory",
    "forward_activation_bytes",
    "grad_bytes",
    "is_sketched",
    "kv_cache_bytes",
    "logits_bytes",
    "main_grad_copy_bytes",
    "max_rollout_batch_size",
    "master_param_bytes",
    "num_parameters",
    "optimizer_state_bytes",
    "prefill_tokens",
    "rollout_kv_cache_bytes",
    "stage_parameters",
    "weight_bytes",
]

_LOGGRA_SKETCHED_SCALAR_BYTES = 2 * 8  # step, basis_seed (int64)


# ---------------------------------------------------------------------- parameters
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


def stage_parameters(
    model: TransformerShape, parallel: ParallelConfig, stage: int = 0
) -> list[ParamSpec]:
    """The parameters of one TP rank of PP stage ``stage`` (all TP ranks are alike)."""
    parallel.check(model)
    t, p = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if not 0 <= stage < p:
        raise MemoryConfigError("stage", f"{stage} is not in [0, {p})")
    last = stage == p - 1
    params = _parameters(
        model,
        t,
        model.num_layers // p,
        first=stage == 0,
        last=last,
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


def bytes_per_master(step: RLStepConfig) -> int:
    """4 (fp32 masters), 2 (masters kept as the 16-bit weight + an int16 remainder: LoGRA's
    ``--loggra-param-remainders``, Megatron's precision-aware optimizer) or 0 (fp32 model)."""
    if step.precision == "fp32":
        return 0
    if OPTIMIZERS[step.optimizer].grads_per_weight:
        return 2 if step.loggra_param_remainders else 4
    return 2 if _bf16_moments(step) else 4


def _bf16_moments(step: RLStepConfig) -> bool:
    """Megatron's precision-aware optimizer keeps a moment in bf16 (dense Adam only)."""
    aware = OPTIMIZERS[step.optimizer].precision_aware
    return aware and "bf16" in (step.exp_avg_dtype, step.exp_avg_sq_dtype)


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
    sketch: bool = True,
) -> int:
    """Optimizer state on one DP rank (see the module docstring for the convention).
    ``sketch=False``: a sketching optimizer with nothing sketched (the backward sketch's
    dense leaves; its targets' state: :mod:`~loggra_megatron.memory.backward_sketch`).

    With ``dp=1`` this equals ``loggra_megatron.optim.state_bytes`` of a ``LoGRAAdamW``
    (embeddings/output layer in ``sketch=False`` groups) or a ``torch.optim.AdamW`` over
    fp32 tensors of these shapes, after their first step. Densely updated parameters take
    the registry entry's ``state_bytes_per_param`` per element and ``state_bytes_per_tensor``
    (``exp_avg_bytes + exp_avg_sq_bytes`` per element for a ``precision_aware`` one).
    """
    if optimizer not in OPTIMIZERS:
        raise MemoryConfigError("optimizer", f"{optimizer!r} is not one of {tuple(OPTIMIZERS)}")
    spec = OPTIMIZERS[optimizer]
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
    reference_fp8_weight_cache: int = 0
    prefill_activations: int = 0
    log_prob_activations: int = 0
    log_prob_logits: int = 0
    kl_probe_activations: int = 0
    kl_weight_backup: int = 0
    nccl_buffers: int = 0
    nvls_buffers: int = 0
    allocator_fragmentation: int = 0
    old_log_prob_activations: int = 0
    old_log_prob_logits: int = 0
    sketch_buffer: int = 0
    sketch_projections: int = 0
    sketch_step: int = 0

    STATIC = (
        "weights",
        "fp8_weight_cache",
        "grads",
        "master_params",
        "optimizer_state",
        "sketch_buffer",
        "reference_model",
        "reference_fp8_weight_cache",
        "runtime_overhead",
        "nccl_buffers",
        "nvls_buffers",
    )
    ROLLOUT = ("kv_cache", "rollout_logits", "prefill_activations", "allocator_fragmentation")
    OLD_LOG_PROBS = ("old_log_prob_activations", "old_log_prob_logits")
    LOG_PROBS = ("log_prob_activations", "log_prob_logits")
    TRAINING = ("activations", "sketch_projections", "logits")
    KL_CONTROL = ("kl_probe_activations", "kl_probe_logits", "kl_weight_backup")
    OPTIMIZER_STEP = ("main_grad_copies", "sketch_step")
    TRANSIENT = (*ROLLOUT, *OLD_LOG_PROBS, *LOG_PROBS, *TRAINING, *KL_CONTROL, *OPTIMIZER_STEP)
    PHASES = {
        "rollout": ROLLOUT,
        "old log-probs": OLD_LOG_PROBS,
        "ref log-probs": LOG_PROBS,
        "training": TRAINING,
        "kl control": KL_CONTROL,
        "optimizer step": OPTIMIZER_STEP,
    }

    def terms(self) -> dict[str, int]:
        """Every term, in display order."""
        keys = (*self.STATIC, *self.TRANSIENT)
        return {k: getattr(self, k) for k in keys}

    def phases(self) -> dict[str, int]:
        """Transient bytes of each phase (the phases never overlap)."""
        return {name: sum(getattr(self, k) for k in keys) for name, keys in self.PHASES.items()}

    @property
    def static_bytes(self) -> int:
        return sum(getattr(self, k) for k in self.STATIC)

    @property
    def rollout_bytes(self) -> int:
        return self.phases()["rollout"]

    @property
    def training_bytes(self) -> int:
        return self.phases()["training"]

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
    if OPTIMIZERS[step.optimizer].grads_per_weight and not step.loggra_fp32_grad_copy:
        return 4 * max(shards, default=0)  # one weight at a time (optim/megatron/model_grads.py)
    if _bf16_moments(step):
        return 0  # precision-aware optimizer: TE's FusedAdam reads the bf16 grads
    return 4 * sum(shards)


def _rollout_terms(model, parallel, step, last: bool, kv_bytes: int) -> dict[str, int]:
    """The rollout phase, and the dynamic engine's log-prob recompute after it."""
    rows, seq, t = step.rollout_rows, step.seq_length, parallel.tensor_model_parallel_size
    kv = rollout_kv_cache_bytes(model, parallel, step, kv_bytes)
    # prompts of at most s − N tokens, SP off (generation switches it off); the dynamic
    # engine's prefill is one flat [1, tokens] forward
    prefill = forward_activation_bytes(
        model, parallel, 1, prefill_tokens(step, t), sequence_parallel=False
    )
    # the dynamic engine recomputes the policy's log-probs as the reference forward runs:
    # micro-batches of --log-prob-micro-batch-size sequences; the static one samples them
    recompute = rows and ROLLOUT_ENGINES[step.rollout_engine].recomputes_log_probs
    lp_rows = step.log_prob_rows if recompute else 0
    return {
        "kv_cache": kv,
        # last-position logits, gathered over TP (full vocabulary), fp32 + softmax
        "rollout_logits": rows * model.padded_vocab_size(t) * 4 * 2 if last else 0,
        "prefill_activations": prefill,
        "allocator_fragmentation": fragmentation_bytes(step, kv),
        "old_log_prob_activations": forward_activation_bytes(model, parallel, lp_rows, seq),
        "old_log_prob_logits": logits_bytes(model, parallel, lp_rows * seq) if last else 0,
    }


def _stage_breakdown(
    model: TransformerShape, parallel: ParallelConfig, step: RLStepConfig, stage: int
) -> MemoryBreakdown:
    params = stage_parameters(model, parallel, stage)
    dp = parallel.data_parallel_size if step.distributed_optimizer else 1
    last = stage == parallel.pipeline_model_parallel_size - 1
    linear = [s for s in params if s.kind == "linear"]
    ref_bytes = 4 if step.precision == "fp32" else 2
    fp8, ref, seq = step.precision == "fp8", step.reference_model, step.seq_length
    probe = step.kl_probe_sequences
    probe_rows = min(probe, step.log_prob_rows)
    masters = bytes_per_master(step)
    # the backward sketch's frozen targets (none without it) and the dense rest
    sk = sketch_terms(model, parallel, step, stage, params, dp)
    dense = sk.dense_of(params)
    # a KL trial overwrites LoGRA's bf16 weights, which are half of each master with
    # remainders: it backs up this rank's shards (2 bytes per master element)
    trial_backup = probe and masters == 2 and OPTIMIZERS[step.optimizer].grads_per_weight
    return MemoryBreakdown(
        stage=stage,
        num_parameters=sum(p.numel for p in params),
        weights=weight_bytes(params, step.param_bytes),
        fp8_weight_cache=weight_bytes(linear, 2) if fp8 else 0,
        grads=grad_bytes(dense, step.grad_bytes),
        master_params=master_param_bytes(dense, dp, masters) + sk.masters(masters),
        optimizer_state=optimizer_state_bytes(
            dense,
            step.optimizer,
            rank=step.loggra_rank,
            min_dim=step.loggra_min_dim,
            dp=dp,
            exp_avg_bytes=DTYPE_BYTES[step.exp_avg_dtype],
            exp_avg_sq_bytes=DTYPE_BYTES[step.exp_avg_sq_dtype],
            sketch=not sk.targets,
        )
        + sk.row_state,
        sketch_buffer=sk.buffer,
        reference_model=weight_bytes(params, ref_bytes) if ref else 0,
        # forward only: TE caches the FP8 weight without its transpose
        reference_fp8_weight_cache=weight_bytes(linear, 1) if fp8 and ref else 0,
        runtime_overhead=step.runtime_overhead_bytes,
        nccl_buffers=nccl_buffer_bytes(parallel, step),
        nvls_buffers=nvls_buffer_bytes(parallel, step),
        **_rollout_terms(model, parallel, step, last, ref_bytes),
        log_prob_activations=(
            forward_activation_bytes(model, parallel, step.log_prob_rows, seq) if ref else 0
        ),
        log_prob_logits=(
            logits_bytes(model, parallel, step.log_prob_rows * seq) if ref and last else 0
        ),
        activations=activation_bytes(model, parallel, step, stage) - sk.activation_saving,
        sketch_projections=sk.projections,
        logits=(
            logits_bytes(model, parallel, step.micro_batch_size * seq, TRAINING_LOGITS_COPIES)
            if last
            else 0
        ),
        # the trial forward runs in micro-batches of the log-prob micro-batch size; the full
        # estimator keeps every trial row's reference logits, and one micro-batch's
        # candidate logits and KL temporaries (p_old, z_old − z_new, their product) at a
        # time; the k-estimators one micro-batch's logits and log-softmax temporaries
        kl_probe_activations=forward_activation_bytes(model, parallel, probe_rows, seq),
        kl_probe_logits=(
            logits_bytes(model, parallel, probe * seq, copies=1)
            + logits_bytes(model, parallel, probe_rows * seq, copies=4)
            if step.kl_estimator == "full"
            else logits_bytes(model, parallel, probe_rows * seq)
        )
        if last
        else 0,
        kl_weight_backup=master_param_bytes(dense, dp, 2) + sk.masters(2) if trial_backup else 0,
        main_grad_copies=main_grad_copy_bytes(dense, step, dp),
        sketch_step=sk.step,
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
    (``step.rollout_batch_size`` and ``inference_max_tokens`` ignored: the largest useful
    KV budget is this times ``seq_length``); None if the step does not fit even without
    rollout."""
    step = dataclasses.replace(step, inference_max_tokens=None, rollout_engine="static")

    def fits(batch: int) -> bool:
        s = dataclasses.replace(step, rollout_batch_size=batch)
        return estimate_rl_step_memory(model, parallel, s).fits(gpu_bytes)

    if not fits(0):
        return None
    lo, hi = 0, 1
    while fits(hi):
        if hi > 2**40:  # a model whose KV cache costs nothing
            raise MemoryConfigError("seq_length", "the rollout's KV cache does not grow")
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo

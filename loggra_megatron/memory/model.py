# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Per-GPU memory of one RL training step (policy + reference + rollout) under Megatron-Core.

Pure arithmetic (no torch): ``estimate_rl_step_memory(model, plan, est)`` returns a
``MemoryBreakdown`` in bytes for the GPU of the most loaded pipeline stage,
for the model's shape (``TransformerShape``), the run's RL step as the trainer
plans it (``StepPlan``) and the machine
(``EstimateConfig``: its capacity, the runtime allowance, NCCL's and
the allocator's settings, dense Adam's moment dtypes).

The terms: ``.params`` (weights, grads, masters, optimizer state), ``.transient``
(activations, the chunked log-prob head, KV cache, prefill), ``.runtime`` (NCCL, the
allocator), ``.backward_sketch`` (``--loggra-sketch backward``); their formulas and what
they assume: ``docs/memory.md`` ("Formulas").
"""

from __future__ import annotations

import dataclasses

from loggra_megatron.memory.backward_sketch import SketchTerms
from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.memory.params import (
    ParamSpec,
    adam_temporary_bytes,
    bytes_per_master,
    grad_bytes,
    is_sketched,
    main_grad_copy_bytes,
    master_param_bytes,
    num_parameters,
    optimizer_state_bytes,
    reference_units,
    save_copy_numel,
    stage_parameters,
    weight_bytes,
)
from loggra_megatron.memory.phases import MemoryBreakdown
from loggra_megatron.memory.runtime import (
    fragmentation_bytes,
    nccl_buffer_bytes,
    nvls_buffer_bytes,
)
from loggra_megatron.memory.shape import (
    DTYPE_BYTES,
    GiB,
    MemoryConfigError,
    TransformerShape,
    check_layout,
    grad_dtype_bytes,
    param_dtype_bytes,
)
from loggra_megatron.memory.transient import (
    activation_bytes,
    activation_bytes_per_layer,
    forward_activation_bytes,
    full_kl_logits_bytes,
    kv_cache_bytes,
    log_prob_head_bytes,
    prefill_tokens,
    rollout_kv_cache_bytes,
    rollout_kv_tokens,
    rollout_rows,
)
from loggra_megatron.optim.registry import OPTIMIZERS, SKETCH_MODES, resolve
from loggra_megatron.train.step_plan import StepPlan

__all__ = [
    "EstimateConfig",
    "GiB",
    "MemoryBreakdown",
    "MemoryConfigError",
    "ParamSpec",
    "StepPlan",
    "TransformerShape",
    "activation_bytes",
    "activation_bytes_per_layer",
    "bytes_per_master",
    "estimate_generation_memory",
    "estimate_rl_step_memory",
    "forward_activation_bytes",
    "full_kl_logits_bytes",
    "grad_bytes",
    "is_sketched",
    "kv_cache_bytes",
    "log_prob_head_bytes",
    "main_grad_copy_bytes",
    "master_param_bytes",
    "max_rollout_batch_size",
    "num_parameters",
    "optimizer_state_bytes",
    "prefill_tokens",
    "rollout_gpu_memory",
    "rollout_kv_cache_bytes",
    "rollout_kv_tokens",
    "rollout_rows",
    "stage_parameters",
    "weight_bytes",
    "weight_sync_bytes",
]


def _rollout_terms(
    model, plan: StepPlan, est, last: bool, kv_bytes: int, generates: bool = True
) -> dict[str, int]:
    """The rollout phase (none on a GPU that does not generate: ``generates``), and the
    policy's log-prob recompute after it (π_old from a forward: ``StepPlan.old_log_probs``)."""
    rows, seq, t = rollout_rows(plan), plan.seq_length, plan.tensor_model_parallel_size
    kv = rollout_kv_cache_bytes(model, plan, kv_bytes)
    # prompts of at most s − N tokens, SP off (generation switches it off); the dynamic
    # engine's prefill is one flat [1, tokens] forward
    prefill = forward_activation_bytes(
        model, plan, 1, prefill_tokens(plan), sequence_parallel=False
    )
    # π_old recomputed (the dynamic engine, or --tis-cap, over several updates): micro-
    # batches of --log-prob-micro-batch-size sequences; else sampled or the training forward's
    recompute = rows and plan.old_log_probs == "recompute"
    lp_rows = plan.forward_micro_batch_size if recompute else 0
    if not generates:
        kv = prefill = rows = 0
    return {
        "kv_cache": kv,
        # last-position logits, gathered over TP (full vocabulary), fp32 + softmax
        "rollout_logits": rows * model.padded_vocab_size(t) * 4 * 2 if last else 0,
        "prefill_activations": prefill,
        "allocator_fragmentation": fragmentation_bytes(est, kv),
        "old_log_prob_activations": forward_activation_bytes(model, plan, lp_rows, seq),
        "old_log_prob_logits": log_prob_head_bytes(model, plan, lp_rows * seq) if last else 0,
    }


def _reference_terms(model, plan: StepPlan, params, last: bool) -> dict[str, int]:
    """The frozen reference: resident (its weights, and its FP8 cache under FP8), or with
    ``--reference-offload`` on the host, two of its units on the GPU while its forward runs
    (the one computing and the one prefetched: the largest unit twice, with its FP8 copy);
    and that forward, the reference log-probs phase."""
    if not plan.reference_model:
        return {}
    w, fp8 = param_dtype_bytes(plan), plan.precision == "fp8"
    rows, seq = plan.forward_micro_batch_size, plan.seq_length
    terms = {
        "log_prob_activations": forward_activation_bytes(model, plan, rows, seq),
        "log_prob_logits": log_prob_head_bytes(model, plan, rows * seq) if last else 0,
    }
    if plan.reference_offload:
        units = reference_units(model, params)
        terms["reference_streamed"] = 2 * max(w * n + (gemm if fp8 else 0) for n, gemm in units)
    else:  # forward only: TE caches the FP8 weight without its transpose
        linear = [s for s in params if s.kind == "linear"]
        terms["reference_model"] = weight_bytes(params, w)
        terms["reference_fp8_weight_cache"] = weight_bytes(linear, 1) if fp8 else 0
    return terms


def _kl_probe_logits(model, plan: StepPlan, last: bool) -> int:
    """The trial forward runs in micro-batches of the forward micro-batch size; the full
    estimator keeps every trial row's reference logits and one micro-batch's candidate
    logits and KL temporaries at a time; the k-estimators one micro-batch's chunked
    log-probs."""
    trial = plan.kl_trial_rows
    rows = min(trial, plan.forward_micro_batch_size)
    if not last or not trial:
        return 0
    if plan.kl_estimator == "full":
        return full_kl_logits_bytes(model, plan, trial, rows)
    return log_prob_head_bytes(model, plan, rows * plan.seq_length)


def _stage_breakdown(
    model: TransformerShape, plan: StepPlan, est: EstimateConfig, stage: int
) -> MemoryBreakdown:
    params = stage_parameters(model, plan, stage)
    dp = plan.data_parallel_size if plan.distributed_optimizer else 1
    last = stage == plan.pipeline_model_parallel_size - 1
    linear = [s for s in params if s.kind == "linear"]
    w, seq, fp8 = param_dtype_bytes(plan), plan.seq_length, plan.precision == "fp8"
    probe_rows = min(plan.kl_trial_rows, plan.forward_micro_batch_size)
    masters = bytes_per_master(plan, est)
    loggra_remainders = masters == 2 and OPTIMIZERS[plan.optimizer].grads_per_weight
    # the backward sketch's frozen targets (none without it) and the dense rest
    sk = sketch_mode_terms(model, plan, stage, params, dp)
    dense = sk.dense_of(params)
    # a KL trial overwrites LoGRA's bf16 weights, which are half of each master with
    # remainders: it backs up this rank's shards (2 bytes per master element), on the GPU
    # unless --kl-backup-offload keeps the copy on the host
    trial_backup = plan.kl_trial_rows and loggra_remainders and not plan.kl_backup_offload
    return MemoryBreakdown(
        stage=stage,
        num_parameters=sum(p.numel for p in params),
        weights=weight_bytes(params, w),
        fp8_weight_cache=weight_bytes(linear, 2) if fp8 else 0,
        grads=grad_bytes(dense, grad_dtype_bytes(plan)),
        master_params=master_param_bytes(dense, dp, masters) + sk.masters(masters),
        optimizer_state=optimizer_state_bytes(
            dense,
            plan.optimizer,
            rank=plan.loggra_rank,
            min_dim=plan.loggra_min_dim,
            dp=dp,
            exp_avg_bytes=DTYPE_BYTES[est.exp_avg_dtype],
            exp_avg_sq_bytes=DTYPE_BYTES[est.exp_avg_sq_dtype],
            sketch=not sk.targets,
        )
        + sk.row_state,
        sketch_buffer=sk.buffer,
        runtime_overhead=int(est.runtime_overhead_gb * GiB),
        nccl_buffers=nccl_buffer_bytes(plan, est),
        nvls_buffers=nvls_buffer_bytes(plan, est),
        **_rollout_terms(model, plan, est, last, w, generates=not plan.generation_ranks),
        **_reference_terms(model, plan, params, last),
        activations=activation_bytes(model, plan, stage) - sk.activation_saving,
        sketch_projections=sk.projections,
        logits=(
            log_prob_head_bytes(model, plan, plan.micro_batch_size * seq, training=True)
            if last
            else 0
        ),
        kl_probe_activations=forward_activation_bytes(model, plan, probe_rows, seq),
        kl_probe_logits=_kl_probe_logits(model, plan, last),
        kl_weight_backup=master_param_bytes(dense, dp, 2) + sk.masters(2) if trial_backup else 0,
        main_grad_copies=main_grad_copy_bytes(dense, plan, est, dp, sketch=not sk.targets),
        adam_temporaries=adam_temporary_bytes(dense, plan, est, dp),
        sketch_step=sk.step,
        # saving rebuilds each master from weight + remainder, one copy bucket at a time,
        # into its host copy (optim/megatron/checkpoint.py, optim/param_remainders.py)
        checkpoint_save=4 * save_copy_numel(dense) if loggra_remainders else 0,
    )


def estimate_rl_step_memory(
    model: TransformerShape,
    plan: StepPlan,
    est: EstimateConfig | None = None,
    stage: int | None = None,
) -> MemoryBreakdown:
    """Per-GPU memory of one RL step on PP stage ``stage`` (None: the most loaded stage) on
    the machine ``est`` (None: the estimator's defaults)."""
    est = est or EstimateConfig()
    check_layout(model, plan)
    stages = range(plan.pipeline_model_parallel_size) if stage is None else [stage]
    return max(
        (_stage_breakdown(model, plan, est, s) for s in stages),
        key=lambda b: b.total_bytes,
    )


def estimate_generation_memory(
    model: TransformerShape,
    plan: StepPlan,
    est: EstimateConfig | None = None,
    rows: int | None = None,
) -> MemoryBreakdown:
    """Per-GPU memory of a generation GPU (``--generation-ranks``): the policy's weights at
    the generation TP size (and TE's FP8 weight cache under FP8), the runtime, and the
    rollout phase of its share of the rollout (``StepPlan.generation_plan``; ``rows``: that
    many rows per generation replica instead); no gradient, master, optimizer state,
    reference or activation of training. The weight sync arrives in host memory and is
    copied into the weights one parameter at a time."""
    est = est or EstimateConfig()
    gen = plan.generation_plan()
    if rows is not None:
        gen = dataclasses.replace(gen, rollout_batch_size=rows)
    check_layout(model, gen)
    params = stage_parameters(model, gen, 0)
    linear = [s for s in params if s.kind == "linear"]
    w = param_dtype_bytes(gen)
    return MemoryBreakdown(
        stage=0,
        num_parameters=sum(p.numel for p in params),
        sync_state=_shadow_bytes(model, plan) if plan.weight_sync == "lowrank" else 0,
        weights=weight_bytes(params, w),
        fp8_weight_cache=weight_bytes(linear, 1) if gen.precision == "fp8" else 0,
        grads=0,
        master_params=0,
        optimizer_state=0,
        runtime_overhead=int(est.runtime_overhead_gb * GiB),
        nccl_buffers=nccl_buffer_bytes(gen, est),
        activations=0,
        logits=0,
        **_rollout_terms(model, gen, est, True, w),
    )


def sketch_mode_terms(
    model: TransformerShape, plan: StepPlan, stage: int, params: list, dp: int
) -> SketchTerms:
    """What ``plan``'s ``--loggra-sketch`` mode adds on PP stage ``stage`` (its registry
    entry's ``memory_terms``): none with a dense optimizer or a mode without."""
    terms = SKETCH_MODES[plan.loggra_sketch].memory_terms
    if terms is None or not OPTIMIZERS[plan.optimizer].sketched:
        return SketchTerms(dp=dp)
    return resolve(terms)(model, plan, stage, params, dp)


def _sketched_and_rest(model: TransformerShape, plan: StepPlan, tp: int):
    """``(sketched weights, every other parameter)`` of one TP rank of the whole model (one
    pipeline stage) at TP size ``tp``."""
    from loggra_megatron.memory.backward_sketch import sketched_params

    layout = dataclasses.replace(
        plan, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, sequence_parallel=False
    )
    params = stage_parameters(model, layout, 0)
    sketched = sketched_params(params, plan)
    chosen = {id(s) for s in sketched}  # by identity: equality compares whole specs
    return sketched, [s for s in params if id(s) not in chosen]


def _shadow_bytes(model: TransformerShape, plan: StepPlan) -> int:
    """``--weight-sync lowrank``'s state on a generation GPU (``placement.lowrank.Shadows``):
    the masters of the sketched weights (4 bytes with fp32 masters, 2 with remainders, none
    for fp32 weights); with the training TP size, this rank's shards only (the weights are
    the model's own), else every sketched weight of the whole model and its weight in the
    trainer's layout too."""
    tp = plan.generation_tensor_model_parallel_size
    local = tp == plan.tensor_model_parallel_size
    sketched, _ = _sketched_and_rest(model, plan, tp if local else 1)
    w = param_dtype_bytes(plan)
    master = 0 if w == 4 else 2 if plan.loggra_param_remainders else 4
    return sum(s.numel for s in sketched) * (master if local else w + master)


def weight_sync_bytes(model: TransformerShape, plan: StepPlan, rank: int) -> dict[str, int]:
    """Bytes of one weight sync after the first (``--generation-ranks``): ``full``, every
    weight in the model's dtype; ``lowrank``, each sketched weight's row factor ``D``
    (``rows × r`` fp32, rank ``rank``) and the other trained weights in full (none with
    ``--freeze-non-targets``). The whole model: every weight once."""
    sketched, rest = _sketched_and_rest(model, plan, 1)
    w = param_dtype_bytes(plan)
    dense = 0 if plan.freeze_non_targets else sum(s.numel for s in rest) * w
    return {
        "full": sum(s.numel for s in sketched + rest) * w,
        "lowrank": sum(s.shape[0] for s in sketched) * rank * 4 + dense,
    }


def rollout_gpu_memory(
    model: TransformerShape, plan: StepPlan, est: EstimateConfig | None = None
) -> MemoryBreakdown:
    """Per-GPU memory of the GPUs that hold the rollout's KV cache: a generation GPU with
    ``--generation-ranks``, else the training GPU (the most loaded stage)."""
    if plan.generation_ranks:
        return estimate_generation_memory(model, plan, est)
    return estimate_rl_step_memory(model, plan, est)


def max_rollout_batch_size(
    model: TransformerShape, plan: StepPlan, est: EstimateConfig, gpu_bytes: int
) -> int | None:
    """Most sequences a replica of the GPUs that generate (``rollout_gpu_memory``) can
    generate concurrently within ``gpu_bytes`` per GPU (``plan.rollout_batch_size`` and
    ``inference_max_tokens`` ignored: the largest useful KV budget is this times
    ``seq_length``); None if those GPUs do not fit even without rollout."""
    plan = dataclasses.replace(plan, inference_max_tokens=None, rollout_engine="static")

    def fits(batch: int) -> bool:
        if plan.generation_ranks:
            return estimate_generation_memory(model, plan, est, rows=batch).fits(gpu_bytes)
        p = dataclasses.replace(plan, rollout_batch_size=batch)
        return estimate_rl_step_memory(model, p, est).fits(gpu_bytes)

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

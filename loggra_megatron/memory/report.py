# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The table ``tools/estimate_memory.py`` prints: dense Adam and LoGRA side by side, every
term, each phase's total, the capacity the verdict is against, the verdict and the largest
rollout that fits."""

from __future__ import annotations

from loggra_megatron.memory.capacity import capacity_line
from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.memory.model import (
    GiB,
    MemoryBreakdown,
    StepPlan,
    bytes_per_master,
    max_rollout_batch_size,
    num_parameters,
    prefill_tokens,
    rollout_kv_tokens,
    rollout_rows,
)
from loggra_megatron.memory.runtime import communicators
from loggra_megatron.memory.shape import grad_dtype_bytes
from loggra_megatron.model.config import log_prob_chunk_tokens
from loggra_megatron.optim.registry import SKETCH_MODES, backward_sketch

__all__ = ["report"]

LABELS = {
    "weights": "weights",
    "fp8_weight_cache": "fp8 weight cache (TE)",
    "grads": "grads",
    "master_params": "masters",
    "optimizer_state": "optimizer state",
    "sketch_buffer": "sketch buffer S (fp32)",
    "reference_model": "reference model",
    "reference_fp8_weight_cache": "reference fp8 cache (TE)",
    "runtime_overhead": "runtime overhead",
    "nccl_buffers": "NCCL ring buffers",
    "nvls_buffers": "NCCL NVLS buffers",
    "kv_cache": "rollout: KV cache",
    "rollout_logits": "rollout: logits",
    "prefill_activations": "rollout: prefill",
    "allocator_fragmentation": "rollout: fragmentation",
    "old_log_prob_activations": "old log-probs: activations",
    "old_log_prob_logits": "old log-probs: logits",
    "log_prob_activations": "ref log-probs: activations",
    "log_prob_logits": "ref log-probs: logits",
    "reference_streamed": "ref log-probs: weights",
    "activations": "training: activations",
    "sketch_projections": "training: sketch P = XB^T",
    "logits": "training: logits",
    "kl_probe_activations": "kl control: activations",
    "kl_probe_logits": "kl control: probe logits",
    "kl_weight_backup": "kl control: weight backup",
    "main_grad_copies": "optimizer: fp32 grad copies",
    "adam_temporaries": "optimizer: Adam temporaries",
    "sketch_step": "optimizer: sketch step",
    "checkpoint_save": "checkpoint: fp32 of a bucket",
    "sync_state": "low-rank sync: the trainer's masters",
}


def _gib(x: int) -> str:
    return f"{x / GiB:.2f}"


def report(model, plans, results, est: EstimateConfig, source, selected) -> str:
    """The table for ``results`` (``{"adam": MemoryBreakdown, "loggra": ...}`` of the
    ``plans`` of the same names, and the ``selected`` optimizer's, summed up under the table,
    if it is another one) on the machine ``est``."""
    dense, loggra = results["adam"], results["loggra"]
    mark = {k: "*" if selected == k else " " for k in ("adam", "loggra")}
    header = f"{'GiB per GPU':<28}{'dense Adam' + mark['adam']:>20}"
    header += f"{_loggra_label(plans['loggra']) + mark['loggra']:>20}{'LoGRA - Adam':>14}"
    lines = _describe(model, plans["loggra"], est, dense, source)
    lines += [header, "-" * len(header)]
    lines += _term_rows(plans, est, dense, loggra)
    lines.append("-" * len(header))
    saved = 100.0 * (dense.total_bytes - loggra.total_bytes) / dense.total_bytes
    lines.append(
        _row("TOTAL per GPU", dense.total_bytes, loggra.total_bytes) + f"  ({saved:.1f}% saved)"
    )
    lines += _verdicts(model, plans, results, est, selected, list(mark))
    return "\n".join(lines)


def generation_report(
    plan: StepPlan, gen, rows: int | None, sync: dict[str, int] | None = None
) -> str:
    """The lines of a generation GPU (``--generation-ranks``; ``gen``: its
    ``MemoryBreakdown``; ``rows``: its ``max_rollout_batch_size``), under the training GPUs'
    table (which then holds no rollout), and with the backward sketch the bytes of a weight
    sync (``sync``: ``weight_sync_bytes``)."""
    g = plan.generation_plan()
    terms = {k: v for k, v in gen.terms().items() if v}
    parts = ", ".join(f"{LABELS.get(k, k)} {_gib(v)}" for k, v in terms.items())
    line = (
        f"generation GPUs  {plan.generation_ranks} (TP {g.tensor_model_parallel_size} x "
        f"{g.data_parallel_size} replicas, {g.rollout_batch_size} rollouts each): "
        f"{_gib(gen.total_bytes)} GiB per GPU (peak phase: {gen.peak_phase}; {parts}); the "
        "training GPUs above hold no KV cache"
    )
    cap = "none" if rows is None else f"{rows} (a KV budget of {rows * plan.seq_length} tokens)"
    line += f"\ngeneration GPUs: max rollout rows at once {cap}"
    if sync:
        ratio = sync["lowrank"] / sync["full"]
        line += (
            f"\nweight sync per step after the first: full {_gib(sync['full'])} GiB, "
            f"--weight-sync lowrank {_gib(sync['lowrank'])} GiB ({ratio:.3f}x)"
        )
    return line


def _loggra_label(plan: StepPlan) -> str:
    """``LoGRA r=128``, or ``LoGRA bwd r=128`` with ``--loggra-sketch backward``."""
    return f"LoGRA{SKETCH_MODES[plan.loggra_sketch].label} r={plan.loggra_rank}"


def _describe(model, step: StepPlan, est: EstimateConfig, dense, source) -> list[str]:
    """The lines above the table: model, parallel layout, step, rollout, runtime, capacity."""
    t, p, d = (
        step.tensor_model_parallel_size,
        step.pipeline_model_parallel_size,
        step.data_parallel_size,
    )
    prefill = prefill_tokens(step)
    comms = communicators(step, est.gpus_per_node)
    chunk = log_prob_chunk_tokens(step.log_prob_chunk_size, model.padded_vocab_size(t) // t)
    reference = "off"
    if step.reference_model:
        offload = ", offloaded to the host" if step.reference_offload else ""
        reference = f"on{offload} (log-prob micro-batch {step.forward_micro_batch_size})"
    return [
        f"model     {source}: {num_parameters(model) / 1e9:.2f} B params, {model.num_layers} "
        f"layers, hidden {model.hidden_size}, ffn {model.ffn_hidden_size}"
        f"{' (SwiGLU)' if model.swiglu else ''}, {model.num_attention_heads} heads / "
        f"{model.num_query_groups} KV groups x {model.kv_channels}, vocab {model.vocab_size} "
        f"(padded {model.padded_vocab_size(t)}), "
        f"{'untied' if model.untie_embeddings_and_output_weights else 'tied'} embeddings",
        f"parallel  TP {t} x PP {p} x DP {d} = {step.world_size} GPUs"
        f"{', sequence parallel' if step.sequence_parallel else ''}; distributed optimizer "
        f"(ZeRO-1); stage {dense.stage} of {p} is the most loaded "
        f"({dense.num_parameters / 1e9:.3f} B params/GPU)",
        f"step      {step.precision}, {'fp32' if grad_dtype_bytes(step) == 4 else 'bf16'} grads, "
        f"micro-batch {step.micro_batch_size} x {step.seq_length} tokens, recompute "
        f"{_recompute(step)}, log-probs in chunks of {chunk} tokens, "
        f"reference model {reference}"
        + (
            f", KL trials on {step.kl_trial_rows} seqs (probe + held-out, {step.kl_estimator}"
            f"{'; weight backup on the host' if step.kl_backup_offload else ''})"
            if step.kl_trial_rows
            else ""
        )
        + (
            f", LoGRA's backward sketch of {','.join(step.loggra_targets)} "
            f"(row {step.loggra_row_optimizer})"
            if backward_sketch(step.optimizer, step.loggra_sketch)
            else ""
        ),
        f"rollout   {step.rollout_batch_size} seqs per replica, {step.rollout_engine} engine, "
        f"KV cache of {rollout_kv_tokens(step)} tokens ({rollout_rows(step)} rows at once"
        + (
            f", --inference-max-tokens {step.inference_max_tokens})"
            if step.inference_max_tokens
            else ")"
        )
        + (f", prefill of {prefill} tokens per forward" if prefill else ""),
        f"runtime   {len(comms)} NCCL communicators ({', '.join(c[0] for c in comms) or 'none'}), "
        f"NVLS {'on' if est.nccl_nvls else 'off'}, expandable segments "
        f"{'on' if est.expandable_segments else 'off'}",
        capacity_line(int(est.gpu_memory_gb * GiB), int(est.runtime_overhead_gb * GiB)),
        "",
    ]


def _row(label, a, b) -> str:
    diff = f"{(b - a) / GiB:+.2f}" if a != b else ""
    return f"{label:<28}{_gib(a):>20}{_gib(b):>20}{diff:>14}".rstrip()


def _term_rows(plans, est, dense, loggra) -> list[str]:
    """One row per non-zero term: the static terms, then each transient phase's, the peak."""
    step = plans["loggra"]
    d = step.data_parallel_size
    pdt = "fp32" if step.precision == "fp32" else "bf16"
    gdt = "fp32" if grad_dtype_bytes(step) == 4 else "bf16"
    suffix = {"weights": f" ({pdt})", "grads": f" ({gdt})"}
    suffix["reference_model"] = f" ({pdt})"
    suffix["optimizer_state"] = " (/DP)" if d > 1 else ""
    suffix["master_params"] = " (/DP)" if d > 1 else ""
    masters = {bytes_per_master(plans[k], est) for k in ("adam", "loggra")}
    kind = {4: " (fp32)", 2: " (16-bit rem.)"}.get(masters.pop()) if len(masters) == 1 else None
    suffix["master_params"] += kind or " (fp32 | rem.)"
    lines = []
    dt, lt = dense.terms(), loggra.terms()
    for key in MemoryBreakdown.STATIC:
        if dt[key] or lt[key]:
            lines.append(_row(LABELS[key] + suffix.get(key, ""), dt[key], lt[key]))
    lines.append(_row("  static", dense.static_bytes, loggra.static_bytes))
    dp_, lp_ = dense.phases(), loggra.phases()
    for phase, keys in MemoryBreakdown.PHASES.items():
        for key in keys:
            if dt[key] or lt[key]:
                lines.append(_row(LABELS[key], dt[key], lt[key]))
        if len(keys) > 1 and (dp_[phase] or lp_[phase]):
            lines.append(_row(f"  {phase}", dp_[phase], lp_[phase]))
    lines.append(f"{'peak phase':<28}{dense.peak_phase:>20}{loggra.peak_phase:>20}")
    return lines


def _verdicts(model, plans, results, est, selected, shown) -> list[str]:
    """Whether each fits ``--gpu-memory-gb``, the largest rollout each allows, and the
    selected optimizer's own summary if it is neither of the ``shown`` ones."""
    dense, loggra = results["adam"], results["loggra"]
    gpu_bytes = int(est.gpu_memory_gb * GiB)

    def verdict(b: MemoryBreakdown) -> str:
        left = (gpu_bytes - b.total_bytes) / GiB
        return f"yes ({left:.2f} free)" if left >= 0 else f"NO (over by {-left:.2f})"

    gb = gpu_bytes / GiB
    lines = [f"{f'fits {gb:g} GiB':<28}{verdict(dense):>20}{verdict(loggra):>20}"]
    if plans["loggra"].generation_ranks:  # these GPUs do not generate
        return lines + _selected_line(results, selected, shown, verdict)
    cap = {k: max_rollout_batch_size(model, plans[k], est, gpu_bytes) for k in shown}
    cap_s = {k: "none" if v is None else str(v) for k, v in cap.items()}
    lines.append(f"{'max rollout rows at once':<28}{cap_s['adam']:>20}{cap_s['loggra']:>20}")
    seq = plans["loggra"].seq_length
    budget = {k: "none" if v is None else str(v * seq) for k, v in cap.items()}
    lines.append(f"{'  = KV budget (tokens)':<28}{budget['adam']:>20}{budget['loggra']:>20}")
    return lines + _selected_line(results, selected, shown, verdict)


def _selected_line(results, selected, shown, verdict) -> list[str]:
    """The selected optimizer's own summary if it is neither of the ``shown`` ones."""
    if selected in shown:
        return []
    own = results[selected]
    return [
        f"{selected}*: optimizer state {_gib(own.optimizer_state)}, masters "
        f"{_gib(own.master_params)}, TOTAL per GPU {_gib(own.total_bytes)}: {verdict(own)}"
    ]


def _recompute(step: StepPlan) -> str:
    if step.recompute_granularity != "full":
        return step.recompute_granularity
    return f"full ({step.recompute_method}, {step.recompute_num_layers} layers)"

# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The table ``tools/estimate_memory.py`` prints: dense Adam and LoGRA side by side, every
term, each phase's total, the verdict and the largest rollout that fits."""

from __future__ import annotations

from loggra_megatron.memory.model import (
    GiB,
    MemoryBreakdown,
    RLStepConfig,
    bytes_per_master,
    max_rollout_batch_size,
    num_parameters,
    prefill_tokens,
)
from loggra_megatron.memory.runtime import communicators

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
    "activations": "training: activations",
    "sketch_projections": "training: sketch P = XB^T",
    "logits": "training: logits",
    "kl_probe_activations": "kl control: activations",
    "kl_probe_logits": "kl control: probe logits",
    "kl_weight_backup": "kl control: weight backup",
    "main_grad_copies": "optimizer: fp32 grad copies",
    "sketch_step": "optimizer: sketch step",
}


def _gib(x: int) -> str:
    return f"{x / GiB:.2f}"


def report(model, parallel, steps, results, gpu_bytes, source, selected) -> str:
    """The table for ``results`` (``{"adam": MemoryBreakdown, "loggra": ...}``, and the
    ``selected`` optimizer's, summed up under the table, if it is another one)."""
    dense, loggra = results["adam"], results["loggra"]
    mark = {k: "*" if selected == k else " " for k in ("adam", "loggra")}
    header = f"{'GiB per GPU':<28}{'dense Adam' + mark['adam']:>20}"
    header += f"{_loggra_label(steps['loggra']) + mark['loggra']:>20}{'LoGRA - Adam':>14}"
    lines = _describe(model, parallel, steps["loggra"], dense, source)
    lines += [header, "-" * len(header)]
    lines += _term_rows(parallel, steps, dense, loggra)
    lines.append("-" * len(header))
    saved = 100.0 * (dense.total_bytes - loggra.total_bytes) / dense.total_bytes
    lines.append(
        _row("TOTAL per GPU", dense.total_bytes, loggra.total_bytes) + f"  ({saved:.1f}% saved)"
    )
    lines += _verdicts(model, parallel, steps, results, gpu_bytes, selected, list(mark))
    return "\n".join(lines)


def _loggra_label(step: RLStepConfig) -> str:
    """``LoGRA r=128``, or ``LoGRA bwd r=128`` with ``--loggra-sketch backward``."""
    mode = " bwd" if step.loggra_sketch == "backward" else ""
    return f"LoGRA{mode} r={step.loggra_rank}"


def _describe(model, parallel, step, dense, source) -> list[str]:
    """The lines above the table: model, parallel layout, step, rollout and runtime."""
    t, p, d = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.data_parallel_size,
    )
    prefill = prefill_tokens(step, t)
    comms = communicators(parallel, step.distributed_optimizer)
    return [
        f"model     {source}: {num_parameters(model) / 1e9:.2f} B params, {model.num_layers} "
        f"layers, hidden {model.hidden_size}, ffn {model.ffn_hidden_size}"
        f"{' (SwiGLU)' if model.swiglu else ''}, {model.num_attention_heads} heads / "
        f"{model.num_query_groups} KV groups x {model.kv_channels}, vocab {model.vocab_size} "
        f"(padded {model.padded_vocab_size(t)}), "
        f"{'untied' if model.untie_embeddings_and_output_weights else 'tied'} embeddings",
        f"parallel  TP {t} x PP {p} x DP {d} = {parallel.world_size} GPUs"
        f"{', sequence parallel' if parallel.sequence_parallel else ''}; distributed optimizer "
        f"(ZeRO-1); stage {dense.stage} of {p} is the most loaded "
        f"({dense.num_parameters / 1e9:.3f} B params/GPU)",
        f"step      {step.precision}, {'fp32' if step.grad_bytes == 4 else 'bf16'} grads, micro-batch "
        f"{step.micro_batch_size} x {step.seq_length} tokens, recompute {_recompute(step)}, "
        f"reference model {'on' if step.reference_model else 'off'}"
        + (f" (log-prob micro-batch {step.log_prob_rows})" if step.reference_model else "")
        + (
            f", KL trials on {step.kl_probe_sequences} seqs (probe + held-out, {step.kl_estimator})"
            if step.kl_probe_sequences
            else ""
        )
        + (
            f", LoGRA's backward sketch of {','.join(step.loggra_targets)} "
            f"(row {step.loggra_row_optimizer})"
            if step.loggra_sketch == "backward"
            else ""
        ),
        f"rollout   {step.rollout_batch_size} seqs per replica, {step.rollout_engine} engine, "
        f"KV cache of {step.rollout_kv_tokens} tokens ({step.rollout_rows} rows at once"
        + (
            f", --inference-max-tokens {step.inference_max_tokens})"
            if step.inference_max_tokens
            else ")"
        )
        + (f", prefill of {prefill} tokens per forward" if prefill else ""),
        f"runtime   {len(comms)} NCCL communicators ({', '.join(c[0] for c in comms) or 'none'}), "
        f"NVLS {'on' if step.nccl_nvls else 'off'}, expandable segments "
        f"{'on' if step.expandable_segments else 'off'}",
        "",
    ]


def _row(label, a, b) -> str:
    diff = f"{(b - a) / GiB:+.2f}" if a != b else ""
    return f"{label:<28}{_gib(a):>20}{_gib(b):>20}{diff:>14}".rstrip()


def _term_rows(parallel, steps, dense, loggra) -> list[str]:
    """One row per non-zero term: the static terms, then each transient phase's, the peak."""
    step, d = steps["loggra"], parallel.data_parallel_size
    pdt = "fp32" if step.precision == "fp32" else "bf16"
    gdt = "fp32" if step.grad_bytes == 4 else "bf16"
    suffix = {"weights": f" ({pdt})", "grads": f" ({gdt})"}
    suffix["reference_model"] = f" ({pdt})"
    suffix["optimizer_state"] = " (/DP)" if d > 1 else ""
    suffix["master_params"] = " (/DP)" if d > 1 else ""
    masters = {bytes_per_master(steps[k]) for k in ("adam", "loggra")}
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


def _verdicts(model, parallel, steps, results, gpu_bytes, selected, shown) -> list[str]:
    """Whether each fits ``gpu_bytes``, the largest rollout each allows, and the selected
    optimizer's own summary if it is neither of the ``shown`` ones."""
    dense, loggra = results["adam"], results["loggra"]

    def verdict(b: MemoryBreakdown) -> str:
        left = (gpu_bytes - b.total_bytes) / GiB
        return f"yes ({left:.2f} free)" if left >= 0 else f"NO (over by {-left:.2f})"

    gb = gpu_bytes / GiB
    lines = [f"{f'fits {gb:g} GiB':<28}{verdict(dense):>20}{verdict(loggra):>20}"]
    cap = {k: max_rollout_batch_size(model, parallel, steps[k], gpu_bytes) for k in shown}
    cap_s = {k: "none" if v is None else str(v) for k, v in cap.items()}
    lines.append(f"{'max rollout rows at once':<28}{cap_s['adam']:>20}{cap_s['loggra']:>20}")
    seq = steps["loggra"].seq_length
    budget = {k: "none" if v is None else str(v * seq) for k, v in cap.items()}
    lines.append(f"{'  = KV budget (tokens)':<28}{budget['adam']:>20}{budget['loggra']:>20}")
    if selected not in shown:
        own = results[selected]
        lines.append(
            f"{selected}*: optimizer state {_gib(own.optimizer_state)}, masters "
            f"{_gib(own.master_params)}, TOTAL per GPU {_gib(own.total_bytes)}, fits "
            f"{gb:g} GiB: {verdict(own)}"
        )
    return lines


def _recompute(step: RLStepConfig) -> str:
    if step.recompute_granularity != "full":
        return step.recompute_granularity
    return f"full ({step.recompute_method}, {step.recompute_num_layers} layers)"

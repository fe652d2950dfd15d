# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The per-GPU estimate of ``memory.model`` as terms and phases
(``MemoryBreakdown``): the static terms are held through the whole step; the transient
ones belong to one phase each, and the phases never overlap, so the peak is the static terms
plus the largest phase (pure Python, no torch).

The phases, in the order an RL step runs them: the rollout (KV-cached generation), the
dynamic engine's recompute of the old log-probs, the reference's log-probs, training (one
micro-batch's forward and backward), predicted-KL control (the trial forwards), the
optimizer step, and the checkpoint save between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryBreakdown"]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per term on one GPU (the stage ``stage``); ``docs/memory.md`` ("Formulas")."""

    stage: int
    num_parameters: int
    """Policy parameters on this GPU."""
    weights: int
    fp8_weight_cache: int
    grads: int
    master_params: int
    optimizer_state: int
    runtime_overhead: int
    kv_cache: int
    rollout_logits: int
    activations: int
    logits: int
    kl_probe_logits: int = 0
    reference_model: int = 0
    main_grad_copies: int = 0
    reference_fp8_weight_cache: int = 0
    prefill_activations: int = 0
    log_prob_activations: int = 0
    log_prob_logits: int = 0
    reference_streamed: int = 0
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
    adam_temporaries: int = 0
    checkpoint_save: int = 0
    sync_state: int = 0
    """A generation GPU's copy of the trainer's sketched weights and masters
    (``--weight-sync lowrank``)."""

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
        "sync_state",
    )
    ROLLOUT = ("kv_cache", "rollout_logits", "prefill_activations", "allocator_fragmentation")
    OLD_LOG_PROBS = ("old_log_prob_activations", "old_log_prob_logits")
    LOG_PROBS = ("log_prob_activations", "log_prob_logits", "reference_streamed")
    TRAINING = ("activations", "sketch_projections", "logits")
    KL_CONTROL = ("kl_probe_activations", "kl_probe_logits", "kl_weight_backup")
    OPTIMIZER_STEP = ("main_grad_copies", "adam_temporaries", "sketch_step")
    CHECKPOINT_SAVE = ("checkpoint_save",)
    TRANSIENT = (
        *ROLLOUT,
        *OLD_LOG_PROBS,
        *LOG_PROBS,
        *TRAINING,
        *KL_CONTROL,
        *OPTIMIZER_STEP,
        *CHECKPOINT_SAVE,
    )
    PHASES = {
        "rollout": ROLLOUT,
        "old log-probs": OLD_LOG_PROBS,
        "ref log-probs": LOG_PROBS,
        "training": TRAINING,
        "kl control": KL_CONTROL,
        "optimizer step": OPTIMIZER_STEP,
        "checkpoint save": CHECKPOINT_SAVE,
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

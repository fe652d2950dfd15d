# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The configuration of :mod:`loggra_megatron.memory.model`: model shape, parallel sizes and
the RL step, as validated frozen dataclasses (pure Python, no torch).

Every invalid value raises :class:`MemoryConfigError`, which names the offending field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from loggra_megatron.optim.registry import OPTIMIZERS, SKETCH_MODES, SKETCH_TARGETS
from loggra_megatron.rollout.registry import ROLLOUT_ENGINES

GiB = 1024**3
PRECISIONS = ("fp32", "bf16", "fp8")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
ROW_STATE_BYTES = {"adam": 4, "sgd": 0}
"""State bytes per owned row of a backward-sketched weight, by ``--loggra-row-optimizer``
(``optim.row_adam.ROW_OPTIMIZERS``): RowAdam's fp32 ``exp_avg_sq``; row SGD keeps none."""


class MemoryConfigError(ValueError):
    """An invalid configuration value; ``field`` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _positive(obj: Any, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
            raise MemoryConfigError(
                name, f"must be a {'non-negative' if allow_zero else 'positive'} int, got {v!r}"
            )


def _choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    if getattr(obj, name) not in choices:
        raise MemoryConfigError(name, f"{getattr(obj, name)!r} is not one of {choices}")


# ---------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class TransformerShape:
    """The shapes of a Llama-style Megatron-Core GPT model (Megatron's names and defaults)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    """Width of each of gate and up with SwiGLU (HF ``intermediate_size``)."""
    num_attention_heads: int
    vocab_size: int
    """True vocabulary; Megatron pads it (``make_vocab_size_divisible_by·t``)."""
    num_query_groups: int | None = None
    """KV heads (GQA); None: = num_attention_heads."""
    kv_channels: int | None = None
    """Head dim; None: hidden_size / num_attention_heads."""
    untie_embeddings_and_output_weights: bool = False
    swiglu: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        _positive(self, "vocab_size", "make_vocab_size_divisible_by")
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        _positive(self, "num_query_groups")
        if self.num_attention_heads % self.num_query_groups:
            raise MemoryConfigError(
                "num_query_groups",
                f"{self.num_query_groups} does not divide num_attention_heads "
                f"({self.num_attention_heads})",
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise MemoryConfigError(
                    "num_attention_heads",
                    f"{self.num_attention_heads} does not divide hidden_size "
                    f"({self.hidden_size}); give kv_channels",
                )
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        _positive(self, "kv_channels")

    @classmethod
    def from_model_args(cls, args: Any) -> TransformerShape:
        """From a :class:`loggra_megatron.model.GPTModelArgs` (or anything with its fields)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron's embedding rows at TP size ``tp`` (same rule as ``model.pad_vocab_size``)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return ceil_div(self.vocab_size, multiple) * multiple


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallel sizes; world size = TP · PP · DP."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    sequence_parallel: bool = False
    gpus_per_node: int = 8
    """GPUs of one node (which communicators stay inside it: NCCL's NVLS buffers)."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "data_parallel_size",
            "gpus_per_node",
        )

    @property
    def world_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.data_parallel_size
        )

    def check(self, model: TransformerShape) -> None:
        """Raise :class:`MemoryConfigError` if Megatron would refuse ``model`` at these sizes."""
        t, p = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            if getattr(model, name) % t:
                raise MemoryConfigError(
                    "tensor_model_parallel_size",
                    f"{t} does not divide {name} ({getattr(model, name)})",
                )
        if model.num_layers % p:
            raise MemoryConfigError(
                "pipeline_model_parallel_size",
                f"{p} does not divide num_layers ({model.num_layers})",
            )


@dataclass(frozen=True)
class RLStepConfig:
    """One RL step: rollout with the policy, then a training step on micro-batches."""

    micro_batch_size: int = 1
    seq_length: int = 4096
    """Prompt + response tokens per sequence."""
    precision: str = "bf16"
    """``bf16``, ``fp8`` (TE on Hopper, bf16 params) or ``fp32``."""
    main_grads_dtype: str = "fp32"
    """Grad-buffer dtype for bf16/fp8 (Megatron-LM's default fp32 accumulate/reduce)."""
    optimizer: str = "loggra"
    loggra_rank: int = 128
    loggra_min_dim: int = 64
    loggra_sketch: str = "gradient"
    """``--loggra-sketch``: ``gradient`` (LoGRA's sketches of the dense gradient) or
    ``backward`` (LoGRA as published: the targets are frozen, no grad buffer, the sketch is
    formed in the backward pass; :mod:`~loggra_megatron.memory.backward_sketch`). Read for
    a sketching ``optimizer`` only."""
    loggra_targets: tuple[str, ...] = SKETCH_TARGETS
    """``--loggra-targets`` of the backward sketch."""
    loggra_row_optimizer: str = "adam"
    """``--loggra-row-optimizer`` of the backward sketch: ``adam`` (RowAdam, one fp32 second
    moment per row) or ``sgd`` (no state)."""
    exp_avg_dtype: str = "fp32"
    """Dense Adam's first moment (bf16: Megatron's precision-aware optimizer). LoGRA: fp32."""
    exp_avg_sq_dtype: str = "fp32"
    loggra_fp32_grad_copy: bool = False
    """With 16-bit grads: Megatron copies every grad shard to fp32 for LoGRA too
    (``--loggra-fp32-grad-copy``) instead of LoGRA converting one weight at a time."""
    loggra_param_remainders: bool = False
    """LoGRA keeps each 16-bit weight's fp32 master as the weight + an int16 remainder
    (``--loggra-param-remainders``): 2 instead of 4 bytes per master element. Dense Adam
    gets the same from Megatron's precision-aware optimizer (bf16 moments, whose
    ``store_param_remainders`` is on by default)."""
    distributed_optimizer: bool = True
    """Megatron's ZeRO-1: master params and optimizer state split over DP."""
    reference_model: bool = True
    recompute_granularity: str = "none"
    recompute_method: str = "uniform"
    """Full recompute: ``uniform`` (checkpoint every ``recompute_num_layers`` layers) or
    ``block`` (recompute the first ``recompute_num_layers`` layers of each stage)."""
    recompute_num_layers: int = 1
    rollout_batch_size: int = 0
    """Sequences generated per model replica and RL step (KV cache); 0: rollouts elsewhere."""
    inference_max_tokens: int | None = None
    """``--inference-max-tokens``: bound on the rollout KV cache in tokens (None: the whole
    rollout batch at once)."""
    rollout_engine: str = "static"
    """An entry of ``rollout.registry.ROLLOUT_ENGINES``: ``static`` (chunks of whole rows) or
    ``dynamic`` (a paged buffer of ``inference_max_tokens`` tokens)."""
    max_new_tokens: int | None = None
    """Response tokens; prompts are then at most ``seq_length − max_new_tokens`` and the
    rollout's prefill is counted (None: prefill not counted)."""
    log_prob_micro_batch_size: int | None = None
    """Sequences per forward-only micro-batch (reference log-probs); None: micro_batch_size."""
    num_microbatches: int | None = None
    """Micro-batches per step; None: at least the PP size (1F1B steady state)."""
    kl_probe_sequences: int = 0
    """Sequences of each predicted-KL trial forward per model replica and step: the probe
    and, when ``kl/realized`` is measured, the held-out set (0: control off)."""
    kl_estimator: str = "full"
    runtime_overhead_bytes: int = 2 * GiB
    """CUDA/cuBLAS/Transformer Engine workspaces and the like (NCCL is counted apart)."""
    nccl_nvls: bool = True
    """NCCL's NVLink SHARP buffers (its default on NVSwitch Hopper nodes; off with
    ``NCCL_NVLS_ENABLE=0``)."""
    expandable_segments: bool = False
    """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (PyTorch's default: off)."""

    def __post_init__(self) -> None:
        _positive(self, "micro_batch_size", "seq_length", "loggra_rank", "loggra_min_dim")
        _positive(self, "rollout_batch_size", "runtime_overhead_bytes", allow_zero=True)
        _positive(self, "kl_probe_sequences", allow_zero=True)
        _positive(self, "recompute_num_layers")
        _choice(self, "kl_estimator", ("full", "k1", "k2", "k3"))
        for name in ("num_microbatches", "inference_max_tokens", "log_prob_micro_batch_size"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.max_new_tokens is not None:
            _positive(self, "max_new_tokens")
            if self.max_new_tokens >= self.seq_length:
                raise MemoryConfigError(
                    "max_new_tokens",
                    f"{self.max_new_tokens} must be below seq_length {self.seq_length} "
                    "(prompt + response)",
                )
        _choice(self, "precision", PRECISIONS)
        _choice(self, "optimizer", OPTIMIZERS)
        _choice(self, "recompute_granularity", RECOMPUTE)
        _choice(self, "recompute_method", RECOMPUTE_METHODS)
        _choice(self, "rollout_engine", tuple(ROLLOUT_ENGINES))
        for name in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            _choice(self, name, tuple(DTYPE_BYTES))
        _choice(self, "loggra_sketch", SKETCH_MODES)
        _choice(self, "loggra_row_optimizer", tuple(ROW_STATE_BYTES))
        targets = self.loggra_targets
        if (
            not isinstance(targets, tuple)
            or not targets
            or len(set(targets)) != len(targets)
            or not set(targets) <= set(SKETCH_TARGETS)
        ):
            raise MemoryConfigError(
                "loggra_targets",
                f"{targets!r} must be a tuple of distinct names from {SKETCH_TARGETS}",
            )

    @property
    def log_prob_rows(self) -> int:
        """Sequences per forward-only micro-batch."""
        return self.log_prob_micro_batch_size or self.micro_batch_size

    @property
    def rollout_kv_tokens(self) -> int:
        """Tokens the rollout KV cache holds at once: ``B·s`` for ``B`` rollout rows of full
        length ``s``, or the engine's under ``M = inference_max_tokens`` (the static engine:
        ``min(B·s, max(M, s))``; the dynamic engine's paged buffer: ``max(M, s)`` tokens
        whatever the batch)."""
        if not self.rollout_batch_size:
            return 0
        return ROLLOUT_ENGINES[self.rollout_engine].kv_cache_tokens(self)

    @property
    def rollout_rows(self) -> int:
        """Sequences decoded at once: a chunk of the rollout batch under a KV budget (static
        engine), or the dynamic engine's requests in flight (one per KV block at most)."""
        if not self.rollout_batch_size:
            return 0
        return ROLLOUT_ENGINES[self.rollout_engine].decode_rows(self)

    @property
    def prompt_tokens(self) -> int | None:
        """Longest prompt, ``seq_length − max_new_tokens`` (None without max_new_tokens)."""
        return None if self.max_new_tokens is None else self.seq_length - self.max_new_tokens

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        return 4 if self.precision == "fp32" else DTYPE_BYTES[self.main_grads_dtype]

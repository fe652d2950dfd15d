# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""What ``memory.model`` models besides the run's
``StepPlan``: the model's shape
(``TransformerShape``, Megatron-Core's names, from the run's ``GPTModelArgs``), whether
the plan's layout splits it (``check_layout``), and the bytes of the plan's dtypes (pure
Python, no torch).

Every invalid value raises ``MemoryConfigError``, which names the offending field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from loggra_megatron.train.step_plan import StepPlan

GiB = 1024**3
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


class MemoryConfigError(ValueError):
    """An invalid configuration value; ``field`` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MemoryConfigError(name, f"must be a positive int, got {v!r}")


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
        """From a ``loggra_megatron.model.GPTModelArgs`` (or anything with its fields)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron's embedding rows at TP size ``tp`` (same rule as ``model.pad_vocab_size``)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return ceil_div(self.vocab_size, multiple) * multiple


def check_layout(model: TransformerShape, plan: StepPlan) -> None:
    """Raise ``MemoryConfigError`` if Megatron would refuse ``model`` at the plan's TP and
    PP sizes."""
    t, p = plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(model, name) % t:
            raise MemoryConfigError(
                "tensor_model_parallel_size", f"{t} does not divide {name} ({getattr(model, name)})"
            )
    if model.num_layers % p:
        raise MemoryConfigError(
            "pipeline_model_parallel_size", f"{p} does not divide num_layers ({model.num_layers})"
        )


def param_dtype_bytes(plan: StepPlan) -> int:
    """Bytes of a weight (and an activation): 4 for an fp32 model, else 2 (bf16; FP8 keeps
    bf16 weights)."""
    return 4 if plan.precision == "fp32" else 2


def grad_dtype_bytes(plan: StepPlan) -> int:
    """Bytes of a grad-buffer element: fp32 for an fp32 model, else ``main_grads_dtype``."""
    return 4 if plan.precision == "fp32" else DTYPE_BYTES[plan.main_grads_dtype]

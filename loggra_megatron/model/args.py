# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The architecture of a Llama-style decoder-only GPT model, in Megatron-Core's vocabulary.

``GPTModelArgs`` describes the model (RMSNorm, SwiGLU, RoPE, GQA, optional QKV bias
and QK-norm) and round-trips through JSON, which is how a checkpoint records its
architecture (``loggra_model_args.json``). Hugging Face configs map to and from it in
``convert.hf_config``; ``model.build`` builds the
Megatron-Core model from it.

The word-embedding/output-layer rows are padded (``pad_vocab_size``). The padded rows
are loaded with ``allow_shape_mismatch`` by ``dist_checkpointing``, so a checkpoint saved
with one padding loads at a TP size that needs another.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_LAYERS = 4096
"""More layers than any model has: a guard against a mistyped config (the estimator's
``--fit`` searches per layer)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pad_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tp_size: int = 1
) -> int:
    """Round ``vocab_size`` up to a multiple of ``make_vocab_size_divisible_by * tp_size``.

    Same rule as Megatron-LM's ``--make-vocab-size-divisible-by``: every TP rank gets an
    equal, aligned slice of the vocabulary-parallel embedding and output layer.
    """
    if vocab_size <= 0 or make_vocab_size_divisible_by <= 0 or tp_size <= 0:
        raise ValueError(
            f"pad_vocab_size: all arguments must be positive, got vocab_size={vocab_size}, "
            f"make_vocab_size_divisible_by={make_vocab_size_divisible_by}, tp_size={tp_size}"
        )
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


@dataclass
class GPTModelArgs:
    """Architecture of a Llama-style decoder-only GPT model (Megatron-Core naming)."""

    num_layers: int
    """Number of transformer layers (HF ``num_hidden_layers``)."""

    hidden_size: int
    """Model width (HF ``hidden_size``)."""

    ffn_hidden_size: int
    """MLP inner width; with SwiGLU this is the width of *each* of gate and up
    (HF ``intermediate_size``)."""

    num_attention_heads: int
    """Number of query heads."""

    vocab_size: int
    """True vocabulary size (rows of the HF embedding). Megatron's embedding and output layer
    have ``padded_vocab_size`` rows; the padding rows are zero and are dropped on export."""

    num_query_groups: int | None = None
    """Number of key/value heads (GQA groups, HF ``num_key_value_heads``). ``None`` means
    multi-head attention (= ``num_attention_heads``)."""

    kv_channels: int | None = None
    """Per-head dimension (HF ``head_dim``). ``None`` means ``hidden_size //
    num_attention_heads``; Qwen3 uses an explicit value that may differ from it."""

    make_vocab_size_divisible_by: int = 128
    """Vocab padding granularity per TP rank, see ``pad_vocab_size``."""

    max_position_embeddings: int = 4096
    """Longest sequence the model is built for; Megatron's ``max_sequence_length``."""

    rotary_base: float = 10000.0
    """RoPE base θ (HF ``rope_theta``)."""

    rope_scaling: bool = False
    """Apply Llama 3.x RoPE frequency scaling (low/high frequency factors 1/4, original
    context 8192, as hard-coded in Megatron-Core)."""

    rope_scaling_factor: float = 8.0
    """Llama 3.x RoPE scaling factor (8 for Llama 3.1, 32 for Llama 3.2)."""

    norm_epsilon: float = 1e-5
    """Epsilon of every norm (HF ``rms_norm_eps``)."""

    normalization: str = "RMSNorm"
    """``"RMSNorm"`` (Llama/Qwen) or ``"LayerNorm"``."""

    swiglu: bool = True
    """Gated SiLU MLP: ``linear_fc1`` holds [gate; up] and computes ``silu(gate) * up``."""

    add_qkv_bias: bool = False
    """Bias on the fused QKV projection only (Qwen2/2.5)."""

    qk_layernorm: bool = False
    """Per-head norm of queries and keys before RoPE (Qwen3 ``q_norm``/``k_norm``)."""

    untie_embeddings_and_output_weights: bool = True
    """Separate output layer. ``False`` shares it with the word embeddings (HF
    ``tie_word_embeddings=True``)."""

    params_dtype: str = "float32"
    """Dtype of the parameters: ``"float32"``, ``"bfloat16"`` or ``"float16"``."""

    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""

    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before the residual add."""

    init_method_std: float = 0.02
    """Std of the normal initialisation (HF ``initializer_range``); irrelevant when weights
    are loaded from a checkpoint."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form metadata carried through JSON (e.g. the HF ``model_type`` of the source);
    never read by the model builder."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "vocab_size",
            "make_vocab_size_divisible_by",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTModelArgs.{name} must be a positive int, got {value!r}")
        if self.num_layers > MAX_LAYERS:
            raise ValueError(
                f"GPTModelArgs.num_layers must be at most {MAX_LAYERS}, got {self.num_layers}"
            )
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        groups = self.num_query_groups
        if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0:
            raise ValueError(
                f"GPTModelArgs.num_query_groups (key/value heads) must be a positive int, got "
                f"{groups!r}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a positive multiple "
                f"of num_query_groups ({self.num_query_groups})"
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set kv_channels explicitly"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.kv_channels <= 0 or self.kv_channels % 2:
            raise ValueError(
                f"kv_channels must be a positive even number (RoPE), got {self.kv_channels}"
            )
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"normalization must be 'RMSNorm' or 'LayerNorm', got {self.normalization!r}"
            )
        if self.params_dtype not in _DTYPES:
            raise ValueError(
                f"params_dtype must be one of {sorted(_DTYPES)}, got {self.params_dtype!r}"
            )
        for name in ("rotary_base", "rope_scaling_factor"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"GPTModelArgs.{name} must be a finite positive number, got {value!r}"
                )
        if not (isinstance(self.norm_epsilon, int | float) and 0 < self.norm_epsilon < 1):
            raise ValueError(
                f"GPTModelArgs.norm_epsilon must be in (0, 1), got {self.norm_epsilon!r}"
            )
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def torch_dtype(self) -> torch.dtype:
        """``params_dtype`` as a ``torch.dtype``."""
        return _DTYPES[self.params_dtype]

    @property
    def tie_embeddings(self) -> bool:
        """True if the output layer shares the word-embedding weight."""
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Embedding rows Megatron allocates at tensor-parallel size ``tp_size``."""
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp_size)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dict of all fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTModelArgs:
        """Inverse of ``to_dict``; unknown keys are an error (they mean a newer format)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"GPTModelArgs: unknown fields {unknown}")
        return cls(**d)

    def save_json(self, path: str | os.PathLike) -> None:
        """Write the arguments to ``path`` as JSON, atomically (a reader never sees half)."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load_json(cls, path: str | os.PathLike) -> GPTModelArgs:
        """Read arguments written by ``save_json``; ``ValueError`` naming the file if it
        is not such a file."""
        try:
            with open(path, "rb") as f:
                return cls.from_dict(json.loads(f.read()))
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{path} is not a readable architecture file ({type(e).__name__}: {e})"
            ) from None

# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Llama-style Megatron-Core GPT models: architecture arguments and the model builder.

:class:`GPTModelArgs` describes a decoder-only transformer in Megatron-Core's vocabulary
(RMSNorm, SwiGLU, RoPE, GQA, optional QKV bias and QK-norm). It can be read from a Hugging
Face ``config.json`` (Llama 2/3, Qwen2/2.5, Qwen3; :meth:`GPTModelArgs.from_hf_config`),
written back as one (:meth:`GPTModelArgs.to_hf_config`) and round-tripped through JSON, which
is how a converted checkpoint records its architecture.

:func:`build_gpt_model` turns the arguments into a :class:`megatron.core.models.gpt.GPTModel`
for the current pipeline stage, with Megatron-Core's local layer spec (plain PyTorch,
runs on CPU) or the Transformer Engine spec. Tensor/pipeline sizes are taken from
``megatron.core.parallel_state``, which must be initialised first.

Megatron-Core quirks handled here:

* ``GPTModel`` reads the RoPE base from its ``rotary_base`` *constructor argument*, not from
  ``TransformerConfig``; it is passed explicitly.
* Llama 3 RoPE scaling in Megatron-Core (``rope_scaling=True``) hard-codes
  ``low_freq_factor=1``, ``high_freq_factor=4`` and ``original_max_position_embeddings=8192``
  (the values of every released Llama 3.x). Other values are refused.
* The word-embedding/output-layer rows are padded (:func:`pad_vocab_size`). The padded
  rows are loaded with ``allow_shape_mismatch`` by ``dist_checkpointing``, so a checkpoint
  saved with one padding loads at a TP size that needs another.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "GPTModelArgs",
    "SUPPORTED_HF_ARCHITECTURES",
    "build_gpt_model",
    "pad_vocab_size",
    "transformer_config_from_args",
    "wrap_ddp",
]

#: Hugging Face ``architectures`` entries accepted by :meth:`GPTModelArgs.from_hf_config`,
#: keyed by their ``model_type``.
SUPPORTED_HF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Class defaults of the transformers config classes, for fields a config.json may omit.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0},
    "qwen3": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "head_dim": 128,
    },
}

# Megatron-Core's RotaryEmbedding._apply_scaling constants (Llama 3.x).
_MCORE_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

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
    have :meth:`padded_vocab_size` rows; the padding rows are zero and are dropped on export."""

    num_query_groups: int | None = None
    """Number of key/value heads (GQA groups, HF ``num_key_value_heads``). ``None`` means
    multi-head attention (= ``num_attention_heads``)."""

    kv_channels: int | None = None
    """Per-head dimension (HF ``head_dim``). ``None`` means ``hidden_size //
    num_attention_heads``; Qwen3 uses an explicit value that may differ from it."""

    make_vocab_size_divisible_by: int = 128
    """Vocab padding granularity per TP rank, see :func:`pad_vocab_size`."""

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
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups <= 0 or self.num_attention_heads % self.num_query_groups:
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
        if self.rotary_base <= 0 or self.norm_epsilon <= 0 or self.rope_scaling_factor <= 0:
            raise ValueError("rotary_base, norm_epsilon and rope_scaling_factor must be positive")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def torch_dtype(self) -> torch.dtype:
        """``params_dtype`` as a :class:`torch.dtype`."""
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
        """Inverse of :meth:`to_dict`; unknown keys are an error (they mean a newer format)."""
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
        """Read arguments written by :meth:`save_json`."""
        with open(path) as f:
            return cls.from_dict(json.load(f))

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> GPTModelArgs:
        """Build arguments from a Hugging Face config (dict, ``config.json`` path or a
        ``PretrainedConfig``) of Llama 2/3, Qwen2/2.5 or Qwen3.

        Anything the converted Megatron model would compute differently is refused with a
        ``ValueError`` naming the field: other architectures, non-SiLU activations,
        o_proj/MLP biases, sliding-window attention, partial rotary, and RoPE scaling other
        than Llama 3's with Megatron-Core's constants. Transformers 4.x (``rope_theta``,
        ``rope_scaling``) and 5.x (``rope_parameters``) layouts are both read.
        ``overrides`` replace fields of the result (e.g. ``params_dtype``).
        """
        cfg = _as_dict(config)
        model_type = _check_architecture(cfg)
        d = {**_HF_DEFAULTS[model_type], **cfg}

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"HF config ({model_type}): required field {key!r} is missing")
            return d[key]

        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"HF config: hidden_act={d['hidden_act']!r} is not supported (only 'silu')"
            )
        if d.get("mlp_bias"):
            raise ValueError(
                "HF config: mlp_bias=True is not supported (Megatron Llama MLP has no bias)"
            )
        if d.get("attention_bias"):
            raise ValueError(
                f"HF config ({model_type}): attention_bias=True (bias on q/k/v *and* o_proj) "
                "is not supported; only Qwen2's QKV-only bias is"
            )
        layer_types = d.get("layer_types") or []
        if d.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise ValueError(f"HF config ({model_type}): sliding-window attention is not supported")
        if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("HF config: partial_rotary_factor != 1 is not supported")

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        rope = _parse_rope(d, model_type)
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        args = dict(
            num_layers=need("num_hidden_layers"),
            hidden_size=hidden,
            ffn_hidden_size=need("intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=d.get("num_key_value_heads") or heads,
            kv_channels=d.get("head_dim") or hidden // heads,
            vocab_size=need("vocab_size"),
            max_position_embeddings=need("max_position_embeddings"),
            norm_epsilon=float(need("rms_norm_eps")),
            normalization="RMSNorm",
            swiglu=True,
            add_qkv_bias=model_type == "qwen2",
            qk_layernorm=model_type == "qwen3",
            untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False),
            params_dtype=str(dtype).replace("torch.", ""),
            attention_dropout=float(d.get("attention_dropout", 0.0)),
            hidden_dropout=0.0,
            init_method_std=float(d.get("initializer_range", 0.02)),
            extra={"hf_model_type": model_type},
            **rope,
        )
        args.update(overrides)
        return cls(**args)

    def to_hf_config(self, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """Hugging Face ``config.json`` dict for these arguments.

        The family is Qwen3 if ``qk_layernorm``, Qwen2 if ``add_qkv_bias``, else Llama.
        ``base`` (e.g. the original HF config, for token ids) is updated, not replaced;
        RoPE is written in the transformers 5.x ``rope_parameters`` layout and the 4.x
        ``rope_theta``/``rope_scaling`` keys are written too.
        """
        if self.normalization != "RMSNorm" or not self.swiglu:
            raise ValueError("to_hf_config: only RMSNorm + SwiGLU models map to Llama/Qwen")
        if self.qk_layernorm and self.add_qkv_bias:
            raise ValueError("to_hf_config: QK-norm together with QKV bias matches no HF family")
        model_type = "qwen3" if self.qk_layernorm else "qwen2" if self.add_qkv_bias else "llama"
        rope_parameters: dict[str, Any] = {"rope_theta": self.rotary_base, "rope_type": "default"}
        rope_scaling = None
        if self.rope_scaling:
            rope_scaling = {
                "rope_type": "llama3",
                "factor": self.rope_scaling_factor,
                **_MCORE_LLAMA3_ROPE,
            }
            rope_parameters.update(rope_scaling)
        out = dict(base or {})
        for stale in ("auto_map", "quantization_config", "rope_scaling", "rope_theta"):
            out.pop(stale, None)
        out.update(
            architectures=[SUPPORTED_HF_ARCHITECTURES[model_type]],
            model_type=model_type,
            hidden_size=self.hidden_size,
            intermediate_size=self.ffn_hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_query_groups,
            head_dim=self.kv_channels,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.norm_epsilon,
            hidden_act="silu",
            tie_word_embeddings=self.tie_embeddings,
            attention_dropout=self.attention_dropout,
            initializer_range=self.init_method_std,
            rope_parameters=rope_parameters,
            rope_theta=self.rotary_base,
            rope_scaling=rope_scaling,
            dtype=self.params_dtype,
            torch_dtype=self.params_dtype,
        )
        if model_type in ("llama", "qwen3"):
            out.update(attention_bias=False)
        if model_type == "llama":
            out.update(mlp_bias=False)
        else:
            out.update(use_sliding_window=False, sliding_window=None)
            out.setdefault("max_window_layers", self.num_layers)
            out["layer_types"] = ["full_attention"] * self.num_layers
        return out


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{config} has no config.json: not a Hugging Face model")
        with open(path) as f:
            return json.load(f)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(
        f"expected a dict, a config.json path or a PretrainedConfig, got {type(config)}"
    )


def _check_architecture(cfg: dict[str, Any]) -> str:
    """Return the supported ``model_type`` of ``cfg`` or raise a ValueError."""
    archs = list(cfg.get("architectures") or [])
    model_type = cfg.get("model_type")
    supported = ", ".join(f"{a} (model_type={t!r})" for t, a in SUPPORTED_HF_ARCHITECTURES.items())
    if model_type is None and len(archs) == 1:
        inverse = {a: t for t, a in SUPPORTED_HF_ARCHITECTURES.items()}
        model_type = inverse.get(archs[0])
    if model_type not in SUPPORTED_HF_ARCHITECTURES:
        raise ValueError(
            f"unsupported Hugging Face model: model_type={cfg.get('model_type')!r}, "
            f"architectures={archs}; supported: {supported}"
        )
    expected = SUPPORTED_HF_ARCHITECTURES[model_type]
    bad = [a for a in archs if a != expected]
    if bad:
        raise ValueError(
            f"unsupported Hugging Face architecture {bad} for model_type={model_type!r}; "
            f"only {expected} (causal-LM head) is supported"
        )
    return model_type


def _parse_rope(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """RoPE fields of GPTModelArgs from a transformers 4.x or 5.x config dict."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", _HF_DEFAULTS[model_type]["rope_theta"]))
    rope_type = (
        params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    )
    if rope_type == "default":
        return {"rotary_base": float(theta), "rope_scaling": False}
    if rope_type != "llama3":
        raise ValueError(
            f"HF config: RoPE scaling type {rope_type!r} is not supported (only 'default' and "
            "Llama 3's 'llama3')"
        )
    src = {**scaling, **params}
    for key, want in _MCORE_LLAMA3_ROPE.items():
        if float(src.get(key, want)) != float(want):
            raise ValueError(
                f"HF config: llama3 RoPE scaling with {key}={src[key]} is not supported; "
                f"Megatron-Core hard-codes {key}={want}"
            )
    if "factor" not in src:
        raise ValueError("HF config: llama3 RoPE scaling without 'factor'")
    return {
        "rotary_base": float(theta),
        "rope_scaling": True,
        "rope_scaling_factor": float(src["factor"]),
    }


# ---------------------------------------------------------------------- Megatron-Core
def transformer_config_from_args(args: GPTModelArgs, **overrides: Any):
    """Megatron-Core :class:`TransformerConfig` for ``args`` at the current TP/PP sizes.

    Fusions that need CUDA/Apex kernels are off (``bias_activation_fusion``,
    ``masked_softmax_fusion``, ``persist_layer_norm``, ``gradient_accumulation_fusion``,
    ``apply_rope_fusion``, ``bias_dropout_fusion``); ``overrides`` (any TransformerConfig
    field, e.g. ``sequence_parallel=True``, ``use_cpu_initialization=True``) win.
    """
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=False,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        rotary_interleaved=False,  # HF rotate_half convention
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        params_dtype=args.torch_dtype,
        pipeline_dtype=args.torch_dtype,
        bf16=args.params_dtype == "bfloat16",
        fp16=args.params_dtype == "float16",
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    args: GPTModelArgs,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    use_te: bool = False,
    *,
    parallel_output: bool = True,
    vp_stage: int | None = None,
    **config_overrides: Any,
):
    """Build the Megatron-Core ``GPTModel`` chunk of ``args`` for this pipeline stage.

    Args:
        args: model architecture.
        pre_process: this chunk owns the word embeddings; default: first PP stage.
        post_process: this chunk owns the final norm and output layer; default: last stage.
        use_te: use the Transformer Engine layer spec (TE is imported only then);
            otherwise Megatron-Core's local spec (pure PyTorch, CPU-capable).
        parallel_output: keep logits split over the vocabulary across TP ranks.
        vp_stage: virtual pipeline stage of this chunk, if interleaving.
        config_overrides: forwarded to :func:`transformer_config_from_args`.

    The parameters are created where Megatron-Core creates them (CPU with
    ``use_cpu_initialization=True``, else the current CUDA device). The padded vocabulary is
    ``args.padded_vocab_size(tp)``. With the local spec the norm weights are always fp32
    (``torch.nn.RMSNorm`` ignores ``params_dtype``); for bf16/fp16 wrap the model in Megatron's
    ``Float16Module`` or call ``.to(args.torch_dtype)``, as the converters do.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(
            ignore_virtual=vp_stage is None, vp_stage=vp_stage
        )
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(
            ignore_virtual=vp_stage is None, vp_stage=vp_stage
        )
    config = transformer_config_from_args(args, **config_overrides)
    if use_te:
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "build_gpt_model(use_te=True) needs transformer_engine installed"
            ) from e
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        layer_spec = get_gpt_layer_local_spec(
            qk_layernorm=args.qk_layernorm, normalization=args.normalization
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size(tp),
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=args.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=args.rotary_base,
        rope_scaling=args.rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        vp_stage=vp_stage,
    )


def wrap_ddp(model, use_distributed_optimizer: bool = True, **ddp_overrides: Any):
    """Wrap ``model`` in Megatron's ``DistributedDataParallel`` and hook it into its config
    (``finalize_model_grads_func``, ``no_sync_func``) as Megatron's training loop does."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    fields = dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    fields.update(ddp_overrides)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(**fields), model)
    ddp.config.finalize_model_grads_func = finalize_model_grads
    ddp.config.no_sync_func = ddp.no_sync
    return ddp

# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Hugging Face ``config.json`` ↔ ``GPTModelArgs``.

``gpt_args_from_hf`` reads Llama 2/3, Qwen2/2.5 and Qwen3 configs (transformers 4.x
and 5.x layouts) and refuses, naming the field, anything the converted Megatron model would
compute differently; ``hf_config_from_gpt_args`` writes one back.

Megatron-Core's Llama 3 RoPE scaling (``rope_scaling=True``) hard-codes
``low_freq_factor=1``, ``high_freq_factor=4`` and ``original_max_position_embeddings=8192``
(the values of every released Llama 3.x); other values are refused.
"""

from __future__ import annotations

import json
import os
from typing import Any

from loggra_megatron.model.args import GPTModelArgs

__all__ = ["SUPPORTED_HF_ARCHITECTURES", "gpt_args_from_hf", "hf_config_from_gpt_args"]

#: Hugging Face ``architectures`` entries accepted by ``GPTModelArgs.from_hf_config``,
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

_COUNT_LIMITS = {
    "hidden_size": 2**20,
    "num_attention_heads": 2**14,
    "num_key_value_heads": 2**14,
    "head_dim": 2**14,
    "num_hidden_layers": 2**14,
    "intermediate_size": 2**22,
    "vocab_size": 2**24,
    "max_position_embeddings": 2**27,
}
"""Bounds of the whole-number fields of a config: far above any released model, far below
sizes whose totals mean nothing."""

# Megatron-Core's RotaryEmbedding._apply_scaling constants (Llama 3.x).
_MCORE_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class _Fields:
    """A Hugging Face config's fields with its model type's defaults, read with refusals
    that name the field."""

    def __init__(self, d: dict, model_type: str):
        self.d, self.model_type = d, model_type

    def need(self, key: str) -> Any:
        if self.d.get(key) is None:
            raise ValueError(f"HF config ({self.model_type}): required field {key!r} is missing")
        return self.d[key]

    def count(self, key: str, default: Any = None) -> int:
        """A required (or defaulted) whole number within ``_COUNT_LIMITS``."""
        value = self.need(key) if default is None else self.d.get(key, default)
        if value is None:
            value = default
        upper = _COUNT_LIMITS[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
            raise ValueError(
                f"HF config ({self.model_type}): {key}={value!r} must be a whole number in "
                f"[1, {upper}]"
            )
        return value


def _check_supported(d: dict, model_type: str) -> None:
    """Refuse what the converted Megatron model would compute differently."""
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


def _attention_shape(f: _Fields) -> tuple[int, int, int]:
    """``(hidden_size, heads, query groups)``, checked against each other."""
    hidden, heads = f.count("hidden_size"), f.count("num_attention_heads")
    groups = f.count("num_key_value_heads", heads)
    if heads % groups:
        raise ValueError(
            f"HF config ({f.model_type}): num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={groups}"
        )
    if f.d.get("head_dim") is None and hidden % heads:
        raise ValueError(
            f"HF config ({f.model_type}): hidden_size={hidden} is not divisible by "
            f"num_attention_heads={heads} (and no head_dim is given)"
        )
    return hidden, heads, groups


def gpt_args_from_hf(config: Any, **overrides: Any) -> GPTModelArgs:
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
    _check_supported(d, model_type)
    f = _Fields(d, model_type)
    hidden, heads, groups = _attention_shape(f)
    tied = d.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ValueError(
            f"HF config ({model_type}): tie_word_embeddings={tied!r} must be true or false"
        )
    rope = _parse_rope(d, model_type)
    dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    args = dict(
        num_layers=f.count("num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=f.count("intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=f.count("head_dim", hidden // heads),
        vocab_size=f.count("vocab_size"),
        max_position_embeddings=f.count("max_position_embeddings"),
        norm_epsilon=float(f.need("rms_norm_eps")),
        normalization="RMSNorm",
        swiglu=True,
        add_qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type == "qwen3",
        untie_embeddings_and_output_weights=not tied,
        params_dtype=str(dtype).replace("torch.", ""),
        attention_dropout=float(d.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_method_std=float(d.get("initializer_range", 0.02)),
        extra={"hf_model_type": model_type},
        **rope,
    )
    args.update(overrides)
    return GPTModelArgs(**args)


def hf_config_from_gpt_args(
    args: GPTModelArgs, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Hugging Face ``config.json`` dict for these arguments.

    The family is Qwen3 if ``qk_layernorm``, Qwen2 if ``add_qkv_bias``, else Llama.
    ``base`` (e.g. the original HF config, for token ids) is updated, not replaced;
    RoPE is written in the transformers 5.x ``rope_parameters`` layout and the 4.x
    ``rope_theta``/``rope_scaling`` keys are written too.
    """
    if args.normalization != "RMSNorm" or not args.swiglu:
        raise ValueError("to_hf_config: only RMSNorm + SwiGLU models map to Llama/Qwen")
    if args.qk_layernorm and args.add_qkv_bias:
        raise ValueError("to_hf_config: QK-norm together with QKV bias matches no HF family")
    model_type = "qwen3" if args.qk_layernorm else "qwen2" if args.add_qkv_bias else "llama"
    rope_parameters: dict[str, Any] = {"rope_theta": args.rotary_base, "rope_type": "default"}
    rope_scaling = None
    if args.rope_scaling:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            **_MCORE_LLAMA3_ROPE,
        }
        rope_parameters.update(rope_scaling)
    out = dict(base or {})
    for stale in ("auto_map", "quantization_config", "rope_scaling", "rope_theta"):
        out.pop(stale, None)
    out.update(
        architectures=[SUPPORTED_HF_ARCHITECTURES[model_type]],
        model_type=model_type,
        hidden_size=args.hidden_size,
        intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups,
        head_dim=args.kv_channels,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=args.norm_epsilon,
        hidden_act="silu",
        tie_word_embeddings=args.tie_embeddings,
        attention_dropout=args.attention_dropout,
        initializer_range=args.init_method_std,
        rope_parameters=rope_parameters,
        rope_theta=args.rotary_base,
        rope_scaling=rope_scaling,
        dtype=args.params_dtype,
        torch_dtype=args.params_dtype,
    )
    if model_type in ("llama", "qwen3"):
        out.update(attention_bias=False)
    if model_type == "llama":
        out.update(mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
        out.setdefault("max_window_layers", args.num_layers)
        out["layer_types"] = ["full_attention"] * args.num_layers
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
            cfg = json.load(f, object_pairs_hook=_refuse_duplicate_keys(path))
        if not isinstance(cfg, dict):
            raise ValueError(
                f"{path}: a Hugging Face config.json holds a JSON object, not a "
                f"{type(cfg).__name__}"
            )
        return cfg
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(
        f"expected a dict, a config.json path or a PretrainedConfig, got {type(config)}"
    )


def _refuse_duplicate_keys(path: str):
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in items:
            if key in seen:
                raise ValueError(f"{path}: key {key!r} appears twice (which one is meant?)")
            seen[key] = value
        return seen

    return pairs


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

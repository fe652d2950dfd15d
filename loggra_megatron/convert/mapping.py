# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Name and layout mapping between Hugging Face Llama/Qwen and Megatron-Core GPT tensors.

Pure PyTorch, no process groups. A Megatron parameter is described by a
``ParamMapping``: the HF tensors it is made of and its *kind*, which fixes both the
fusion and the tensor-parallel split:

=============  =========================================  =======================================
kind           HF tensors                                 Megatron layout / TP split
=============  =========================================  =======================================
``vocab``      ``embed_tokens`` or ``lm_head``            rows padded to the padded vocab; dim 0
``qkv``        ``q_proj``, ``k_proj``, ``v_proj``          per query group ``[q_g..., k_g, v_g]``
               (weight or bias)                           interleaved; dim 0 (ColumnParallel)
``fc1``        ``gate_proj``, ``up_proj``                 rank r holds ``[gate_r; up_r]``; dim 0
``row``        ``o_proj``, ``down_proj``                  dim 1 (RowParallel)
``replicated`` norms (incl. Qwen3 ``q_norm``/``k_norm``)  identical on every TP rank
=============  =========================================  =======================================

The ``qkv`` interleaving and each kind's TP split: docs/checkpointing.md#converted-models.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from loggra_megatron.model.args import GPTModelArgs

__all__ = [
    "HF_IGNORED_SUFFIXES",
    "ParamMapping",
    "TensorSource",
    "deinterleave_qkv",
    "global_name",
    "hf_expected_shapes",
    "hf_tensors_from_megatron",
    "interleave_qkv",
    "megatron_local_from_hf",
    "param_mapping",
]

#: HF tensors that carry no weights and are skipped (old Llama checkpoints store RoPE buffers).
HF_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# Megatron (local spec) name -> TE-spec name of the same weight (layer norm fused into linear).
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ParamMapping:
    """How one Megatron parameter is assembled from HF tensors."""

    megatron_name: str
    """Name in the Megatron model's ``named_parameters()`` (stage-local layer index)."""
    hf_names: tuple[str, ...]
    """HF tensors it is made of, in fusion order."""
    kind: str
    """One of ``vocab``, ``qkv``, ``fc1``, ``row``, ``replicated`` (see module docstring)."""


def global_name(name: str, layer_offset: int) -> str:
    """The name of a pipeline stage's parameter ``name`` in the whole model: its layer index
    plus ``layer_offset`` (the stage's first layer)."""
    m = _LAYER_RE.match(name)
    if m is None or not layer_offset:
        return name
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}"


def param_mapping(name: str, args: GPTModelArgs, layer_offset: int = 0) -> ParamMapping:
    """Mapping of the Megatron parameter ``name`` (local or TE spec naming).

    ``layer_offset`` is the global index of this pipeline stage's first layer; HF names use
    global layer indices. Raises ``KeyError`` for a parameter with no HF counterpart.
    """
    if name == "embedding.word_embeddings.weight":
        return ParamMapping(name, ("model.embed_tokens.weight",), "vocab")
    if name == "output_layer.weight":
        src = "model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"
        return ParamMapping(name, (src,), "vocab")
    if name == "decoder.final_layernorm.weight":
        return ParamMapping(name, ("model.norm.weight",), "replicated")
    m = _LAYER_RE.match(name)
    if m is None:
        raise KeyError(f"Megatron parameter {name!r} has no Hugging Face counterpart")
    layer = int(m.group(1)) + layer_offset
    sub = _TE_ALIASES.get(m.group(2), m.group(2))
    p = f"model.layers.{layer}."
    attn = p + "self_attn."
    if sub in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = sub.rsplit(".", 1)[1]
        return ParamMapping(name, tuple(f"{attn}{x}_proj.{kind}" for x in "qkv"), "qkv")
    table = {
        "input_layernorm.weight": ((p + "input_layernorm.weight",), "replicated"),
        "pre_mlp_layernorm.weight": ((p + "post_attention_layernorm.weight",), "replicated"),
        "self_attention.q_layernorm.weight": ((attn + "q_norm.weight",), "replicated"),
        "self_attention.k_layernorm.weight": ((attn + "k_norm.weight",), "replicated"),
        "self_attention.linear_proj.weight": ((attn + "o_proj.weight",), "row"),
        "mlp.linear_fc1.weight": ((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1"),
        "mlp.linear_fc2.weight": ((p + "mlp.down_proj.weight",), "row"),
    }
    if sub not in table:
        raise KeyError(f"Megatron parameter {name!r} has no Hugging Face counterpart")
    hf_names, kind = table[sub]
    return ParamMapping(name, hf_names, kind)


def hf_expected_shapes(args: GPTModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of ``args`` must contain, with its shape."""
    h, d = args.hidden_size, args.kv_channels
    q, kv, f = args.num_attention_heads * d, args.num_query_groups * d, args.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (args.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not args.tie_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, h)
    for i in range(args.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                a + "q_proj.weight": (q, h),
                a + "k_proj.weight": (kv, h),
                a + "v_proj.weight": (kv, h),
                a + "o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
        if args.add_qkv_bias:
            shapes.update(
                {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
            )
        if args.qk_layernorm:
            shapes.update({a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
    return shapes


# ---------------------------------------------------------------------- QKV layout
def interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """Fuse HF q/k/v projections (weights ``[out, in]`` or biases ``[out]``) of ``num_groups``
    query groups into Megatron's per-group ``[q_g..., k_g, v_g]`` layout."""
    rest = q.shape[1:]
    parts = [t.reshape(num_groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def deinterleave_qkv(
    qkv: torch.Tensor, num_groups: int, heads_per_group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_qkv`` (contiguous outputs)."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


# ---------------------------------------------------------------------- HF -> Megatron
class TensorSource(Protocol):
    """Lazy access to HF tensors (see ``HFCheckpointReader``)."""

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name``."""
        ...

    def read(
        self, name: str, dim: int | None = None, start: int | None = None, stop: int | None = None
    ) -> torch.Tensor:
        """Indices ``[start, stop)`` of tensor ``name`` along ``dim`` (``dim=None``: all of it)."""
        ...


def _chunk_bounds(size: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    if size % tp_size:
        raise ValueError(f"{what}: size {size} is not divisible by tensor-parallel size {tp_size}")
    step = size // tp_size
    return tp_rank * step, (tp_rank + 1) * step


def megatron_local_from_hf(
    mapping: ParamMapping, src: TensorSource, args: GPTModelArgs, tp_rank: int = 0, tp_size: int = 1
) -> torch.Tensor:
    """The TP-local shard of ``mapping.megatron_name`` at rank ``tp_rank`` of ``tp_size``,
    reading only the HF slices that rank needs (all of q/k/v when ``tp > num_query_groups``)."""
    name, kind = mapping.megatron_name, mapping.kind
    if kind == "replicated":
        return src.read(mapping.hf_names[0])
    if kind == "vocab":
        padded = args.padded_vocab_size(tp_size)
        lo, hi = _chunk_bounds(padded, tp_rank, tp_size, name)
        real_hi = min(hi, args.vocab_size)
        pad_rows = hi - max(lo, real_hi)
        parts = []
        if real_hi > lo:
            parts.append(src.read(mapping.hf_names[0], 0, lo, real_hi))
        if pad_rows:
            ref = parts[0] if parts else src.read(mapping.hf_names[0], 0, 0, 1)
            parts.append(ref.new_zeros(pad_rows, *ref.shape[1:]))
        return torch.cat(parts, dim=0)
    if kind == "row":
        cols = src.shape(mapping.hf_names[0])[1]
        lo, hi = _chunk_bounds(cols, tp_rank, tp_size, name)
        return src.read(mapping.hf_names[0], 1, lo, hi)
    if kind == "fc1":
        lo, hi = _chunk_bounds(args.ffn_hidden_size, tp_rank, tp_size, name)
        return torch.cat([src.read(n, 0, lo, hi) for n in mapping.hf_names], dim=0)
    if kind == "qkv":
        ng, d = args.num_query_groups, args.kv_channels
        n = args.num_attention_heads // ng
        if ng % tp_size == 0:
            g0, g1 = _chunk_bounds(ng, tp_rank, tp_size, name)
            q = src.read(mapping.hf_names[0], 0, g0 * n * d, g1 * n * d)
            k = src.read(mapping.hf_names[1], 0, g0 * d, g1 * d)
            v = src.read(mapping.hf_names[2], 0, g0 * d, g1 * d)
            return interleave_qkv(q, k, v, g1 - g0)
        full = interleave_qkv(*(src.read(x) for x in mapping.hf_names), ng)
        lo, hi = _chunk_bounds(full.shape[0], tp_rank, tp_size, name)
        return full[lo:hi].clone()
    raise ValueError(f"{name}: unknown mapping kind {kind!r}")


# ---------------------------------------------------------------------- Megatron -> HF
def hf_tensors_from_megatron(
    mapping: ParamMapping, shards: Sequence[torch.Tensor], args: GPTModelArgs
) -> dict[str, torch.Tensor]:
    """HF tensors of ``mapping`` from the TP shards of its Megatron parameter (rank order).
    Vocabulary padding is removed; outputs are contiguous."""
    kind, names = mapping.kind, mapping.hf_names
    if kind == "replicated":
        return {names[0]: shards[0].contiguous()}
    if kind == "vocab":
        return {names[0]: torch.cat(list(shards), dim=0)[: args.vocab_size].contiguous()}
    if kind == "row":
        return {names[0]: torch.cat(list(shards), dim=1).contiguous()}
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return {names[0]: gate.contiguous(), names[1]: up.contiguous()}
    if kind == "qkv":
        ng = args.num_query_groups
        q, k, v = deinterleave_qkv(
            torch.cat(list(shards), dim=0), ng, args.num_attention_heads // ng, args.kv_channels
        )
        return dict(zip(names, (q, k, v), strict=True))
    raise ValueError(f"{mapping.megatron_name}: unknown mapping kind {kind!r}")

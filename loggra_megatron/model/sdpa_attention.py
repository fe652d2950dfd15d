"""Megatron-Core core attention on PyTorch's fused ``scaled_dot_product_attention`` (SDPA).

``SDPAttention`` takes the place of Megatron-Core's local ``DotProductAttention`` in the
local layer spec (``model.build._layer_spec``): same constructor, same ``forward(query, key,
value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)``, same tensor
layouts (``[sq, b, heads/TP, d]`` in, ``[sq, b, heads/TP · d]`` out) and the same heads per
tensor-parallel rank (``heads/TP`` query heads, ``groups/TP`` key/value heads; query head
``h`` reads group ``h // (heads/groups)``). Per head::

    out = dropout(softmax(s · q kᵀ + M)) · v,    s = softmax_scale, default 1/√d

``M`` is 0 where query ``i`` may see key ``j`` and −∞ elsewhere. The local module computes
the same thing with the ``[b, heads/TP, sq, sk]`` scores in a tensor of Megatron's global
memory buffer (which keeps its largest size for the life of the process) and keeps scores
and probabilities for the backward; the fused kernels keep ``q, k, v``, the output and one
log-sum-exp per row: nothing quadratic in the sequence length.

* **Scale.** With ``apply_query_key_layer_scaling`` the local module divides the scores by the
  layer number ``L`` and its softmax multiplies them back by ``L`` in fp32: the product is
  ``s`` either way, so SDPA gets ``s``.
* **Masks.** A passed ``attention_mask`` (bool, True = masked, Megatron's convention,
  broadcastable to ``[b, heads/TP, sq, sk]``) is the whole mask, as in the local module
  (Megatron's callers put the causal part in it). Without one, a causal module lets query
  ``i`` see key ``j`` iff ``j ≤ i + (sk − sq)``: bottom-right aligned, the ``sq`` queries
  being the last ``sq`` of ``sk`` positions. That is a KV-cache step: Megatron's
  ``Attention`` calls it with ``attn_mask_type=no_mask`` and ``attention_mask=None`` after
  the prefill of a static batch (our ``rollout/static/generate.py``), where the construction's mask
  type decides, as in the local module. ``sq == sk`` runs SDPA's ``is_causal`` (no mask
  tensor); one query sees every key. A sliding window ``(w_l, w_r)`` (``config.window_size``
  on this layer; a negative side is unbounded) keeps only ``j − i − (sk − sq) ∈ [−w_l, w_r]``.
  A row that sees no key (a padding query) sees every key instead: its output is padding in
  either implementation, here it is also finite on every SDPA backend.
* **Grouped query attention.** SDPA gets the ``groups/TP`` key/value heads as they are
  (``enable_gqa``) only where its CUDA flash kernel runs (``flash_takes_grouped_kv``);
  elsewhere they are expanded to ``heads/TP`` first, since the other fused kernels
  (memory-efficient, the one that takes a mask; CPU flash) need equal head counts and SDPA
  would otherwise fall back to its math path, which forms the scores.
* **Dropout.** ``config.attention_dropout`` (or the constructor's) in training mode, drawn
  from Megatron's model-parallel RNG unless sequence parallel, as the local module does.

Refused with the reason (the local module refuses the first two too): packed sequences
(``packed_seq_params``, THD: the Transformer Engine spec runs them), ``attention_bias``,
context parallelism and softmax types other than ``vanilla`` (no attention sink in SDPA).
Megatron's dynamic inference engine (``rollout/dynamic/generate.py``) never calls core attention: it
runs its own flash kernels on the paged KV cache.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

__all__ = ["SDPAttention", "flash_takes_grouped_kv"]

CAUSAL_MASK_TYPES = (
    AttnMaskType.causal,
    AttnMaskType.causal_bottom_right,
    AttnMaskType.padding_causal,
)
"""Construction mask types under which, without a passed mask, query ``i`` sees keys ``≤ i``
(bottom-right aligned)."""


def flash_takes_grouped_kv(query: torch.Tensor, visible: torch.Tensor | None) -> bool:
    """Whether SDPA runs ``query [b, heads, sq, d]`` with grouped key/value heads in its flash
    kernel: CUDA, fp16/bf16, head dim ≤ 256 and no mask tensor."""
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] <= 256
        and visible is None
    )


class SDPAttention(MegatronModule):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (module
    docstring); a drop-in for Megatron-Core's local ``DotProductAttention``."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "SDPAttention does not support context parallelism "
                f"(context_parallel_size={config.context_parallel_size}): use the Transformer "
                "Engine layer spec"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"SDPAttention supports softmax_type='vanilla' only, not "
                f"{config.softmax_type!r}: use the Transformer Engine layer spec"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp = self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.softmax_scale = (
            1.0 / math.sqrt(self.hidden_size_per_attention_head)
            if softmax_scale is None
            else softmax_scale
        )
        self.window_size = (
            config.window_size
            if is_layer_window_attention(
                config.window_size, config.window_attn_skip_freq, layer_number
            )
            else None
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``[sq, b, heads/TP, d]`` queries, ``[sk, b, groups/TP, d]`` keys and values →
        ``[sq, b, heads/TP · d]``. ``attn_mask_type`` is ignored, as by the local module."""
        if packed_seq_params is not None:
            raise NotImplementedError(
                "SDPAttention does not support packed sequences (packed_seq_params): build the "
                "model with the Transformer Engine layer spec (build_gpt_model(use_te=True))"
            )
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention_bias")
        sq, batch = query.shape[:2]
        sk = key.shape[0]
        causal = attention_mask is None and self.attn_mask_type in CAUSAL_MASK_TYPES
        visible = self._visible_keys(attention_mask, causal, sq, sk, query.device)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if group > 1 and not flash_takes_grouped_kv(q, visible):
            k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        dropout_p = self.dropout_p if self.training else 0.0
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=visible,
                dropout_p=dropout_p,
                is_causal=visible is None and causal and sq > 1,
                scale=self.softmax_scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        return out.permute(2, 0, 1, 3).reshape(sq, batch, self.hidden_size_per_partition)

    def _visible_keys(
        self, attention_mask: torch.Tensor | None, causal: bool, sq: int, sk: int, device
    ) -> torch.Tensor | None:
        """Bool ``[.., sq, sk]``, True where query ``i`` sees key ``j`` (module docstring);
        None where no mask tensor is needed (no mask, or ``is_causal`` with ``sq == sk``)."""
        visible = None if attention_mask is None else ~attention_mask
        if self.window_size is not None or (causal and 1 < sq != sk):
            left, right = self.window_size or (-1, 0)
            keys = torch.arange(sk, device=device)
            queries = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
            band = torch.ones(sq, sk, dtype=torch.bool, device=device)
            if left >= 0:
                band &= keys >= queries - left
            if right >= 0:
                band &= keys <= queries + right
            visible = band if visible is None else visible & band
        if visible is not None:
            visible = visible | ~visible.any(dim=-1, keepdim=True)
        return visible

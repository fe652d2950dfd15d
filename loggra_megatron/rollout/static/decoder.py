"""The static engine's KV cache and stage forward: Megatron-Core's own layers around attention
over a static cache, with each decode step captured in a CUDA graph (gpt-fast's scheme).

A rollout batch of ``B`` rows advances one position ``p`` per step, all rows together
(``rollout/static/generate.py``), so one device tensor ``positions [s]`` says where a forward of ``s``
tokens sits. Per step of this pipeline stage::

    h = embedding(ids)                                  [s, B, H]  (first stage; else received)
    r = freqs[positions]                                [s, 1, 1, d]  RoPE: once per step
    for each layer (Megatron's TransformerLayer: norms, QKV, RoPE, MLP, residuals as in training):
        K[:, :, positions] = k;  V[:, :, positions] = v       cache [B, groups/TP, capacity, d]
        o = softmax(s · q Kᵀ[:, :, :w] + M) V[:, :, :w]       M: key j visible iff j ≤ position
    logits = output_layer(final_norm(h[-1]))            [B, V]  (last stage, TP-gathered)

Only the layer's core attention is replaced (``KVCacheAttention``, for the rollout's
duration): the rest is the training model's code, so the numbers are the training forward's to
round-off. Grouped-query attention folds each group's query heads into the query axis
(``[B, groups, heads/groups · s, d]`` against ``[B, groups, w, d]``): no key/value copy per
head. No dropout and no RNG-tracker fork (eval).

**Widths.** A decode step at position ``p`` attends to the first ``w`` cache positions, ``w`` the
smallest power of two ≥ ``p + 1`` (at least ``MIN_WIDTH``, at most the capacity): at most
twice the keys it needs, and a handful of shapes per rollout. Each width's step (the layers
and the output layer) is captured once per rollout (``StepGraphs``; a chunked rollout reuses
one decoder, its cache and its graphs for every chunk, ``rollout/static/chunking.py``)
and replayed with the position refilled in place: no host sync and no Python per layer. The
embedding runs eagerly before it and writes the graph's input buffer: Megatron's
vocab-parallel embedding masks other shards' ids with a boolean index (``x[mask] = 0``), a host
read at TP > 1 that a capture refuses (the CPU stand-in caught it). The prefill (``s > 1``)
runs eagerly over exactly ``positions[-1] + 1`` keys.

**Where it is captured.** On CUDA with ``cuda_graphs`` (``--rollout-cuda-graphs``), except under
FP8 (``--rollout-fp8``): Transformer Engine's FP8 forward updates its scaling state on the host
side of each call, which a plain capture would freeze (TE's own ``make_graphed_callables`` is
the way there), so FP8 decodes eagerly, as does ``--no-rollout-cuda-graphs``. By default an FP8
run decodes outside FP8 with its bf16 weights (``generation_mode(fp8=False)``), captured. On CPU the step runs through the
graph stand-in (the same static buffers, and a host read fails), so a capture a GPU would
refuse fails a CPU test first. Tensor parallelism: the layers' own all-reduces run inside the
graph (NCCL allows capture); pipeline parallelism: each stage captures its layers, and the
send/receive of ``[1, B, H]`` stays outside (the receive writes the graph's input buffer).

Refused, with the reason: attention with a sliding window, a non-vanilla softmax, multi-latent
attention, and position embeddings other than RoPE or learned absolute positions.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from loggra_megatron.rollout.static.step_graph import StepGraphs

__all__ = [
    "MIN_WIDTH",
    "KVCacheAttention",
    "StaticDecoder",
    "attention_width",
    "stage_hidden_dtype",
]

MIN_WIDTH = 64
"""The narrowest attention width a decode step is captured at."""


def attention_width(end: int, capacity: int) -> int:
    """Keys a decode step whose last position is ``end − 1`` attends to: the smallest power of
    two ≥ ``end``, at least ``MIN_WIDTH``, at most ``capacity``."""
    return min(capacity, max(MIN_WIDTH, 1 << max(0, end - 1).bit_length()))


def stage_hidden_dtype(config) -> torch.dtype:
    """The dtype of the hidden states a pipeline stage sends (Megatron's rule)."""
    if config.fp32_residual_connection:
        return torch.float32
    return config.pipeline_dtype or config.params_dtype


class _Step:
    """What the cached attentions read during one forward (set by the decoder before it):
    ``positions [s]`` on the device, the width (cache positions attended to) and the mask,
    ``visible [heads/groups · s, width]`` (True: query row sees key), made by the step's first
    layer."""

    positions: torch.Tensor
    width: int = 0
    visible: torch.Tensor | None = None


class KVCacheAttention(torch.nn.Module):
    """A layer's core attention during a rollout: writes the step's keys and values into this
    layer's cache at ``positions`` and attends over its first ``width`` positions (module
    docstring). Same call as Megatron's core attention: ``[s, b, heads/TP, d]`` queries,
    ``[s, b, groups/TP, d]`` keys and values → ``[s, b, heads/TP · d]``."""

    def __init__(self, step: _Step, batch: int, capacity: int, scale: float):
        super().__init__()
        self.step, self.batch, self.capacity, self.scale = step, batch, capacity, scale
        self.key: torch.Tensor | None = None  # [B, groups/TP, capacity, d], at the prefill
        self.value: torch.Tensor | None = None

    def forward(self, query, key, value, attention_mask=None, **_):
        """Megatron's mask and its other arguments (mask type, bias, packing) are not read:
        the step's positions decide what each query sees."""
        step = self.step
        s, rows, heads, d = query.shape
        if self.key is None:  # zeros: masked keys must stay finite (0 · NaN is NaN)
            shape = (self.batch, key.shape[2], self.capacity, d)
            self.key = key.new_zeros(shape)
            self.value = value.new_zeros(shape)
        self.key[:rows].index_copy_(2, step.positions, key.permute(1, 2, 0, 3))
        self.value[:rows].index_copy_(2, step.positions, value.permute(1, 2, 0, 3))
        groups = self.key.shape[1]
        k = self.key[:rows, :, : step.width]  # [b, groups, w, d]
        v = self.value[:rows, :, : step.width]
        q = query.permute(1, 2, 0, 3).reshape(rows, groups, heads // groups * s, d)
        if step.visible is None:  # the first layer of the step makes the mask
            keys = torch.arange(step.width, device=query.device)
            step.visible = (keys <= step.positions.unsqueeze(1)).repeat(heads // groups, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=step.visible, scale=self.scale)
        return out.view(rows, heads, s, d).permute(2, 0, 1, 3).reshape(s, rows, heads * d)

    def kv_bytes(self) -> int:
        """Bytes of this layer's cache (0 before the prefill)."""
        return sum(t.numel() * t.element_size() for t in (self.key, self.value) if t is not None)


def _check_supported(model) -> None:
    config = model.config
    reasons = []
    if getattr(config, "window_size", None) is not None:
        reasons.append(f"a sliding attention window (window_size={config.window_size})")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        reasons.append(f"softmax_type={config.softmax_type!r}")
    if getattr(config, "multi_latent_attention", False):
        reasons.append("multi-latent attention")
    if model.position_embedding_type not in ("rope", "learned_absolute", "none"):
        reasons.append(f"position_embedding_type={model.position_embedding_type!r}")
    if reasons:
        raise NotImplementedError(
            "the static rollout engine does not support "
            + ", ".join(reasons)
            + ": use --rollout-engine dynamic (Megatron-Core's engine)"
        )


class StaticDecoder:
    """This pipeline stage's forward over a static KV cache of ``batch`` rows and ``capacity``
    positions (module docstring). Use inside ``attached``; ``forward`` runs ``s`` new
    tokens eagerly (the prefill), ``decode`` one token per row through the step graphs."""

    def __init__(self, model, batch: int, capacity: int, *, cuda_graphs: bool = True):
        from megatron.core.utils import unwrap_model

        inner = unwrap_model(model)
        _check_supported(inner)
        config = inner.config
        self.inner, self.batch, self.capacity = inner, batch, capacity
        self.first, self.last = inner.pre_process, inner.post_process
        device = next(inner.parameters()).device
        self.step = _Step()
        scale = config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        layers = inner.decoder.layers
        self.attentions = [KVCacheAttention(self.step, batch, capacity, scale) for _ in layers]
        self.freqs = None  # [capacity, 1, 1, d] RoPE angles, computed once per rollout
        if inner.position_embedding_type == "rope":
            self.freqs = inner.rotary_pos_emb(capacity)
        # The decode step's static inputs: the position and the hidden states (embedded here
        # on the first stage, at the first decode step; received elsewhere).
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.hidden_in = self.out = None
        if not self.first:
            shape = (1, batch, config.hidden_size)
            self.hidden_in = torch.empty(shape, dtype=stage_hidden_dtype(config), device=device)
        self.graphs = None  # eager decode steps
        if cuda_graphs and not config.fp8:
            self.graphs = StepGraphs(device, capture=device.type == "cuda")

    @contextlib.contextmanager
    def attached(self) -> Iterator[StaticDecoder]:
        """The layers' core attention is this decoder's cache for the block, restored after;
        the step graphs are released at the end of the block (``StepGraphs.release``), so the
        decoder and its cache are freed as soon as the caller drops it."""
        layers = [layer.self_attention for layer in self.inner.decoder.layers]
        saved = [attention.core_attention for attention in layers]
        try:
            for attention, cached in zip(layers, self.attentions, strict=True):
                attention.core_attention = cached
            yield self
        finally:
            for attention, core in zip(layers, saved, strict=True):
                attention.core_attention = core
            if self.graphs is not None:
                self.graphs.release()

    def forward(self, tokens: torch.Tensor | None, start: int, length: int):
        """``length`` new positions from ``start`` for the first rows, eagerly: ``tokens
        [rows, length]`` on the first stage; elsewhere ``hidden [length, rows, H]`` set with
        the model's ``set_input_tensor``. Returns the last position's logits
        ``[rows, V]`` (last stage) or the hidden states ``[length, rows, H]``."""
        step = self.step
        step.positions = torch.arange(start, start + length, device=self.position.device)
        step.width = start + length
        return self._layers(self._embed(tokens) if self.first else None)

    def decode(self, ids: torch.Tensor | None, position: int):
        """One position for every row: ``ids [B, 1]`` at ``position`` on the first stage
        (elsewhere the hidden states were received into ``hidden_in``). The output is the
        step graph's: read it before the next call."""
        self.position.fill_(position)
        self.step.positions = self.position
        if self.first:  # eagerly: Megatron's embedding reads a boolean mask on the host at TP > 1
            hidden = self._embed(ids)
            if self.hidden_in is None:
                self.hidden_in = torch.empty_like(hidden)
            self.hidden_in.copy_(hidden)
        width = attention_width(position + 1, self.capacity)
        if self.graphs is None:
            return self._decode_step(width)
        return self.graphs.run(width, lambda: self._decode_step(width))

    def _decode_step(self, width: int):
        """The captured part: the layers and the output layer, from ``hidden_in`` into
        one output buffer for every width (made at the first, eager, call: a graph's own
        output would stay allocated per width)."""
        self.step.positions, self.step.width = self.position, width
        if not self.first:
            self.inner.set_input_tensor(self.hidden_in)
        out = self._layers(self.hidden_in if self.first else None)
        if self.out is None:
            self.out = torch.empty_like(out)
        return self.out.copy_(out)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        positions = self.step.positions.expand(len(ids), -1)
        return self.inner.embedding(input_ids=ids, position_ids=positions)  # [s, b, H]

    def _layers(self, hidden: torch.Tensor | None):
        """This stage's layers from ``hidden [s, b, H]`` (None: the received input), then on
        the last stage the last position's logits ``[b, V]``."""
        inner, step = self.inner, self.step
        step.visible = None
        rope = None if self.freqs is None else self.freqs.index_select(0, step.positions)
        hidden = inner.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope)
        if not self.last:
            return hidden
        weight = None
        if inner.share_embeddings_and_output_weights:
            weight = inner.shared_embedding_or_output_weight()
        logits, _ = inner.output_layer(hidden[-1:], weight=weight, runtime_gather_output=True)
        if hasattr(inner, "_scale_logits"):  # MuP's output scale (megatron-core 0.17+)
            logits = inner._scale_logits(logits)
        return logits[0].float()

    def share_prefix(self, index: torch.Tensor, length: int) -> None:
        """Row ``r``'s first ``length`` positions from row ``index[r]`` (after a prefill of
        the distinct prompts only: ``rollout/static/generate.py``)."""
        for attention in self.attentions:
            for cache in (attention.key, attention.value):
                cache[: len(index), :, :length] = cache[:, :, :length].index_select(0, index)

    def kv_bytes(self) -> int:
        """Bytes of this stage's KV cache."""
        return sum(attention.kv_bytes() for attention in self.attentions)

"""The static engine's rollout in chunks of rows, the KV cache bounded by
``--inference-max-tokens``.

``generate_chunked`` runs ``generate_rollout`` over chunks of
``c = max(1, ⌊M / (P + N)⌋)`` rows (``M = --inference-max-tokens``, ``P`` the longest prompt,
``N = --max-new-tokens``), so the KV cache never holds more than ``max(M, P + N)`` tokens
(``kv_cache_bytes``), through one decoder whose KV cache and captured decode steps serve
every chunk; each chunk samples from its own generator and is filled with finished rows to
the decoder's batch (under ``--rollout-fp8``, a multiple of Transformer Engine's GEMM rows).
The dynamic engine bounds its paged cache itself (``rollout.dynamic.generate``). The KV
formula and the chunks' sampling streams: ``docs/rollouts.md#the-static-engine``.
"""

from __future__ import annotations

import torch

from loggra_megatron.rollout.protocol import RolloutRequest
from loggra_megatron.rollout.static.generate import Rollout, generate_rollout

__all__ = ["chunk_rows", "concat_rollouts", "generate_chunked", "kv_cache_bytes"]


def chunk_rows(num_rows: int, row_tokens: int, max_tokens: int | None) -> int:
    """Rows per chunk: all of them without a bound, else as many as fit ``max_tokens`` (at
    least one)."""
    if max_tokens is None:
        return num_rows
    return max(1, min(num_rows, max_tokens // row_tokens))


def kv_cache_bytes(model, rows: int, length: int) -> int:
    """Bytes of the static KV cache of ``rows × length`` tokens on this rank (this pipeline
    stage's layers, this TP rank's KV heads)."""
    from megatron.core.utils import get_model_config, unwrap_model

    config = get_model_config(model)
    layers = len(unwrap_model(model).decoder.layers)
    groups = config.num_query_groups or config.num_attention_heads
    heads = max(1, groups // config.tensor_model_parallel_size)
    dtype = config.params_dtype if config.params_dtype is not None else torch.float32
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * rows * length * heads * config.kv_channels * item


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """The rows of ``parts`` as one ``Rollout``, right-padded to the longest."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.tokens.shape[1] for p in parts)

    def cat(name: str, fill, shift: int = 0) -> torch.Tensor:
        rows = []
        for p in parts:
            x = getattr(p, name)
            extra = width - shift - x.shape[1]
            rows.append(torch.cat([x, x.new_full((x.shape[0], extra), fill)], dim=1))
        return torch.cat(rows)

    return Rollout(
        tokens=cat("tokens", pad_id),
        log_probs=cat("log_probs", 0.0, 1),
        response_mask=cat("response_mask", False, 1),
        token_mask=cat("token_mask", False),
        prompt_lengths=torch.cat([p.prompt_lengths for p in parts]),
        response_lengths=torch.cat([p.response_lengths for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
        decode_steps=sum(p.decode_steps for p in parts),
        host_syncs=sum(p.host_syncs for p in parts),
        prefill_tokens=sum(p.prefill_tokens for p in parts),
    )


def generate_chunked(
    model, prompts: list[list[int]], request: RolloutRequest
) -> tuple[Rollout, int]:
    """``generate_rollout`` over chunks of rows that fit ``request.max_tokens`` KV-cache
    tokens, through one ``StaticDecoder`` sized to the largest chunk (its KV cache and its
    captured decode steps serve every chunk; a shorter last chunk is filled with finished
    rows). Returns the rollout of all ``prompts`` and the bytes of the decoder's KV cache on
    this rank, measured on its buffers."""
    from loggra_megatron.rollout.generation_mode import generation_mode
    from loggra_megatron.rollout.static.decoder import StaticDecoder

    length = max(len(p) for p in prompts) + request.max_new_tokens
    rows = chunk_rows(len(prompts), length, request.max_tokens)
    batch = -(-rows // request.row_multiple) * request.row_multiple
    parts = []
    with generation_mode(model, fp8=request.fp8):
        decoder = StaticDecoder(model, batch, length, cuda_graphs=request.cuda_graphs)
        with decoder.attached():
            for chunk, lo in enumerate(range(0, len(prompts), rows)):
                part = prompts[lo : lo + rows]
                parts.append(generate_rollout(model, part, request, chunk=chunk, decoder=decoder))
    return concat_rollouts(parts, request.pad_id), decoder.kv_bytes()

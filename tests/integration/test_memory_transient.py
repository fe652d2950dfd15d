"""The activation terms of Megatron-Core's local layer spec (every CPU run, and
``--transformer-impl local``) against what one real layer saves for its backward.

``memory.transient.activation_bytes_per_layer`` describes Transformer Engine's fused layers;
``local_spec_bytes_per_layer`` adds what the local spec's unfused torch norms, RoPE and (on
CPU) SwiGLU keep besides. Their sum must equal, to the byte, the distinct storages that one
bf16 layer's forward hands to autograd (its weights and the shared RoPE table left out), at
TP = 1 and 2, with GQA, and with QK-norm.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from memory_plans import plan

from loggra_megatron.memory.shape import TransformerShape
from loggra_megatron.memory.transient import (
    activation_bytes,
    activation_bytes_per_layer,
    local_spec_bytes_per_layer,
)
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

H, F, HEADS, GROUPS, SEQ, ROWS = 64, 96, 4, 2, 32, 2


def _saved_bytes(rank: int, groups: int, qk_layernorm: bool) -> int:
    """Bytes of the distinct storages one layer's forward saves, weights and RoPE left out."""
    from megatron.core.utils import unwrap_model

    from loggra_megatron.model.args import GPTModelArgs
    from loggra_megatron.model.build import build_gpt_model

    args = GPTModelArgs(
        num_layers=1,
        hidden_size=H,
        ffn_hidden_size=F,
        num_attention_heads=HEADS,
        num_query_groups=groups,
        vocab_size=128,
        make_vocab_size_divisible_by=1,
        max_position_embeddings=SEQ,
        qk_layernorm=qk_layernorm,
        params_dtype="bfloat16",
    )
    gpt = unwrap_model(build_gpt_model(args))
    layer = gpt.decoder.layers[0]
    rope = gpt.rotary_pos_emb(SEQ)
    known = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
    known.add(rope.untyped_storage().data_ptr())
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in known:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(SEQ, ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope)
    out.float().sum().backward()  # the graph is whole: every saved tensor is used
    return sum(saved.values())


@pytest.mark.parametrize(
    "tp,groups,qk_layernorm",
    [
        (1, GROUPS, False),
        (1, GROUPS, True),
        (1, HEADS, False),
        (2, GROUPS, False),
        (2, HEADS, True),
    ],
)
def test_local_spec_layer_saves_what_the_model_counts(tp, groups, qk_layernorm):
    """GQA (keys and values expanded for SDPA off CUDA) or not, QK-norm, TP = 1 and 2."""
    measured = run_distributed(_saved_bytes, tp, groups, qk_layernorm, tp=tp)[0]
    shape = TransformerShape(1, H, F, HEADS, 128, groups, qk_layernorm=qk_layernorm)
    local = plan(transformer_impl="local", cuda=False, tensor_model_parallel_size=tp)
    fused = activation_bytes_per_layer(shape, local, ROWS, SEQ)
    extra = local_spec_bytes_per_layer(shape, local, ROWS, SEQ)
    assert measured == fused + extra
    assert extra > 0.3 * fused  # the local spec keeps markedly more than the fused layers


def test_local_spec_terms_follow_the_plan():
    """Transformer Engine's spec adds nothing; on CUDA the bias-SwiGLU fusion drops the
    SwiGLU term and flash attention the expanded keys and values; the last stage adds its
    final norm's copies."""
    shape = TransformerShape(2, H, F, HEADS, 128, GROUPS)
    local = plan(transformer_impl="local", cuda=False, micro_batch_size=1)
    te = dataclasses.replace(local, transformer_impl="transformer_engine")
    cuda = dataclasses.replace(local, cuda=True)
    s = local.seq_length
    assert local_spec_bytes_per_layer(shape, te, 1, s) == 0
    swiglu, d = 2 * 2 * s * F, H // HEADS
    expanded, grouped = 2 * s * 2 * (HEADS - GROUPS) * d, 2 * s * (HEADS + GROUPS) * d
    assert local_spec_bytes_per_layer(shape, local, 1, s) - swiglu - expanded == (
        local_spec_bytes_per_layer(shape, cuda, 1, s) - grouped
    )
    norm = 6 * s * H + 4 * s
    layers = activation_bytes(shape, local) - activation_bytes(shape, te) - norm
    assert layers == 2 * local_spec_bytes_per_layer(shape, local, 1, s)

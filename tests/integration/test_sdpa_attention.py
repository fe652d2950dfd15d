"""``model.sdpa_attention.SDPAttention`` against Megatron-Core's local ``DotProductAttention``
(the reference, built directly), on the real Megatron-Core on CPU/gloo.

One worker run per layout (TP=1 single process, TP=2) computes everything the tests inspect:
the two core attentions on the same inputs (output and the gradients of q, k, v), a tiny
``GPTModel`` from ``build_gpt_model`` (local spec: SDPA) against the same model object with
the local core attention swapped in (neither has parameters, so the weights are the same),
and a greedy rollout with each, with the contents of Megatron's global memory buffer after
it. The workers stay at module level (pickled by reference).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from loggra_megatron.testing import run_distributed, tiny_gpt_model

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

VOCAB, SEQ, BATCH, HEADS, DIM = 64, 16, 2, 4, 8
PROMPTS = [[5, 9, 17], [3, 4, 5, 6, 7], [60, 2], [11, 12, 13, 14]]


def _mask(sq: int, sk: int, key_lengths: list[int], fully_masked_row: int | None = None):
    """Megatron's convention (True = masked), ``[b, 1, sq, sk]``: bottom-right causal, keys
    from ``key_lengths[row]`` on masked (right padding), one query row masked entirely."""
    keys = torch.arange(sk)
    queries = torch.arange(sq).unsqueeze(1) + (sk - sq)
    mask = (keys > queries).expand(len(key_lengths), 1, sq, sk).clone()
    for row, length in enumerate(key_lengths):
        mask[row, :, :, length:] = True
    if fully_masked_row is not None:
        mask[:, :, fully_masked_row, :] = True
    return mask


# name: (TransformerConfig fields, module kwargs, sq, sk, SDPA's mask, the reference's mask,
# query rows the loss reads)
CASES = {
    "causal": ({}, {}, 12, 12, None, None, None),
    "gqa": ({"num_query_groups": 2}, {}, 12, 12, None, None, None),
    "padding_mask": ({}, {}, 12, 12, _mask(12, 12, [12, 7]), _mask(12, 12, [12, 7]), None),
    "gqa_padding_mask": (
        {"num_query_groups": 2},
        {},
        12,
        12,
        _mask(12, 12, [9, 12]),
        _mask(12, 12, [9, 12]),
        None,
    ),
    "fully_masked_row": (
        {},
        {},
        12,
        12,
        _mask(12, 12, [12, 12], fully_masked_row=0),
        _mask(12, 12, [12, 12], fully_masked_row=0),
        slice(1, None),  # the masked row is padding in both: its output differs, finite here
    ),
    "softmax_scale": ({}, {"softmax_scale": 0.9}, 12, 12, None, None, None),
    "layer_scaling": (
        {"apply_query_key_layer_scaling": True},
        {"layer_number": 3},
        12,
        12,
        None,
        None,
        None,
    ),
    # KV-cache decode: one query against the cache, no mask (what the static batch passes).
    "decode": ({"num_query_groups": 2}, {}, 1, 12, None, None, None),
    # A chunk of 3 queries against 12 cached keys: no mask here; the local module needs the
    # bottom-right mask Megatron's static inference wrapper passes (it asserts sq == sk).
    "decode_chunk": ({"num_query_groups": 2}, {}, 3, 12, None, _mask(3, 12, [12, 12]), None),
    "sliding_window": ({"window_size": (4, 0)}, {}, 12, 12, None, None, None),
}


def _config(**fields):
    from megatron.core.transformer import TransformerConfig

    base = dict(
        num_layers=4,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return TransformerConfig(**{**base, **fields})


def _modules(config_fields: dict, module_kwargs: dict):
    """(SDPAttention, DotProductAttention) of the same configuration."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from loggra_megatron.model.sdpa_attention import SDPAttention

    config = _config(**config_fields)
    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    kwargs.update(module_kwargs)
    return SDPAttention(config, **kwargs), DotProductAttention(config, **kwargs)


def _inputs(config, tp: int, sq: int, sk: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
    q = torch.randn(sq, BATCH, heads, DIM, generator=gen)
    k, v = (torch.randn(sk, BATCH, groups, DIM, generator=gen) for _ in range(2))
    weight = torch.randn(sq, BATCH, heads * DIM, generator=gen)
    return q, k, v, weight


def _run(module, q, k, v, weight, mask, rows):
    """Output and (dq, dk, dv) of ``Σ weight · out`` over the query ``rows``."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask)
    (out * weight)[rows].sum().backward()
    return out.detach(), (q.grad, k.grad, v.grad)


GROUPED_KV_CASES = ("gqa", "decode")
"""Run again with SDPA given the grouped key/value heads (``enable_gqa``), as on CUDA flash."""


def _core_attention_case(name: str):
    fields, kwargs, sq, sk, mask, reference_mask, rows = CASES[name]
    sdpa, local = _modules(fields, kwargs)
    q, k, v, weight = _inputs(sdpa.config, 1, sq, sk)
    rows = slice(None) if rows is None else rows
    return (
        _run(sdpa, q, k, v, weight, mask, rows),
        _run(local, q, k, v, weight, reference_mask, rows),
        rows,
    )


def _core_attention_cases() -> dict:
    from loggra_megatron.model import sdpa_attention

    results = {name: _core_attention_case(name) for name in CASES}
    on_this_device = sdpa_attention.flash_takes_grouped_kv
    sdpa_attention.flash_takes_grouped_kv = lambda query, visible: visible is None
    try:
        for name in GROUPED_KV_CASES:
            results[f"{name}_grouped_kv"] = _core_attention_case(name)
    finally:
        sdpa_attention.flash_takes_grouped_kv = on_this_device
    return results


def _dropout() -> dict:
    """Outputs in eval mode and 400 draws in training mode, attention dropout 0.5."""
    sdpa, _ = _modules({"attention_dropout": 0.5}, {})
    q, k, v, _ = _inputs(sdpa.config, 1, 8, 8)
    with torch.no_grad():
        evaluated = sdpa.eval()(q, k, v, None)
        sdpa.train()
        draws = torch.stack([sdpa(q, k, v, None) for _ in range(400)])
    return {"eval": evaluated, "draws": draws}


def _refusals() -> dict[str, str]:
    """The messages of what SDPAttention refuses."""
    out = {}
    for name, fields in (
        ("softmax_type", {"softmax_type": "learnable"}),
        ("context_parallel", {"context_parallel_size": 2}),
    ):
        try:
            _modules(fields, {})
        except ValueError as e:
            out[name] = str(e)
    sdpa, _ = _modules({}, {})
    q, k, v, _ = _inputs(sdpa.config, 1, 4, 4)
    for name, kwargs in (
        ("packed_seq_params", {"packed_seq_params": object()}),
        ("attention_bias", {"attention_bias": torch.zeros(1)}),
    ):
        try:
            sdpa(q, k, v, None, **kwargs)
        except NotImplementedError as e:
            out[name] = str(e)
    return out


def _use_local_attention(model) -> None:
    """Swap Megatron's local ``DotProductAttention`` in for each layer's SDPAttention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for layer in model.decoder.layers:
        sdpa = layer.self_attention.core_attention
        layer.self_attention.core_attention = DotProductAttention(
            config=sdpa.config,
            layer_number=sdpa.layer_number,
            attn_mask_type=sdpa.attn_mask_type,
            attention_type=sdpa.attention_type,
            softmax_scale=sdpa.config.softmax_scale,
            pg_collection=sdpa.pg_collection,
        )


def _logits_and_grads(model, tokens, weight):
    """Logits (this rank's vocabulary shard) and every parameter's gradient of ``Σ w · z``."""
    from loggra_megatron.model.forward import positions_like

    model.zero_grad()
    logits = model(tokens, positions_like(tokens), None)
    (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rollout_and_buffer(model):
    """A greedy rollout (prefill + KV-cached decode) and what Megatron's global memory buffer
    holds after it (``GlobalMemoryBuffer.buffer``: ``{(name, dtype): tensor}``)."""
    from megatron.core import parallel_state as ps

    from loggra_megatron.rollout import RolloutRequest, generate_rollout

    rollout = generate_rollout(model, PROMPTS, RolloutRequest(max_new_tokens=4, temperature=0.0))
    held = {key: t.numel() for key, t in ps.get_global_memory_buffer().buffer.items()}
    return rollout, held


def _model_worker(rank: int) -> dict:
    from loggra_megatron.model.sdpa_attention import SDPAttention

    tp = torch.distributed.get_world_size()
    model = tiny_gpt_model(
        2,
        HEADS * DIM,
        HEADS,
        VOCAB,
        SEQ,
        query_groups=2,
        use_cpu_initialization=True,
        init_method_std=0.3,  # attention far from uniform
    )
    out = {
        "sdpa_layers": all(
            isinstance(layer.self_attention.core_attention, SDPAttention)
            for layer in model.decoder.layers
        )
    }
    out["rollout_sdpa"], out["buffer_sdpa"] = _rollout_and_buffer(model)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    weight = torch.randn(BATCH, SEQ, VOCAB // tp, generator=gen)
    model.train()
    out["sdpa"] = _logits_and_grads(model, tokens, weight)
    _use_local_attention(model)
    out["local"] = _logits_and_grads(model, tokens, weight)
    out["rollout_local"], out["buffer_local"] = _rollout_and_buffer(model)
    if tp == 1:
        out["cases"] = _core_attention_cases()
        out["dropout"] = _dropout()
        out["refusals"] = _refusals()
    return out


@pytest.fixture(scope="module")
def tp1() -> dict:
    return run_distributed(_model_worker, 1)[0]


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_distributed(_model_worker, 2, tp=2)


@pytest.mark.parametrize("case", [*CASES, *(f"{n}_grouped_kv" for n in GROUPED_KV_CASES)])
def test_core_attention_equals_megatron_local_attention(tp1, case):
    (out, grads), (ref_out, ref_grads), rows = tp1["cases"][case]
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out[rows], ref_out[rows], atol=5e-5, rtol=0)
    for name, grad, ref in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=5e-5, rtol=0, msg=f"d{name}")
        assert ref.abs().max() > 1e-3, f"d{name} of the reference is ~0: the check is empty"


def test_decode_chunk_sees_the_cache_bottom_right_aligned(tp1):
    """The chunk's first query sees the 10 keys up to its own position, not only key 0 (which
    SDPA's top-left ``is_causal`` would give)."""
    (out, _), _, _ = tp1["cases"]["decode_chunk"]
    groups = SimpleNamespace(num_attention_heads=HEADS, num_query_groups=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in _inputs(groups, 1, 3, 12)[:3])
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not torch.allclose(out, top_left.permute(2, 0, 1, 3).reshape(out.shape), atol=1e-3)


def test_attention_dropout_in_training_only_and_unbiased(tp1):
    evaluated, draws = tp1["dropout"]["eval"], tp1["dropout"]["draws"]  # [N, sq, b, h·d]
    assert not torch.allclose(draws[0], draws[1], atol=1e-3)
    # Query 0 sees key 0 only: each head's output is 0 (dropped, p = 0.5) or 2 · v_0.
    first = draws[:, 0].unflatten(-1, (HEADS, DIM))
    kept = torch.isclose(first, 2 * evaluated[0].unflatten(-1, (HEADS, DIM)), atol=1e-5)
    dropped = first == 0
    assert (kept.all(-1) | dropped.all(-1)).all()
    assert abs(dropped.all(-1).float().mean().item() - 0.5) < 0.05  # 3200 heads drawn
    # E[dropout(P) / (1 - p)] = P: the mean of the draws is the eval output.
    standard_error = draws.std(0) / draws.shape[0] ** 0.5
    assert ((draws.mean(0) - evaluated).abs() <= 5 * standard_error + 1e-6).all()


def test_refuses_what_it_does_not_run_with_the_reason(tp1):
    refusals = tp1["refusals"]
    assert "vanilla" in refusals["softmax_type"]
    assert "context parallelism" in refusals["context_parallel"]
    assert "use_te=True" in refusals["packed_seq_params"]
    assert "attention_bias" in refusals["attention_bias"]


def test_local_spec_uses_sdpa_and_is_otherwise_megatrons():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from loggra_megatron.model.args import GPTModelArgs
    from loggra_megatron.model.build import _layer_spec
    from loggra_megatron.model.sdpa_attention import SDPAttention

    args = GPTModelArgs(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64
    )
    spec = _layer_spec(args, use_te=False)
    assert spec.submodules.self_attention.submodules.core_attention is SDPAttention
    stock = get_gpt_layer_local_spec(
        qk_layernorm=args.qk_layernorm, normalization=args.normalization
    )
    stock.submodules.self_attention.submodules.core_attention = SDPAttention
    assert repr(spec) == repr(stock)  # 0.19's MLP spec is a fresh functools.partial per call


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_gpt_model_equals_the_local_attention_model(layout, request):
    ranks = request.getfixturevalue(layout)
    for out in ranks if isinstance(ranks, list) else [ranks]:
        assert out["sdpa_layers"]
        (logits, grads), (ref_logits, ref_grads) = out["sdpa"], out["local"]
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
        assert ref_logits.std() > 0.1  # the attention is far from uniform
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():  # fp32 sums of ~10³ terms of size ~10²: relative
            ref = ref_grads[name]
            scale = ref.abs().max().item()
            torch.testing.assert_close(grad, ref, atol=1e-5 * scale, rtol=0, msg=name)


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_rollout_prefill_leaves_the_global_memory_buffer_empty(layout, request):
    ranks = request.getfixturevalue(layout)
    for out in ranks if isinstance(ranks, list) else [ranks]:
        assert out["buffer_sdpa"] == {}
        # The reference: Megatron's local attention takes its [b·heads, sq, sk] scores there.
        assert out["buffer_local"], "the local attention left nothing: the check is empty"
        sdpa, local = out["rollout_sdpa"], out["rollout_local"]
        assert torch.equal(sdpa.tokens, local.tokens)
        torch.testing.assert_close(sdpa.log_probs, local.log_probs, atol=1e-5, rtol=0)

"""Rollouts with a bounded KV cache (``loggra_megatron.rollout.static.chunking``): chunks of rows
give the tokens of one big batch at temperature 0, on 1 process and under TP=2 / PP=2."""

from __future__ import annotations

import pytest
import torch

from loggra_megatron.rollout import RolloutRequest, generate_rollout
from loggra_megatron.rollout.static.chunking import chunk_rows, generate_chunked, kv_cache_bytes
from loggra_megatron.testing import run_distributed, tiny_gpt_model

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

VOCAB, MAX_SEQ, NEW, PAD = 64, 40, 8, 0
PROMPTS = [
    [5, 9, 17],
    [3, 4, 5, 6, 7],
    [60, 2],
    [11, 12, 13, 14],
    [8, 8],
    [1, 2, 3, 4, 5, 6],
    [40, 41, 42],
    [7],
]


def _worker(rank: int) -> dict:
    model = tiny_gpt_model(
        2, 32, 4, VOCAB, MAX_SEQ, use_cpu_initialization=True, init_method_std=0.3
    )
    gen = dict(max_new_tokens=NEW, pad_id=PAD, temperature=0.0, stop_ids=(3, 4))
    row_tokens = max(map(len, PROMPTS)) + NEW
    out = {"whole": generate_chunked(model, PROMPTS, RolloutRequest(**gen))}
    for rows in (1, 3, 5):  # budgets of 1, 3 and 5 full rows (the last chunk is shorter)
        out[rows] = generate_chunked(
            model, PROMPTS, RolloutRequest(max_tokens=rows * row_tokens, **gen)
        )
    out["row_multiple"] = generate_rollout(model, PROMPTS, RolloutRequest(row_multiple=16, **gen))
    out["sampled"] = generate_chunked(
        model,
        PROMPTS,
        RolloutRequest(max_tokens=3 * row_tokens, seed=1, **{**gen, "temperature": 1.0}),
    )
    out["kv_1x10"] = kv_cache_bytes(model, 1, 10)
    out["decoders"] = _decoders_made(model, RolloutRequest(max_tokens=row_tokens, **gen))
    return out


def _decoders_made(model, request) -> list[tuple[int, int, list]]:
    """``(batch, graph captures, widths)`` of each decoder one chunked rollout makes."""
    from decoder_records import recorded_decoders

    with recorded_decoders() as made:
        generate_chunked(model, PROMPTS, request)
    return [(d.batch, d.graphs.captures, list(d.graphs.keys)) for d in made]


@pytest.fixture(
    scope="module",
    params=[dict(world_size=1), dict(world_size=2, tp=2), dict(world_size=2, pp=2)],
    ids=["tp1", "tp2", "pp2"],
)
def results(request):
    return run_distributed(_worker, **request.param)


def _assert_same_rollout(a, b) -> None:
    assert torch.equal(a.tokens, b.tokens)
    for f in ("response_mask", "token_mask", "prompt_lengths", "response_lengths", "truncated"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=0)


def test_chunked_greedy_equals_one_batch(results):
    """Each KV budget (1, 3, 5 rows) gives the tokens, masks and lengths of one big batch,
    and log-probs equal to round-off."""
    for r in results:
        whole, _ = r["whole"]
        assert whole.response_lengths.min() > 0
        for rows in (1, 3, 5):
            _assert_same_rollout(r[rows][0], whole)


def test_kv_cache_bytes_are_bounded_by_the_budget(results):
    """The largest chunk's cache is ``rows × (longest prompt + new)`` tokens: 8 rows
    unbounded, 1/3/5 under the budgets (a chunk's own longest prompt may be shorter)."""
    row_tokens = max(map(len, PROMPTS)) + NEW
    for r in results:
        per_token = r["kv_1x10"] / 10
        assert r["whole"][1] == per_token * len(PROMPTS) * row_tokens
        for rows in (1, 3, 5):
            assert r[rows][1] <= per_token * rows * row_tokens
        assert r[1][1] == per_token * row_tokens  # the longest prompt is a chunk of its own
        assert r[3][1] == per_token * 3 * row_tokens  # measured on the one decoder's cache


def test_one_decoder_serves_every_chunk(results):
    """A rollout in 8 chunks of one row makes one decoder, and captures each decode width
    once for all of them (each chunk made its own decoder and recaptured every width)."""
    for r in results:
        assert len(r["decoders"]) == 1
        batch, captures, widths = r["decoders"][0]
        assert batch == 1 and captures == len(widths) == len(set(widths)) >= 1


def test_rows_padded_for_fp8_change_nothing(results):
    """``row_multiple=16`` (FP8 GEMMs) pads the batch with finished rows: same rollout."""
    for r in results:
        _assert_same_rollout(r["row_multiple"], r["whole"][0])


def test_sampled_chunks_are_valid_rollouts(results):
    """At temperature 1 each chunk samples from its own stream; every row is a valid rollout
    (prompt kept, response within bounds) and the model-parallel ranks agree."""
    for r in results:
        s, _ = r["sampled"]
        for i, p in enumerate(PROMPTS):
            assert s.tokens[i, : len(p)].tolist() == p
            assert 1 <= int(s.response_lengths[i]) <= NEW
    assert all(
        torch.equal(r["sampled"][0].tokens, results[0]["sampled"][0].tokens) for r in results
    )


def test_chunk_rows():
    assert chunk_rows(8, 10, None) == 8
    assert chunk_rows(8, 10, 35) == 3
    assert chunk_rows(8, 10, 5) == 1  # at least one row, even over the budget
    assert chunk_rows(8, 10, 1000) == 8

"""KV-cached generation (``loggra_megatron.rollout``) on the real Megatron-Core, CPU/gloo.

One worker run per parallel layout (TP=1 single process, TP=2, PP=2) generates every rollout
the tests below inspect; the worker must stay at module level (pickled by reference).
All three layouts use the same weights: ``use_cpu_initialization`` makes TP=1 and TP=2
initialise identically, and the PP=2 stages load the TP=1 model's state dict.
"""

from __future__ import annotations

import pytest
import torch

from loggra_megatron.model.log_probs import compute_log_probs
from loggra_megatron.rollout import (
    RolloutRequest,
    generate_rollout,
    sample_tokens,
    sampling_generator,
)
from loggra_megatron.testing import run_distributed, tensor_bytes_left_in_cycles, tiny_gpt_model

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

VOCAB, MAX_SEQ, NEW, PAD = 64, 32, 6, 0
PROMPTS = [[5, 9, 17], [3, 4, 5, 6, 7], [60, 2], [11, 12, 13, 14]]
GROUPS = [p for p in PROMPTS[:2] for _ in range(3)]  # two GRPO groups of 3 rows


def _load_pp_stage(model, full_state: dict) -> None:
    """Load this pipeline stage's slice of a PP=1 state dict (local layer i <- global layer)."""
    from megatron.core import parallel_state as ps

    per_stage = len(model.decoder.layers)
    offset = ps.get_pipeline_model_parallel_rank() * per_stage
    state = {}
    for key in model.state_dict():
        src = key
        if key.startswith("decoder.layers."):
            _, _, idx, rest = key.split(".", 3)
            src = f"decoder.layers.{int(idx) + offset}.{rest}"
        state[key] = full_state[src]
    model.load_state_dict(state, strict=True)


def _naive_greedy(model, prompt: list[int]) -> list[int]:
    """One sequence, no batching, no cache: recompute the whole prefix for every token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.tensor([seq])
            logits = model(ids, torch.arange(len(seq)).unsqueeze(0), None)
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


def _megatron_kv_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """One sequence through Megatron-Core's own KV cache (``StaticInferenceContext``), as the
    static engine decoded before ``rollout/static/decoder.py``: greedy tokens and their log-probs."""
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    context = StaticInferenceContext(1, len(prompt) + NEW)
    seq, log_probs, ids = list(prompt), [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW):
            positions = torch.arange(len(seq) - ids.shape[1], len(seq)).unsqueeze(0)
            logits = model(
                ids, positions, None, inference_context=context, runtime_gather_output=True
            )
            logits = logits[0, -1].float()
            context.increment_sequence_len_offset(ids.shape[1])
            context.enable_decode_mode()
            seq.append(int(logits.argmax()))
            log_probs.append(float(logits.log_softmax(-1)[seq[-1]]))
            ids = torch.tensor([[seq[-1]]])
    return seq[len(prompt) :], log_probs


def _narrow_widths(model) -> tuple:
    """The long greedy rollout with decode widths from 4: ``(rollout, widths captured)``."""
    from decoder_records import recorded_decoders

    from loggra_megatron.rollout.static import decoder

    saved, decoder.MIN_WIDTH = decoder.MIN_WIDTH, 4
    try:
        with recorded_decoders() as made:
            request = RolloutRequest(temperature=0.0, max_new_tokens=25)
            rollout = generate_rollout(model, PROMPTS, request)
    finally:
        decoder.MIN_WIDTH = saved
    return rollout, sorted(made[0].graphs.keys)


def _worker(rank: int, full_state: dict | None = None) -> dict:
    model = tiny_gpt_model(
        2, 32, 4, VOCAB, MAX_SEQ, use_cpu_initialization=True, init_method_std=0.3
    )
    if full_state is not None:
        _load_pp_stage(model, full_state)
    gen = dict(max_new_tokens=NEW, pad_id=PAD)
    out = {
        "greedy": generate_rollout(model, PROMPTS, RolloutRequest(temperature=0.0, **gen)),
        "greedy_nocache": generate_rollout(
            model, PROMPTS, RolloutRequest(temperature=0.0, **gen), use_kv_cache=False
        ),
        "sampled": generate_rollout(
            model, PROMPTS, RolloutRequest(temperature=1.0, seed=7, step=3, **gen)
        ),
        "sampled_again": generate_rollout(
            model, PROMPTS, RolloutRequest(temperature=1.0, seed=7, step=3, **gen)
        ),
        "sampled_next_step": generate_rollout(
            model, PROMPTS, RolloutRequest(temperature=1.0, seed=7, step=4, **gen)
        ),
        "top_p_tiny": generate_rollout(
            model, PROMPTS, RolloutRequest(temperature=1.0, top_p=1e-6, seed=7, **gen)
        ),
        "long": generate_rollout(
            model, PROMPTS, RolloutRequest(temperature=1.0, seed=7, max_new_tokens=25)
        ),
        "long_greedy": generate_rollout(
            model, PROMPTS, RolloutRequest(temperature=0.0, max_new_tokens=25)
        ),
        "sampled_eager": generate_rollout(
            model,
            PROMPTS,
            RolloutRequest(temperature=1.0, seed=7, step=3, cuda_graphs=False, **gen),
        ),
    }
    for how in ("greedy", "sampled"):
        kw = dict(temperature=0.0) if how == "greedy" else dict(temperature=1.0, seed=7, step=3)
        out[f"groups_{how}"] = generate_rollout(model, GROUPS, RolloutRequest(**kw, **gen))
        out[f"groups_{how}_nocache"] = generate_rollout(
            model, GROUPS, RolloutRequest(**kw, **gen), use_kv_cache=False
        )
        out[f"groups_{how}_unshared"] = generate_rollout(
            model, GROUPS, RolloutRequest(**kw, **gen), share_prefill=False
        )
    out["recomputed"] = compute_log_probs(model, out["sampled"].tokens, micro_batch_size=2)
    out["recomputed_greedy"] = compute_log_probs(model, out["greedy"].tokens)
    g = out["greedy"]
    out["eos_id"] = eos = int(g.tokens[0, len(PROMPTS[0]) + 2])  # row 0's 3rd generated token
    out["eos"] = generate_rollout(
        model, PROMPTS, RolloutRequest(temperature=0.0, stop_ids=(eos, VOCAB + 1), **gen)
    )
    if torch.distributed.get_world_size() == 1:
        model.eval()
        out["naive"] = [_naive_greedy(model, p) for p in PROMPTS]
        out["megatron_kv"] = [_megatron_kv_greedy(model, p) for p in PROMPTS]
        out["narrow_widths"] = _narrow_widths(model)
        out["bytes_left_in_cycles"] = tensor_bytes_left_in_cycles(
            lambda: generate_rollout(model, PROMPTS, RolloutRequest(temperature=1.0, **gen))
        )
        padded = torch.full((len(PROMPTS), 7), 99)  # a [B, P] tensor with junk past each prompt
        for i, p in enumerate(PROMPTS):
            padded[i, : len(p)] = torch.tensor(p)
        lengths = torch.tensor([len(p) for p in PROMPTS])
        out["greedy_tensor"] = generate_rollout(
            model,
            padded,
            RolloutRequest(temperature=0.0, stop_ids=(out["eos_id"],), **gen),
            prompt_lengths=lengths,
        )
        out["no_new"] = generate_rollout(
            model, padded, RolloutRequest(max_new_tokens=0), prompt_lengths=lengths
        )
        out["state_dict"] = model.state_dict()
    return out


@pytest.fixture(scope="module")
def tp1():
    return run_distributed(_worker, 1)


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_worker, 2, tp=2)


@pytest.fixture(scope="module")
def pp2(tp1):
    return run_distributed(_worker, 2, pp=2, full_state=tp1[0]["state_dict"])


@pytest.fixture(params=["tp1", "tp2", "pp2"])
def layout(request):
    """(per-rank results, index of a last-pipeline-stage rank)."""
    return request.getfixturevalue(request.param), (1 if request.param == "pp2" else 0)


def _responses(rollout) -> list[list[int]]:
    return [
        rollout.tokens[i, p : p + n].tolist()
        for i, (p, n) in enumerate(
            zip(rollout.prompt_lengths, rollout.response_lengths, strict=True)
        )
    ]


def _assert_same(a, b, atol: float = 0.0) -> None:
    assert torch.equal(a.tokens, b.tokens)
    for f in ("response_mask", "token_mask", "prompt_lengths", "response_lengths", "truncated"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=atol, rtol=0)


# ---------------------------------------------------------------- generation vs references


def test_kv_cache_equals_uncached_greedy(layout):
    results, _ = layout
    for r in results:
        _assert_same(r["greedy"], r["greedy_nocache"], atol=1e-5)


def test_kv_cache_equals_naive_per_sequence_greedy(tp1):
    r = tp1[0]
    assert _responses(r["greedy"]) == r["naive"]
    assert r["greedy"].response_lengths.tolist() == [NEW] * len(PROMPTS)


def test_decoder_equals_megatrons_own_kv_cache(tp1):
    """The static engine's decoder (``rollout/static/decoder.py``: Megatron's layers around attention
    over a static cache) samples the greedy tokens Megatron-Core's ``StaticInferenceContext``
    does, one sequence at a time, with the same log-probs to round-off."""
    r = tp1[0]
    greedy = r["greedy"]
    assert _responses(greedy) == [tokens for tokens, _ in r["megatron_kv"]]
    for i, (_, log_probs) in enumerate(r["megatron_kv"]):
        ours = greedy.log_probs[i][greedy.response_mask[i]]
        torch.testing.assert_close(ours, torch.tensor(log_probs), atol=1e-5, rtol=0)


def test_decode_steps_through_the_graph_standin_equal_eager_ones(layout):
    """On CPU the decode step runs through the CUDA-graph stand-in (static inputs refilled,
    one output tensor rewritten, host reads refused at "capture"): the same tokens and
    log-probs, to the bit, as the eager steps."""
    results, _ = layout
    for r in results:
        _assert_same(r["sampled"], r["sampled_eager"])


def test_a_rollout_leaves_no_tensor_in_a_reference_cycle(tp1):
    """Its KV cache and step graphs are freed when the rollout returns, not by a later
    cyclic collection (which let each step's cache pile up in the training phase)."""
    assert tp1[0]["bytes_left_in_cycles"] == 0


def test_decode_widths_grow_with_the_position(tp1):
    """With the narrowest width at 4, a 30-position rollout (decode steps from position 2)
    captures widths 4, 8, 16 and 30 (the capacity), and decodes what one width over the whole
    cache does."""
    narrow, widths = tp1[0]["narrow_widths"]
    assert widths == [4, 8, 16, 30]
    _assert_same(narrow, tp1[0]["long_greedy"], atol=1e-5)


def test_all_model_parallel_ranks_return_the_same_rollout(tp2, pp2):
    for results in (tp2, pp2):
        for key in ("greedy", "sampled", "eos", "top_p_tiny"):
            _assert_same(results[0][key], results[1][key])


def test_tp2_and_pp2_equal_tp1(tp1, tp2, pp2):
    for results in (tp2, pp2):
        for key in ("greedy", "sampled", "eos"):
            _assert_same(results[0][key], tp1[0][key], atol=1e-5)


# ---------------------------------------------------------------- log-probs


def test_sampled_log_probs_equal_recomputed(layout):
    results, last = layout
    for key in ("", "_greedy"):
        rollout = results[last]["sampled" if not key else "greedy"]
        recomputed = results[last]["recomputed" + key]
        assert recomputed.shape == rollout.log_probs.shape
        mask = rollout.response_mask
        torch.testing.assert_close(rollout.log_probs[mask], recomputed[mask], atol=1e-5, rtol=0)
        assert (rollout.log_probs[~mask] == 0).all()
        assert (rollout.log_probs[mask] < 0).all()
    if last:  # PP: only the last stage has the recomputed log-probs
        assert results[0]["recomputed"] is None


# ---------------------------------------------------------------- stopping, masks, sampling


def test_eos_stops_each_sequence_and_masks(tp1):
    r = tp1[0]
    eos, out, greedy = r["eos_id"], r["eos"], _responses(r["greedy"])
    expected = [resp[: resp.index(eos) + 1] if eos in resp else resp for resp in greedy]
    assert _responses(out) == expected
    assert len(expected[0]) <= 3  # row 0 stops early
    lengths = [len(p) for p in PROMPTS]
    assert out.prompt_lengths.tolist() == lengths
    assert out.truncated.tolist() == [eos not in resp for resp in greedy]
    width = max(p + len(e) for p, e in zip(lengths, expected, strict=True))
    assert out.tokens.shape == (len(PROMPTS), width)
    for i, (p, e) in enumerate(zip(lengths, expected, strict=True)):
        n = p + len(e)
        assert out.token_mask[i].tolist() == [True] * n + [False] * (width - n)
        assert out.tokens[i, :p].tolist() == PROMPTS[i]
        assert (out.tokens[i, n:] == PAD).all()
        # response_mask[t] marks target tokens[t + 1]: positions p .. n - 1.
        want = [False] * (p - 1) + [True] * len(e) + [False] * (width - n)
        assert out.response_mask[i].tolist() == want


def test_tensor_prompts_and_zero_new_tokens(tp1):
    r = tp1[0]
    _assert_same(r["greedy_tensor"], r["eos"])
    no_new = r["no_new"]
    assert no_new.tokens.shape == (len(PROMPTS), max(len(p) for p in PROMPTS))
    assert no_new.tokens[:, :3].tolist() == [[5, 9, 17], [3, 4, 5], [60, 2, PAD], [11, 12, 13]]
    assert not no_new.response_mask.any() and (no_new.response_lengths == 0).all()


def test_the_decode_loop_reads_the_device_once_every_16_steps(layout):
    """Prompt lengths are known on the host, and "every row is done" is read once every
    ``STOP_CHECK_INTERVAL`` steps (before: twice a token); plus one read to cut the result."""
    from loggra_megatron.rollout.protocol import rollout_stats
    from loggra_megatron.rollout.static.generate import STOP_CHECK_INTERVAL

    results, _ = layout
    for r in results:
        long = r["long"]
        steps = max(len(p) for p in PROMPTS) + 25 - min(len(p) for p in PROMPTS)
        assert long.decode_steps == steps and STOP_CHECK_INTERVAL == 16
        assert long.host_syncs == -(-steps // STOP_CHECK_INTERVAL) + 1
        stats = rollout_stats(long, 1.0, 0)
        assert stats["rollout/host_syncs_per_token"] == long.host_syncs / steps < 0.15


def test_one_prefill_per_prompt(layout):
    """A GRPO group's rows share one prefill (the KV cache of its first row copied to the
    others): greedy and seeded tokens equal the uncached decode's, which shares nothing, and
    the group's greedy rows equal the prompt's own greedy decode; counted in
    ``rollout/prefill_tokens`` against ``rollout/prompt_tokens``."""
    from loggra_megatron.rollout.protocol import rollout_stats

    results, _ = layout
    for r in results:
        for how in ("greedy", "sampled"):
            shared = r[f"groups_{how}"]
            _assert_same(shared, r[f"groups_{how}_nocache"], atol=1e-5)
            _assert_same(shared, r[f"groups_{how}_unshared"], atol=1e-5)
            assert shared.prefill_tokens == 2 * len(PROMPTS[0])  # 2 prompts, not 6 rows
            assert r[f"groups_{how}_unshared"].prefill_tokens == 6 * len(PROMPTS[0])
        greedy = _responses(r["greedy"])
        assert _responses(r["groups_greedy"]) == [greedy[0]] * 3 + [greedy[1]] * 3
        assert r["greedy"].prefill_tokens == len(PROMPTS) * 2  # distinct prompts: no sharing
        stats = rollout_stats(r["groups_sampled"], 1.0, 0)
        assert stats["rollout/prefill_tokens"] == 6
        assert stats["rollout/prompt_tokens"] == 3 * (len(PROMPTS[0]) + len(PROMPTS[1])) == 24


def test_temperature_sampling_is_reproducible_per_seed_and_step(tp1):
    r = tp1[0]
    _assert_same(r["sampled"], r["sampled_again"])
    assert not torch.equal(r["sampled"].tokens, r["greedy"].tokens)
    assert not torch.equal(r["sampled"].tokens, r["sampled_next_step"].tokens)


def test_tiny_top_p_is_greedy(layout):
    results, _ = layout
    for res in results:
        _assert_same(res["top_p_tiny"], res["greedy"], atol=1e-5)


def test_sample_tokens_top_p_nucleus_and_generator():
    logits = torch.tensor([[2.0, 1.5, 1.0, -1.0]]).log_softmax(-1).expand(4000, 4)
    gen = sampling_generator(1, 2, 0)
    # Probabilities ~ [.48, .29, .18, .04]: top_p = .6 keeps exactly the first two tokens.
    ids = sample_tokens(logits, temperature=1.0, top_p=0.6, generator=gen)
    assert set(ids.tolist()) == {0, 1}
    assert abs((ids == 0).float().mean().item() - 0.48 / 0.77) < 0.05
    assert torch.equal(sample_tokens(logits, temperature=0.0), torch.zeros(4000, dtype=torch.long))
    a = sample_tokens(logits, generator=sampling_generator(1, 2, 0))
    b = sample_tokens(logits, generator=sampling_generator(1, 2, 0))
    c = sample_tokens(logits, generator=sampling_generator(1, 2, 1))  # another DP rank
    assert torch.equal(a, b) and not torch.equal(a, c)

"""LoGRA as published (``--loggra-sketch backward``) inside Megatron-Core: the sketch formed in
the backward pass equals ``G Aᵀ`` of the dense gradient that is never formed, at TP, SP, PP,
DP, gradient accumulation and recompute; updates are TP/DP invariant; no grad buffer for a
target; save → resume is bitwise."""

import backward_sketch_runs as runs
import pytest
import torch

from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron


def _check_exact(results):
    for r in results:
        assert r["not_frozen"] == []
        assert r["errors"], "no target was sketched"
        worst = max(r["errors"].values())
        assert worst < 1e-6, r["errors"]
        # the targets are in no DDP grad buffer: it shrank by their fp32 bytes (up to
        # Megatron's bucket padding)
        saved = r["dense_grad_buffer_bytes"] - r["grad_buffer_bytes"]
        assert 0.95 * 4 * r["target_numel"] <= saved <= 4 * r["target_numel"]


@pytest.mark.parametrize(
    "extra",
    [{}, dict(recompute=True, hidden_size=27, heads=3, kv_channels=10)],
    ids=["even", "odd_rows_recompute"],
)
def test_sketch_reduced_per_microbatch_equals_dense_gradient_times_projection_dp2(extra):
    """``--loggra-sketch-reduce microbatch``: each layer's rows are reduce-scattered in its
    backward hook (2 micro-batches per rank; hidden 27 gives odd row counts (proj, fc2), so the padded
    split and full recompute are covered), and a rank holds its own rows of ``S`` only."""
    results = run_distributed(runs.sketch_vs_dense, 2, reduce="microbatch", **extra)
    _check_exact(results)
    for r in results:
        rows_per_rank = r["target_rows"] / 2
        assert rows_per_rank * runs.RANK <= r["sketch_buffer_numel"]
        assert r["sketch_buffer_numel"] <= (rows_per_rank + 4) * runs.RANK  # 4 targets padded


def test_sketch_equals_dense_gradient_times_projection_tp1_accumulated():
    _check_exact(run_distributed(runs.sketch_vs_dense, 1))  # 4 rows in 4 micro-batches


def test_sketch_equals_dense_gradient_times_projection_dp2():
    results = run_distributed(runs.sketch_vs_dense, 2)
    _check_exact(results)
    for r in results:  # --loggra-sketch-reduce step: every rank sums all rows
        assert r["sketch_buffer_numel"] == r["target_rows"] * runs.RANK


def test_sketch_equals_dense_gradient_times_projection_tp2_sequence_parallel():
    _check_exact(run_distributed(runs.sketch_vs_dense, 2, tp=2, sequence_parallel=True))


def test_sketch_equals_dense_gradient_times_projection_te_fused_norm_linear_tp2_sp():
    """TE's LayerNormLinear (qkv, fc1) is sketched from the normalized input it multiplies,
    not from the raw input its forward hook receives."""
    results = run_distributed(
        runs.sketch_vs_dense, 2, tp=2, sequence_parallel=True, fused_norm=True
    )
    _check_exact(results)
    assert any("linear_qkv" in name for name in results[0]["errors"])


def test_sketch_equals_dense_gradient_times_projection_dp2_packed():
    _check_exact(run_distributed(runs.sketch_vs_dense, 2, sequence_packing=True))


def test_sketch_equals_dense_gradient_times_projection_tp2():
    _check_exact(run_distributed(runs.sketch_vs_dense, 2, tp=2))


def test_sketch_equals_dense_gradient_times_projection_pp2():
    _check_exact(run_distributed(runs.sketch_vs_dense, 2, pp=2))


def test_sketch_equals_dense_gradient_times_projection_full_recompute():
    _check_exact(run_distributed(runs.sketch_vs_dense, 1, recompute=True))


def _max_rel(a, b):
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)


@pytest.fixture(scope="module")
def single_rank():
    return run_distributed(runs.train, 1)[0]


def test_dp2_update_equals_dp1(single_rank):
    results = run_distributed(runs.train, 2)
    assert _max_rel(results[0]["params"], single_rank["params"]) < 1e-5
    assert results[0]["norms"] == pytest.approx(single_rank["norms"], rel=1e-5)
    # each DP rank keeps RowAdam state for its own rows only: 4 bytes per row, exactly
    assert results[0]["rows"] + results[1]["rows"] == single_rank["rows"]
    for r in (*results, single_rank):
        assert r["sketch_state_bytes"] == 4 * r["rows"] > 0
    assert torch.equal(results[0]["signs"], results[1]["signs"])


def test_dp2_update_reduced_per_microbatch_equals_dp1(single_rank):
    results = run_distributed(runs.train, 2, loggra_sketch_reduce="microbatch")
    assert _max_rel(results[0]["params"], single_rank["params"]) < 1e-5
    assert results[0]["norms"] == pytest.approx(single_rank["norms"], rel=1e-5)


def test_dp2_update_equals_dp1_with_rows_dp_does_not_divide():
    """Hidden 27: proj and fc2 have 27 rows, so the ranks own 14 and 13 and the weights are
    all-gathered through a padded buffer (the others in place)."""
    odd = dict(hidden_size=27, heads=3, kv_channels=10)
    (one,) = run_distributed(runs.train, 1, **odd)
    results = run_distributed(runs.train, 2, **odd)
    assert _max_rel(results[0]["params"], one["params"]) < 1e-5
    assert results[0]["rows"] + results[1]["rows"] == one["rows"]


def test_tp2_sequence_parallel_update_equals_tp1(single_rank):
    results = run_distributed(runs.train, 2, tp=2, sequence_parallel=True)
    assert _max_rel(results[0]["params"], single_rank["params"]) < 1e-5
    assert results[0]["norms"] == pytest.approx(single_rank["norms"], rel=1e-5)


@pytest.mark.parametrize("bf16", [False, True])
def test_dp2_save_resume_is_bitwise(tmp_path, bf16):
    kw = dict(loggra_param_remainders=True) if bf16 else {}
    results = run_distributed(runs.resume, 2, str(tmp_path / "ckpt"), bf16=bf16, **kw)
    for r in results:
        straight, resumed = r["straight"], r["resumed"]
        for name, p in straight["params"].items():
            assert torch.equal(resumed["params"][name], p), name
        assert resumed["norms"] == straight["norms"][2:]
    # the projection is drawn again, not saved: only masters and row moments are stored
    from megatron.core import dist_checkpointing

    (iteration,) = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("iter_")]
    keys = dist_checkpointing.load_tensors_metadata(str(iteration)).keys()
    sketch_keys = sorted(k for k in keys if "loggra_sketch" in k)
    assert sketch_keys and {k.rpartition(".")[2] for k in sketch_keys} == {
        "fp32_param",
        "exp_avg_sq",
    }


def test_kl_control_trial_is_the_commit_and_restores_theta_dp2_bf16_remainders():
    for rank_result in run_distributed(runs.kl_trial, 2):
        for step in rank_result.values():
            assert step["restored_equal"] and step["commit_equals_trial"]
            assert step["full_moved"] > 0 and step["sq_norm"] > 0


def test_nonfinite_sketch_skips_the_step_and_changes_nothing():
    for r in run_distributed(runs.nonfinite_skip, 2):
        assert not r["ok"] and r["unchanged"] and r["num_steps"] == 0
        assert all(not s["exp_avg_sq"].any() for s in r["state"].values())

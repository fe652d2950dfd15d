"""The published RL recipe's optimizer options inside Megatron-Core (relative ε, per-weight
norm restoration, the update ratio, ``--freeze-non-targets``): their whole-weight and
all-target sums cross DP and TP as the formulas ask, so DP=2 and TP=2 (sequence parallel)
equal one rank; non-targets stay untouched and hold no optimizer. Ranks whose projections
would differ are refused at start-up."""

import backward_sketch_runs as runs
import pytest

from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron

RECIPE = dict(
    loggra_row_relative_eps=True,
    loggra_row_restore_norm=True,
    loggra_update_ratio=1e-3,
    freeze_non_targets=True,
)
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _max_rel(a, b):
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)


@pytest.fixture(scope="module")
def one_rank():
    return run_distributed(runs.train, 1, **RECIPE)[0]


def test_recipe_dp2_equals_dp1(one_rank):
    results = run_distributed(runs.train, 2, **RECIPE)
    assert _max_rel(results[0]["params"], one_rank["params"]) < 1e-5
    assert results[0]["norms"] == pytest.approx(one_rank["norms"], rel=1e-5)


def test_recipe_tp2_sequence_parallel_equals_tp1(one_rank):
    results = run_distributed(runs.train, 2, tp=2, sequence_parallel=True, **RECIPE)
    assert _max_rel(results[0]["params"], one_rank["params"]) < 1e-5
    assert results[0]["norms"] == pytest.approx(one_rank["norms"], rel=1e-5)


def test_freeze_non_targets_trains_the_targets_only(one_rank):
    (start,) = run_distributed(runs.train, 1, steps=0, **RECIPE)
    for name, before in start["params"].items():
        after = one_rank["params"][name]
        if any(f"{t}.weight" in name for t in TARGETS):
            assert not after.equal(before), f"{name} did not train"
        else:
            assert after.equal(before), f"{name} changed although frozen"
    # no dense leaf: the only optimizer state is RowAdam's 4 bytes per row
    assert one_rank["state_bytes"] == one_rank["sketch_state_bytes"] == 4 * one_rank["rows"]


def test_ranks_that_draw_another_projection_are_refused_at_start_up():
    with pytest.raises(RuntimeError) as failed:
        run_distributed(runs.mismatched_projection, 2)
    message = str(failed.value)
    assert message.count("drew another first projection") == 2, message


def test_a_grown_trial_is_the_commit_under_the_update_ratio_dp2_bf16_remainders():
    """Predicted-KL control may grow a step (η up to --kl-max-step-scale): under the update
    ratio the commit at η = 2.5 is the trial at η = 2.5 bit for bit."""
    recipe = {k: v for k, v in RECIPE.items() if k != "freeze_non_targets"}
    for rank_result in run_distributed(runs.kl_trial, 2, scale=2.5, **recipe):
        for step in rank_result.values():
            assert step["restored_equal"] and step["commit_equals_trial"]
            assert step["full_moved"] > 0 and step["sq_norm"] > 0

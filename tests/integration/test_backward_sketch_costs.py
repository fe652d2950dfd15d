"""The backward sketch's smaller costs (``optim/megatron/backward_sites.py``): a Rademacher
projection is drawn once per site and update, whatever the micro-batches, recomputations, KL
trials and Gram forms that use it; the row-parallel rows are summed over TP in one
all-reduce, equal to one per site; the sequence-parallel collectives of ``P`` run
asynchronously and give the sketch the synchronous ones give."""

import pytest
import sketch_cost_runs as runs

from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron


def _phases(sites, trials=3):
    """Draws per phase of one update before the cache (4 micro-batches, ``trials`` trials)."""
    return {"backward": 4 * sites, "prepare": 0, "trials": trials * sites, "sq_norm": sites}


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full_recompute"])
def test_one_draw_per_site_and_update(recompute):
    """The micro-batches' forwards (or recomputations), the update ratio's Gram form, 3 KL
    trials, ``‖Δθ‖²`` and the commit share one draw per site (drawing at each use, as a
    Gaussian ``B`` still does: 4·8 in the forwards, 8 for the ratio, 8 per trial, 8 for
    ``‖Δθ‖²``, 8 for the commit, 80 in all)."""
    (r,) = run_distributed(runs.draws_per_step, 1, recompute=recompute, loggra_update_ratio=1e-3)
    sites = r["sites"]
    assert sites == 8  # 2 layers × 4 targets
    for phases in r["steps"]:
        assert phases == {"backward": sites, "prepare": 0, "trials": 0, "sq_norm": 0, "commit": 0}
    assert r["draws"] == 2 * sites
    assert r["held_after_step"] == 0  # the step drops the update's projections


def test_gaussian_projections_are_drawn_at_each_use():
    """A Gaussian ``B`` has no 1-bit form: it is not kept, and each use draws it."""
    (r,) = run_distributed(runs.draws_per_step, 1, steps=1, loggra_sketch_matrix="gaussian")
    sites = r["sites"]
    assert r["steps"] == [{**_phases(sites), "commit": sites}]
    assert r["draws"] == sum(r["steps"][0].values())


@pytest.fixture(scope="module")
def tp2_sp():
    return run_distributed(runs.tp_costs, 2, tp=2, sequence_parallel=True)


def _check_one_all_reduce(results):
    for r in results:
        assert r["row_parallel_last"]
        assert r["reduced_equal"] and r["reduced_changed"]
        assert r["all_reduces"] == (r["row_parallel_sites"], 1) == (4, 1)


def test_row_parallel_rows_are_summed_over_tp_in_one_all_reduce(tp2_sp):
    _check_one_all_reduce(tp2_sp)


def test_one_all_reduce_with_dp_segments_and_rows_dp_does_not_divide():
    """TP=2 × DP=2 with the distributed optimizer: 2 segments, and hidden 27 gives proj and
    fc2 27 rows (14 and 13 per segment: a zero padding row inside the reduced view)."""
    odd = dict(hidden_size=27, heads=2, kv_channels=10)
    _check_one_all_reduce(run_distributed(runs.tp_costs, 4, tp=2, **odd))


def test_async_sequence_parallel_collectives_leave_the_sketch_unchanged(tp2_sp):
    for r in tp2_sp:
        assert r["async_equals_sync"]
        # 8 targets × 4 micro-batches, asynchronous in the first backward, not in the second
        assert r["async_collectives"] == r["sync_collectives"] == 32

"""Length-grouped micro-batches (``--length-grouping``): rows of similar length share
a micro-batch cut to its longest row; the loss, the gradients, the update and the log-probs
are those of the micro-batches in row order, to float round-off."""

import pytest
import torch
from grpo_update_runs import ROWS_PER_RANK, SEQ, VOCAB, mixed_length_batch, one_update

from loggra_megatron.model.batching import (
    LENGTHS,
    ROWS,
    PaddingStats,
    micro_batches,
    needed_lengths,
    row_indices,
    scatter_rows,
)
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def test_needed_lengths_and_grouped_micro_batches():
    batch = mixed_length_batch(0)
    lengths = needed_lengths(batch["mask"])
    assert lengths.tolist() == [32, 5, 17, 4, 29, 8, 12, 6]
    micro = micro_batches(batch, 3, lengths)
    assert [m[ROWS].tolist() for m in micro] == [[0, 4, 2], [6, 5, 7], [1, 3]]
    assert [m["tokens"].shape[1] - 1 for m in micro] == [32, 12, 5]
    assert all(m["mask"].shape[1] == m["tokens"].shape[1] - 1 for m in micro)
    for m in micro:  # every row keeps all its targets
        assert int(m["mask"].sum()) == int(batch["mask"][m[ROWS]].sum())
    plain = micro_batches(batch, 3, lengths, group=False)
    assert all(ROWS not in m and m["tokens"].shape[1] == SEQ + 1 for m in plain)
    assert torch.equal(torch.cat([m[LENGTHS] for m in plain]), lengths)
    # results in the batch's row order, zeros past each micro-batch's width
    parts = [m["tokens"][:, 1:].float() for m in micro]
    back = scatter_rows(parts, row_indices(micro), ROWS_PER_RANK, SEQ)
    assert torch.equal(back, batch["tokens"][:, 1:].float())
    assert torch.equal(row_indices(plain)[1], torch.tensor([3, 4, 5]))


def test_padding_stats():
    stats = PaddingStats()
    assert stats.fraction == 0.0
    stats.count({"tokens": torch.zeros(2, 9), LENGTHS: torch.tensor([8, 2])})
    assert stats.fraction == pytest.approx(6 / 16)
    stats.count({"tokens": torch.zeros(1, 9)})  # no lengths: all real
    assert stats.fraction == pytest.approx(6 / 24)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_grouped_micro_batches_give_todays_loss_update_and_log_probs(aggregation):
    """DP=2, 8 rows per rank of 4 … 32 positions, micro-batches of 2: the loss, the gradient
    norm, every weight's update (relative), the log-probs of the forward-only pass and KL
    control's kept reference agree with the micro-batches in row order to 1e-6 (each
    weight's update, a difference of fp32 sums over other micro-batch splits, to 1e-5)."""
    plain = run_distributed(one_update, 2, "plain", aggregation)
    grouped = run_distributed(one_update, 2, "grouped", aggregation)
    for p, g in zip(plain, grouped, strict=True):
        mp, mg = p["metrics"], g["metrics"]
        assert abs(mg["loss/total"] - mp["loss/total"]) < 1e-6
        assert abs(mg["grad/norm"] - mp["grad/norm"]) < 1e-6 * mp["grad/norm"]
        assert mg["throughput/padded_token_fraction"] < 0.5 * mp["throughput/padded_token_fraction"]
        for name, ref in p["delta"].items():
            assert ref.norm() > 0, name
            err = ((g["delta"][name] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, f"{name}: {err:.2e}"  # measured ≤ 1.6e-6 (fp32 sums)
        m = p["mask"]
        assert (g["log_probs"][m] - p["log_probs"][m]).abs().max() < 1e-6
        rp, rg = p["reference"], g["reference"]
        assert rg.logits.shape == rp.logits.shape == (3, SEQ, VOCAB)
        keep = rp.mask
        assert (rg.logits[keep] - rp.logits[keep]).abs().max() < 1e-5
        assert torch.equal(rg.targets[keep], rp.targets[keep])


def test_grouped_micro_batches_under_pipeline_parallelism():
    """PP=2: the micro-batches of one schedule call are padded to the longest of them (the
    stages exchange activations of one shape); loss, update and log-probs as in row order."""
    plain = run_distributed(one_update, 2, "plain", "token_mean", pp=2)
    grouped = run_distributed(one_update, 2, "grouped", "token_mean", pp=2)
    last = grouped[1]
    assert abs(last["metrics"]["loss/total"] - plain[1]["metrics"]["loss/total"]) < 1e-6
    m = last["mask"]
    assert (last["log_probs"][m] - plain[1]["log_probs"][m]).abs().max() < 1e-6
    for p, g in zip(plain, grouped, strict=True):
        for name, ref in p["delta"].items():
            err = ((g["delta"][name] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, f"{name}: {err:.2e}"

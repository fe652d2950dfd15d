"""The backward sketch's weight sync over DP (``optim/megatron/backward_row_gather.py``) on 2 CPU
ranks: one bucketed all-gather per bucket gives the weights of the former one per weight bit
for bit, in as many bytes, with row counts DP does and does not divide; with
``--overlap-param-gather`` the buckets' gathers are pipelined (two in flight at most) and all
finished when the sync returns, so every reader (a forward, ``state_dict``, a checkpoint save,
the stepper's trials and restore) sees the gathered weights: training, evaluation and
predicted-KL steps are those without overlap, bit for bit, and so is every metric of
``pretrain_rl.py``."""

import pytest
import torch
import weight_sync_runs as runs

from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bucketed_sync_equals_per_weight_sync_bitwise_with_uneven_rows():
    for r in run_distributed(runs.bucketed_vs_per_weight, 2):
        assert r["uneven"] and len(r["uneven"]) < r["targets"]  # both splits are covered
        assert r["old_is_truth"]  # the reference gathers every rank's rows
        assert r["new_equals_old"]
        assert r["async_equals_old"]
        assert r["pending_until_finished"] and r["untouched_while_pending"]
        calls, nbytes = r["per_weight"]
        assert calls == r["targets"]
        assert r["bucketed"] == (1, nbytes)  # one collective, the same bytes
        assert r["gather_nbytes"] == nbytes
        # with a smaller cap: one collective per bucket, the same bytes and weights
        sizes = r["capped_sizes"]
        assert sum(sizes) == r["targets"] and 1 < max(sizes) < r["targets"]
        assert r["capped"] == (len(sizes), nbytes)
        assert r["capped_equals_old"]


@pytest.fixture(scope="module")
def without_overlap():
    return run_distributed(runs.overlapped_steps, 2, overlap=False)


def test_overlapped_weight_sync_trains_as_the_synchronous_one(without_overlap, tmp_path):
    root = str(tmp_path / "ckpt")
    overlapped = run_distributed(runs.overlapped_steps, 2, overlap=True, checkpoint=root)
    loaded = run_distributed(runs.load_weights, 2, root)
    for on, off, weights in zip(overlapped, without_overlap, loaded, strict=True):
        assert not any(off["pending"]) and not any(on["pending"])  # finished by the sync
        assert on["max_in_flight"] == 2 and off["max_in_flight"] == 0  # pipelined: 2 at most
        assert 1 < len(on["buckets"]) < sum(on["buckets"])  # several buckets, some shared
        assert on["losses"] == off["losses"]
        # after each commit, before any forward: the weights are the gathered ones
        for raw_on, raw_off, read in zip(on["raw"], off["raw"], off["state_dict"], strict=True):
            assert _equal(raw_off, read) and _equal(raw_on, read)
        assert on["eval_losses"] == off["eval_losses"]
        for read_on, read_off in zip(on["state_dict"], off["state_dict"], strict=True):
            assert _equal(read_on, read_off)
        # predicted-KL: trials, restore and the commit at η see the gathered weights
        for key in ("trial", "restored", "trial_half", "committed"):
            assert _equal(on[key], off[key]), key
        assert not on["pending_after_kl_commit"] and not on["before_save_pending"]
        # a checkpoint saved right after a commit holds the gathered weights
        assert _equal(weights, on["saved"])


def test_pretrain_rl_with_overlapped_param_gather_equals_without(tokenizer, tmp_path):
    """``pretrain_rl.py`` at DP = 2, the backward sketch with remainders and a checkpoint at
    step 2 (2 updates per RL step): with ``--overlap-param-gather`` (the next update's and
    rollout's forwards and the save read the weights after an overlapped commit) every
    metric equals the run without it."""
    from rl_runs import tiny_argv, torchrun

    from loggra_megatron.metrics import read_metrics

    settings = {
        "loggra-sketch": "backward",
        "train-iters": 3,
        "bf16": True,
        "kl-coef": 0.01,
        "grad-reduce-in-bf16": True,
        "loggra-param-remainders": True,
        "save-interval": 2,
        "overlap-grad-reduce": True,
    }
    for name, overlap in (("on", True), ("off", False)):
        flags = {**settings, "overlap-param-gather": overlap, "save": tmp_path / name}
        torchrun(tiny_argv(tokenizer, **flags))
    on, off = read_metrics(tmp_path / "on"), read_metrics(tmp_path / "off")
    volatile = ("time/", "throughput/", "memory/")
    assert len(on) == len(off) == settings["train-iters"]
    for a, b in zip(on, off, strict=True):
        for key in a:
            if not key.startswith(volatile):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])

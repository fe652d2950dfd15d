"""Saving and resuming LoGRA and dense Adam inside Megatron-Core's optimizers (real GPTModel,
CPU/gloo ranks): resume equals never stopping, resharding over DP, overlapped param
gathers, garbage in Megatron's padding, and a checkpoint of another TP size refused.
"""

import pytest
import torch
from megatron_optimizer_runs import build, gathered_params, max_rel_diff, train

from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def test_checkpoint_resume_equals_uninterrupted_and_reshards_over_dp(tmp_path):
    kw = dict(loggra_update_interval=2)
    full = run_distributed(train, 2, "loggra", 6, **kw)
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train, 2, "loggra", 3, save=(ckpt, 3), **kw)
    resumed = run_distributed(train, 2, "loggra", 3, load=ckpt, **kw)
    for r in range(2):
        for k, v in full[r]["params"].items():
            assert torch.equal(resumed[r]["params"][k], v), k
    resharded = run_distributed(train, 1, "loggra", 3, load=ckpt, **kw)[0]
    assert max_rel_diff(resharded["params"], full[0]["params"]) <= 1e-4


@pytest.mark.parametrize("kind", ["loggra", "dense"])
def test_overlap_param_gather_saves_the_updated_weights(tmp_path, kind):
    """With --overlap-param-gather the all-gather of the updated weights waits for the next
    forward, so a rank's copy of the shards other DP ranks own is one step old: the save
    gathers first, and save -> resume equals never stopping."""
    full = run_distributed(train, 2, kind, 4, overlap=True)
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train, 2, kind, 2, overlap=True, save=(ckpt, 2))
    resumed = run_distributed(train, 2, kind, 2, overlap=True, load=ckpt)
    for r in range(2):
        for k, v in full[r]["params"].items():
            assert torch.equal(resumed[r]["params"][k], v), k


def test_dense_adam_distributed_optimizer_saves_and_resumes_exactly(tmp_path):
    """Megatron's dense Adam (DistributedOptimizer, DP=2): save -> resume equals never
    stopping (megatron-core 0.16's default sharding could not be saved at all), and the
    checkpoint loads at DP=1."""
    full = run_distributed(train, 2, "dense", 6)
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train, 2, "dense", 3, save=(ckpt, 3))
    resumed = run_distributed(train, 2, "dense", 3, load=ckpt)
    for r in range(2):
        for k, v in full[r]["params"].items():
            assert torch.equal(resumed[r]["params"][k], v), k
    resharded = run_distributed(train, 1, "dense", 3, load=ckpt)[0]
    assert max_rel_diff(resharded["params"], full[0]["params"]) <= 1e-4


class _TorchWithNanEmpty:
    """``torch`` for Megatron's distrib_optimizer module whose ``empty`` returns NaN, as
    uninitialised memory may (it fills the padding entries of the dp_reshardable state)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.full_like(torch.empty(*args, **kwargs), float("nan"))


def _dense_with_nan_padding(rank, steps, save=None, load=None):
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    from loggra_megatron.optim.megatron import optimizer_state

    distrib_optimizer.torch = _TorchWithNanEmpty()
    padding = []
    zero_padding = optimizer_state.zero_padding

    def spy(state):  # count the padding entries the save and the load see
        if isinstance(state, dict) and optimizer_state._is_padding(state):
            padding.append(state)
        zero_padding(state)

    optimizer_state.zero_padding = spy
    result = train(rank, "dense", steps, save=save, load=load)
    return {**result, "padding_entries": len(padding)}


def test_dense_adam_saves_and_resumes_with_garbage_in_megatron_padding(tmp_path):
    """Megatron's dp_reshardable buckets pad the gaps between params with ``torch.empty``;
    NaN there (uninitialised memory) must neither refuse the save nor the load, and resume
    stays exact (megatron-core 0.19 refused)."""
    full = run_distributed(train, 2, "dense", 4)
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_dense_with_nan_padding, 2, 2, save=(ckpt, 2))
    assert sum(r["padding_entries"] for r in saved) > 0, "no padding: the test lost its case"
    resumed = run_distributed(_dense_with_nan_padding, 2, 2, load=ckpt)
    for r in range(2):
        for k, v in full[r]["params"].items():
            assert torch.equal(resumed[r]["params"][k], v), k


def _load_refused(rank, ckpt):
    from loggra_megatron.checkpointing import load_checkpoint

    ddp, opt = build("loggra", True)
    before = gathered_params(ddp)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1.*this run has 2"):
        load_checkpoint(ckpt, [ddp], opt)
    after = gathered_params(ddp)
    assert all(torch.equal(before[k], after[k]) for k in before)
    return True


def test_checkpoint_with_different_tp_is_refused_before_anything_changes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train, 2, "loggra", 1, save=(ckpt, 1))
    assert run_distributed(_load_refused, 2, ckpt, tp=2) == [True, True]

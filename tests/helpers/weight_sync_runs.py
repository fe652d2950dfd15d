"""Rank functions of ``tests/integration/test_backward_sketch_weight_sync.py``: the backward
sketch's weight sync over DP, one bucketed all-gather per model chunk (``row_gather.py``)
against the former one per weight, and with ``--overlap-param-gather`` (the gather left in
flight after a commit) against without."""

import backward_sketch_runs as runs
import torch

from loggra_megatron.optim.config import LoGRAConfig, OptimConfig

ODD = dict(hidden_size=27, heads=3, kv_channels=10)
"""Rows 90 (qkv), 27 (proj), 108 (fc1), 27 (fc2): DP = 2 divides some and not others."""


class GatherCounter:
    """Counts ``dist.all_gather_into_tensor`` calls and their output bytes while active."""

    def __init__(self):
        self.calls, self.bytes = 0, 0

    def __enter__(self):
        import torch.distributed as dist

        self._original = original = dist.all_gather_into_tensor

        def counted(out, inp, *args, **kwargs):
            self.calls += 1
            self.bytes += out.numel() * out.element_size()
            return original(out, inp, *args, **kwargs)

        dist.all_gather_into_tensor = counted
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_gather_into_tensor = self._original


def _scramble(leaf, truth):
    """Every target's rows: this rank's own from ``truth`` (the same on every rank), every
    other rank's overwritten with values only this rank has."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for site in leaf.sites[0]:
        lo, hi = site.owned_rows(leaf.segment)
        weight = site.weight.detach()
        weight.copy_(torch.randn(weight.shape, generator=gen).to(weight.dtype))
        weight[lo:hi].copy_(truth[site.name][lo:hi])


BUCKET_NUMEL = 4000
"""A bucket cap (gathered elements; ``ROW_GATHER_BUCKET_NUMEL`` scaled down) that puts some
targets of ``ODD`` in a bucket together and others alone (2430 to 2916 elements each at
DP = 2)."""


def bucketed_vs_per_weight(rank, bf16=True):
    """The same scrambled weights synced four ways (per weight; one bucket; one bucket,
    asynchronous and finished later; buckets of ``BUCKET_NUMEL``): the weights, the bytes
    and the collectives of each."""
    from loggra_megatron.optim.megatron.backward_row_gather import (
        gather_rows_per_weight,
        row_gathers,
    )

    ddp, opt = runs.build_sketched(*runs.settings(), bf16=bf16, **ODD)
    leaf = opt.chained_optimizers[-1]
    (sites,) = leaf.sites
    gen = torch.Generator().manual_seed(5)
    truth = {s.name: torch.randn(s.weight.shape, generator=gen).to(s.weight.dtype) for s in sites}

    def weights():
        return {s.name: s.weight.detach().clone() for s in sites}

    _scramble(leaf, truth)
    with GatherCounter() as per_weight:
        gather_rows_per_weight(sites, leaf.segment, leaf.dp_group)
    old = weights()
    _scramble(leaf, truth)
    with GatherCounter() as bucketed:
        leaf.sync_weights()
    new = weights()
    _scramble(leaf, truth)
    scrambled = weights()
    for gather in leaf.row_gathers:
        gather.start(async_op=True)
    pending, untouched = all(g.pending for g in leaf.row_gathers), weights()
    for gather in leaf.row_gathers:
        gather.finish()
    asynchronous = weights()
    _scramble(leaf, truth)
    capped = row_gathers(sites, leaf.segment, leaf.dp_group, BUCKET_NUMEL)
    with GatherCounter() as in_buckets:
        for gather in capped:
            gather.start()
    return {
        "old_is_truth": all(torch.equal(old[k], truth[k]) for k in truth),
        "new_equals_old": all(torch.equal(new[k], old[k]) for k in old),
        "async_equals_old": all(torch.equal(asynchronous[k], old[k]) for k in old),
        "capped_equals_old": all(torch.equal(s.weight.detach(), old[s.name]) for s in sites),
        "capped": (in_buckets.calls, in_buckets.bytes),
        "capped_sizes": [len(g.sites) for g in capped],
        "pending_until_finished": pending and not _pending(leaf),
        "untouched_while_pending": all(torch.equal(untouched[k], scrambled[k]) for k in old),
        "uneven": [s.name for s in sites if s.chunk * sites.segments != s.rows],
        "per_weight": (per_weight.calls, per_weight.bytes),
        "bucketed": (bucketed.calls, bucketed.bytes),
        "targets": len(sites.sites),
        "gather_nbytes": leaf.row_gathers[0].nbytes,
    }


def _build(overlap: bool):
    """The bf16 model with odd rows, the backward sketch, remainders and bf16 grads, DDP with
    bucketed grad reduction, ``overlap_param_gather`` on or off, and the weight sync's
    buckets capped at ``BUCKET_NUMEL``."""
    from loggra_megatron.optim.megatron import backward_optimizer
    from loggra_megatron.optim.megatron.backward_sites import prepare_model
    from loggra_megatron.optim.megatron.factory import build_loggra
    from loggra_megatron.testing import wrap_ddp

    optim = OptimConfig(
        optimizer="loggra", lr=3e-2, weight_decay=0.1, clip_grad=0.5, grad_reduce_in_bf16=True
    )
    loggra = LoGRAConfig(
        loggra_sketch="backward", loggra_rank=runs.RANK, loggra_seed=7, loggra_param_remainders=True
    )
    model = runs.model(bf16=True, **ODD)
    sites = prepare_model(model, optim, loggra)
    ddp = wrap_ddp(
        model,
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=True,
        overlap_param_gather=overlap,
        bucket_size=BUCKET_NUMEL,
    )
    backward_optimizer.ROW_GATHER_BUCKET_NUMEL = BUCKET_NUMEL  # this process only
    return ddp, build_loggra(optim, loggra, [ddp], [sites])


def _targets(ddp, leaf) -> dict:
    """The target weights as the model's ``state_dict`` gives them."""
    names = {id(s.weight): s.name for s in leaf.sites[0]}
    state = ddp.module.state_dict(keep_vars=True)
    return {names[id(t)]: t.detach().clone() for t in state.values() if id(t) in names}


def _pending(leaf) -> bool:
    """Whether a bucket's gather of the leaf's weight sync is still in flight."""
    return any(gather.pending for gather in leaf.row_gathers)


def _raw(leaf) -> dict:
    """The target weights read directly from the modules' parameters."""
    return {s.name: s.weight.detach().clone() for s in leaf.sites[0]}


def overlapped_steps(rank, overlap: bool, steps: int = 3, checkpoint: str | None = None):
    """``steps`` training steps, then a predicted-KL step through ``MegatronStepper`` (two
    trials, a restore, a commit at η = 0.5). After each commit, before any forward: whether a
    gather is left in flight, the weights read raw and through ``state_dict``, and a
    forward-only loss; ``checkpoint``: saved right after the last commit."""
    from loggra_megatron.checkpointing import save_checkpoint
    from loggra_megatron.optim.megatron.backward_row_gather import RowGather
    from loggra_megatron.optim.megatron.stepper import MegatronStepper
    from loggra_megatron.testing import train_step

    ddp, opt = _build(overlap)
    leaf = opt.chained_optimizers[-1]
    stepper = MegatronStepper(opt)
    in_flight, start = [0], RowGather.start

    def counting(gather, async_op=False):  # gathers in flight right after one starts
        start(gather, async_op)
        in_flight.append(sum(g.pending for g in leaf.row_gathers))

    RowGather.start = counting  # this process only
    batch, micro = runs.local_batch(runs.TOKENS)
    out = {"losses": [], "eval_losses": [], "pending": [], "raw": [], "state_dict": []}
    out["buckets"] = [len(gather.sites) for gather in leaf.row_gathers]

    def after_commit(forward_first: bool):
        out["pending"].append(_pending(leaf))
        out["raw"].append(_raw(leaf))
        ddp.start_param_sync(force_sync=True)  # Megatron's own (dense) gather, as a save does
        if forward_first:
            out["eval_losses"].append(train_step(ddp, opt, batch, micro, forward_only=True)[0])
        out["state_dict"].append(_targets(ddp, leaf))
        if not forward_first:
            out["eval_losses"].append(train_step(ddp, opt, batch, micro, forward_only=True)[0])

    for step in range(steps):
        loss, (ok, _, _) = train_step(ddp, opt, batch, num_microbatches=micro)
        assert ok
        out["losses"].append(loss)
        after_commit(forward_first=step % 2 == 0)
    opt.zero_grad()
    runs._backward(ddp, runs.TOKENS)
    assert stepper.prepare().ok
    with stepper.try_candidate(1.0):
        out["trial"] = runs.full_params(ddp)
    stepper.restore_model_weights()
    out["restored"] = runs.full_params(ddp)
    with stepper.try_candidate(0.5):
        out["trial_half"] = runs.full_params(ddp)
    stepper.commit(0.5)
    out["pending_after_kl_commit"] = _pending(leaf)
    stepper.finish_weight_sync()
    out["committed"] = runs.full_params(ddp)
    if checkpoint is not None:
        train_step(ddp, opt, batch, num_microbatches=micro)
        out["before_save_pending"] = _pending(leaf)
        save_checkpoint(checkpoint, steps + 2, [ddp], opt, common={"step": steps + 2})
        stepper.finish_weight_sync()
        out["saved"] = runs.full_params(ddp)
    out["max_in_flight"] = max(in_flight)
    return out


def load_weights(rank, checkpoint: str):
    """A fresh build (no overlap) that loads ``checkpoint``'s weights: every parameter."""
    from loggra_megatron.checkpointing import load_checkpoint

    ddp, opt = _build(overlap=False)
    load_checkpoint(checkpoint, [ddp], opt)
    return runs.full_params(ddp)

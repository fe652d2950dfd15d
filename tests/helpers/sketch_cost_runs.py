"""Rank functions of ``tests/integration/test_backward_sketch_costs.py``: how often the backward
sketch draws its projections, its one TP all-reduce of the row-parallel rows, and its
asynchronous sequence-parallel collectives, on the tiny GPT of ``backward_sketch_runs``."""

import backward_sketch_runs as runs
import torch


def _counting(module, name, record=lambda *args, **kwargs: True):
    """Wrap ``module.name`` to append ``record(*args, **kwargs)`` of every call:
    ``(the records, a function that restores it)``."""
    original, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return calls, lambda: setattr(module, name, original)


RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def draws_per_step(rank, steps=2, trials=3, recompute=False, **loggra):
    """Draws of the projections (``backward_sites.draw_signs`` calls) in each phase of ``steps``
    updates through ``MegatronStepper`` (backward of 4 micro-batches, prepare and norm,
    ``trials`` KL trials, ``‖Δθ‖²``, the commit): ``{"sites", "steps": [{phase: draws}],
    "draws": SketchSites.draws}``."""
    from loggra_megatron.optim.megatron import backward_sites
    from loggra_megatron.optim.megatron.stepper import MegatronStepper

    optim, config = runs.settings(**loggra)
    ddp, opt = runs.build_sketched(optim, config, **(RECOMPUTE if recompute else {}))
    stepper = MegatronStepper(opt)
    (sites,) = opt.chained_optimizers[-1].sites
    calls, restore = _counting(backward_sites, "draw_signs")
    out = []
    try:
        for _ in range(steps):
            phases, seen = {}, len(calls)

            def mark(phase, phases=phases):
                nonlocal seen
                phases[phase], seen = len(calls) - seen, len(calls)

            opt.zero_grad()
            runs._backward(ddp, runs.TOKENS)
            mark("backward")
            assert stepper.prepare().ok
            mark("prepare")
            for i in range(trials):
                with stepper.try_candidate(0.5 + 0.25 * i):
                    pass
                stepper.restore_model_weights()
            mark("trials")
            stepper.update_sq_norm()
            mark("sq_norm")
            stepper.commit(0.5)
            mark("commit")
            out.append(phases)
    finally:
        restore()
    return {
        "sites": len(sites.sites),
        "steps": out,
        "draws": sites.draws,
        "held_after_step": sites.signs_cache_bytes(),
    }


def tp_costs(rank, **overrides):
    """One backward at TP=2 (``overrides``: the model's, e.g. sequence parallelism): the
    row-parallel rows summed over TP per site (as ``prepare_grads`` did) and by
    ``SketchSites.all_reduce_row_parallel``, bitwise, with the all-reduces each issued; and
    the buffer from a backward whose sequence-parallel collectives are asynchronous against
    one whose are not, with how many of the hook's collectives were asynchronous."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from loggra_megatron.optim.megatron import backward_sites

    optim, loggra = runs.settings()
    ddp, opt = runs.build_sketched(optim, loggra, **overrides)
    leaf = opt.chained_optimizers[-1]
    (sites,) = leaf.sites
    group = parallel_state.get_tensor_model_parallel_group()
    asynchronous = lambda p, group, async_op=False: async_op  # noqa: E731
    issued, restores = [], []
    for name in ("_gather_tokens", "_scatter_sum"):
        calls, undo = _counting(backward_sites, name, asynchronous)
        issued.append(calls)
        restores.append(undo)
    buffers = {}
    try:
        for mode in (True, False):
            sites.async_collectives = mode
            leaf.zero_grad()
            runs._backward(ddp, runs.TOKENS)
            buffers[mode] = sites.buffer.clone()
    finally:
        for undo in restores:
            undo()
    unreduced = buffers[True]
    calls, restore = _counting(dist, "all_reduce")
    try:
        sites.buffer.copy_(unreduced)
        for site in sites:
            if not site.column_parallel:
                dist.all_reduce(sites.rows_view(site, leaf.segment), group=group)
        per_site, per_site_calls = sites.buffer.clone(), len(calls)
        sites.buffer.copy_(unreduced)
        sites.all_reduce_row_parallel(leaf.segment, group)
        one_calls = len(calls) - per_site_calls
    finally:
        restore()
    row_parallel = [s for s in sites if not s.column_parallel]
    return {
        "async_equals_sync": torch.equal(buffers[True], buffers[False]),
        "async_collectives": sum(c.count(True) for c in issued),
        "sync_collectives": sum(c.count(False) for c in issued),
        "reduced_equal": torch.equal(per_site, sites.buffer),
        "reduced_changed": not torch.equal(per_site, unreduced),
        "all_reduces": (per_site_calls, one_calls),
        "row_parallel_sites": len(row_parallel),
        "row_parallel_last": all(s.offset >= sites.row_parallel_offset for s in row_parallel)
        and all(s.offset < sites.row_parallel_offset for s in sites if s.column_parallel),
    }

"""LoGRA inside Megatron-Core's optimizers, with a real GPTModel on CPU/gloo ranks:
equivalence with dense Adam, DP/TP/PP sharding, bf16, non-finite steps and the LR scheduler
(saving and resuming: ``test_megatron_optimizer_checkpoint.py``).

hidden=40 (rows of 40 and 80 floats) makes the DistributedOptimizer's DP shard boundary
fall in the middle of a row, which is the hard case for exact DP sharding.
"""

import pytest
import torch
from megatron_optimizer_runs import (
    TOKENS,
    bf16_model,
    build,
    build_bf16_clipped,
    gathered_params,
    local_batch,
    max_rel_diff,
    train,
)

from loggra_megatron.testing import run_distributed, train_step, wrap_ddp

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def test_identity_loggra_equals_megatron_dense_adam_distributed_optimizer():
    dense = run_distributed(train, 2, "dense", 5)
    loggra = run_distributed(train, 2, "loggra", 5, loggra_projection="identity")
    assert loggra[0]["layouts"] or loggra[1]["layouts"]  # matrices took the sketch path
    for r in range(2):
        assert max_rel_diff(loggra[r]["params"], dense[r]["params"]) <= 1e-5
    assert dense[0]["losses"][-1] < dense[0]["losses"][0]


@pytest.mark.parametrize("projection", ["range_finder", "svd"])
def test_dp2_equals_dp1_across_refreshes(projection):
    # overlap_grad_reduce/overlap_param_gather with 1000-element buckets: one bucket per
    # weight, each split across the 2 DP ranks in its middle, mid-row for linear_qkv.
    # refreshes before steps 1, 3 and 5
    kw = dict(loggra_update_interval=2, loggra_projection=projection)
    dp1 = run_distributed(train, 1, "loggra", 5, **kw)[0]
    dp2 = run_distributed(train, 2, "loggra", 5, overlap=True, **kw)
    split = [lay for lay in dp2[0]["all_layouts"] if lay.split_rows()]
    assert split, "no DP shard boundary fell mid-row; the test lost its hard case"
    assert any(lay.rank < lay.shape[1] for lay in dp2[0]["all_layouts"])
    for r in range(2):
        assert max_rel_diff(dp2[r]["params"], dp1["params"]) <= 1e-4
    assert dp1["losses"][-1] < dp1["losses"][0]


def _expected_state_bytes(result) -> int:
    """2·rows·r + n·r fp32 per sketched slice + 2 int64, dense: 2 fp32 per element + 1 int64."""
    sketched = 0
    for lay in result["layouts"]:
        lo, hi = lay.touched_rows(result["dp_rank"])
        sketched += 4 * (2 * (hi - lo) * lay.rank + lay.shape[1] * lay.rank) + 2 * 8
    return sketched


def test_state_is_a_strict_dp_shard_and_matches_the_formula():
    dp1 = run_distributed(train, 1, "loggra", 1)[0]
    dp2 = run_distributed(train, 2, "loggra", 1)
    for res in [dp1, *dp2]:
        dense_numel = sum(
            p.numel()
            for n, p in res["params"].items()
            if "embedding" in n or "output" in n or p.dim() == 1
        )
        assert res["state_bytes"] > _expected_state_bytes(res)
        # the remainder is dense Adam state for this rank's slice of dense params only
        dense_bytes = res["state_bytes"] - _expected_state_bytes(res)
        assert dense_bytes < 8 * dense_numel + 16 * 64
    total2 = sum(r["state_bytes"] for r in dp2)
    assert 0.4 * dp1["state_bytes"] < dp2[0]["state_bytes"] < 0.6 * dp1["state_bytes"]
    assert total2 < 1.05 * dp1["state_bytes"]  # only split rows and shared bases duplicate


def _one_step_update(rank, tp_rank_layout=False):
    """Params before and after one LoGRA step (TP-gathered by the caller)."""
    from megatron.core import parallel_state

    ddp, opt = build("loggra", True, loggra_rank=3, loggra_oversample=2)
    before = gathered_params(ddp)
    batch, micro = local_batch(TOKENS[:2])
    train_step(ddp, opt, batch, num_microbatches=micro)
    after = gathered_params(ddp)
    return {
        "delta": {k: after[k] - before[k] for k in after},
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
    }


def _gather_tp(results, name):
    """Full (TP=1 layout) tensor from TP shards; SwiGLU fc1 shards are [gate; up] halves."""
    shards = [r["delta"][name] for r in sorted(results, key=lambda r: r["tp_rank"])]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    dim = 1 if ("linear_proj" in name or "linear_fc2" in name) else 0
    return torch.cat(shards, dim=dim)


def test_tp_invariance_claim_column_parallel_yes_row_parallel_no():
    tp1 = run_distributed(_one_step_update, 1)[0]
    tp2 = run_distributed(_one_step_update, 2, tp=2)
    for layer in (0, 1):
        prefix = f"decoder.layers.{layer}"
        for name in ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"):
            full = f"{prefix}.{name}"
            ref = tp1["delta"][full]
            assert ((_gather_tp(tp2, full) - ref).norm() / ref.norm()).item() < 1e-4, full
        for name in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
            full = f"{prefix}.{name}"
            ref = tp1["delta"][full]
            assert ((_gather_tp(tp2, full) - ref).norm() / ref.norm()).item() > 1e-2, full


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_tp2_and_pp2_train_with_loggra(tp, pp):
    results = run_distributed(train, 2, "loggra", 8, tokens=TOKENS, tp=tp, pp=pp)
    losses = [r["losses"] for r in results if r["losses"][0] is not None]
    assert losses and losses[0][-1] < 0.9 * losses[0][0]
    for r in results:  # each rank's sketches cover exactly its TP-local / stage-local weights
        local = {tuple(p.shape) for p in r["params"].values() if p.dim() == 2}
        assert r["layouts"] and all(lay.shape in local for lay in r["layouts"])
        assert r["state_bytes"] > 0
    if tp == 2:  # TP ranks hold different shards
        a, b = (r["params"]["decoder.layers.0.mlp.linear_fc1.weight"] for r in results)
        assert a.shape == b.shape and not torch.equal(a, b)
    else:  # PP stages hold different layers
        assert all(len(r["layouts"]) == 4 for r in results)  # 1 layer x (qkv, proj, fc1, fc2)


def test_replicated_megatron_optimizer_trains_and_matches_distributed():
    rep = run_distributed(train, 2, "loggra", 4, use_dist=False, loggra_update_interval=2)
    dist_ = run_distributed(train, 2, "loggra", 4, loggra_update_interval=2)
    assert max_rel_diff(rep[0]["params"], dist_[0]["params"]) <= 1e-4
    assert rep[0]["losses"][-1] < rep[0]["losses"][0]


def test_config_rejects_bad_loggra_fields():
    from loggra_megatron.optim import LoGRAConfig

    with pytest.raises(ValueError, match="--loggra-rank=0"):
        LoGRAConfig(loggra_rank=0)
    with pytest.raises(ValueError, match="--loggra-projection='galore'"):
        LoGRAConfig(loggra_projection="galore")
    with pytest.raises(ValueError, match="--loggra-update-interval=-1"):
        LoGRAConfig(loggra_update_interval=-1)


def _bf16_identity_vs_dense(rank, kind):
    """bf16 params, fp32 main params in the DistributedOptimizer: state after one step
    (later steps amplify bf16 rounding flips) and the losses of four."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.optim import LoGRAConfig, get_loggra_optimizer

    ddp = wrap_ddp(bf16_model())
    base = dict(optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True, clip_grad=1.0)
    if kind == "dense":
        opt = get_megatron_optimizer(OptimizerConfig(**base), [ddp])
    else:
        loggra = LoGRAConfig(
            loggra_sketch="gradient", loggra_min_dim=1, loggra_projection="identity"
        )
        opt = get_loggra_optimizer(OptimizerConfig(**base), [ddp], loggra)
    batch, micro = local_batch(TOKENS[:2])
    mains = [p for g in opt.optimizer.param_groups for p in g["params"]]
    losses = [train_step(ddp, opt, batch, num_microbatches=micro)[0]]
    first = {"params": gathered_params(ddp), "mains": [p.detach().clone() for p in mains]}
    losses += [train_step(ddp, opt, batch, num_microbatches=micro)[0] for _ in range(3)]
    return {
        **first,
        "losses": losses,
        "model_dtypes": {p.dtype for p in ddp.module.parameters()},
        "main_dtypes": {p.dtype for p in mains},
    }


def test_bf16_params_with_fp32_main_params_match_dense_adam():
    dense = run_distributed(_bf16_identity_vs_dense, 2, "dense")
    loggra = run_distributed(_bf16_identity_vs_dense, 2, "loggra")
    for r in range(2):
        assert loggra[r]["model_dtypes"] == {torch.bfloat16}
        assert loggra[r]["main_dtypes"] == {torch.float32}
        for a, b in zip(loggra[r]["mains"], dense[r]["mains"], strict=True):  # fp32 masters
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        for k, v in dense[r]["params"].items():  # a master's last bit may flip bf16 rounding
            torch.testing.assert_close(loggra[r]["params"][k], v, atol=1e-4, rtol=2**-7)
    assert loggra[0]["losses"][-1] < loggra[0]["losses"][0]


def _bf16_grads(rank, fp32_copy):
    """LoGRA (range finder, refreshes) on bf16 params with bf16 grad buffers, clipping
    active, with or without Megatron's fp32 copy of the gradient shards."""
    ddp, opt = build_bf16_clipped(
        loggra_rank=4, loggra_update_interval=2, loggra_fp32_grad_copy=fp32_copy
    )
    (leaf,) = opt.chained_optimizers
    inner = leaf.optimizer
    seen = []  # per step: (fp32 .grad bytes of 16-bit-model mains, dtypes handed over)
    inner_step = inner.step

    def observing_step():
        mains = [p for g in leaf.shard_fp32_from_float16_groups for p in g]
        fp32 = sum(p.grad.numel() * 4 for p in mains if p.grad is not None)
        seen.append((fp32, {g.dtype for g in inner.model_grads.values()}))
        inner_step()

    inner.step = observing_step
    batch, micro = local_batch(TOKENS[:2])
    norms, mains = [], [p for g in inner.param_groups for p in g["params"]]
    for _ in range(4):
        _, (ok, grad_norm, _) = train_step(ddp, opt, batch, num_microbatches=micro)
        assert ok
        norms.append(grad_norm)
    return {"mains": [p.detach().clone() for p in mains], "norms": norms, "seen": seen}


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_bf16_grads_reach_loggra_without_an_fp32_copy_and_give_the_same_steps(tp):
    # TP=2: replicated norm weights must be counted once in the grad norm
    copied = run_distributed(_bf16_grads, 2, True, tp=tp)
    streamed = run_distributed(_bf16_grads, 2, False, tp=tp)
    for r in range(2):
        assert all(fp32 > 0 and not dtypes for fp32, dtypes in copied[r]["seen"])
        assert all(fp32 == 0 and dtypes == {torch.bfloat16} for fp32, dtypes in streamed[r]["seen"])
        assert min(copied[r]["norms"]) > 0.05  # the clip was active on every step
        torch.testing.assert_close(streamed[r]["norms"], copied[r]["norms"], rtol=1e-5, atol=0)
        for a, b in zip(streamed[r]["mains"], copied[r]["mains"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _nan_on_one_rank_skips_everywhere(rank):
    from megatron.core import parallel_state

    ddp, opt = build("loggra", True)
    batch, micro = local_batch(TOKENS[:2])
    train_step(ddp, opt, batch, num_microbatches=micro)
    before = gathered_params(ddp)
    inner_before = {
        id(p): {k: v.clone() for k, v in opt.optimizer.state[p].items()}
        for p in opt.optimizer.state
    }
    if parallel_state.get_data_parallel_rank() == 0:  # poison one gradient element on rank 0
        original = opt.optimizer.step

        def poisoned_step():
            p = opt.optimizer.param_groups[0]["params"][0]
            p.grad.view(-1)[0] = float("nan")
            return original()

        opt.optimizer.step = poisoned_step
    train_step(ddp, opt, batch, num_microbatches=micro)
    after = gathered_params(ddp)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    state_unchanged = all(
        torch.equal(v, inner_before[id(p)][k])
        for p in opt.optimizer.state
        for k, v in opt.optimizer.state[p].items()
    )
    return unchanged, state_unchanged, opt.optimizer.skipped_last_step


def test_nonfinite_gradient_on_one_rank_skips_the_step_on_all_ranks():
    results = run_distributed(_nan_on_one_rank_skips_everywhere, 2)
    assert results == [(True, True, True), (True, True, True)]


def _scheduled(rank):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp, opt = build("loggra", True)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    batch, micro = local_batch(TOKENS[:2])
    before = gathered_params(ddp)
    train_step(ddp, opt, batch, num_microbatches=micro)  # lr = init_lr = 0: no change
    unchanged = all(torch.equal(before[k], v) for k, v in gathered_params(ddp).items())
    sched.step(1)
    lrs = {g["lr"] for g in opt.optimizer.param_groups}
    train_step(ddp, opt, batch, num_microbatches=micro)
    changed = any(not torch.equal(before[k], v) for k, v in gathered_params(ddp).items())
    return unchanged, lrs, changed


def test_megatron_lr_scheduler_drives_loggra():
    for unchanged, lrs, changed in run_distributed(_scheduled, 2):
        assert unchanged and changed
        assert len(lrs) == 1 and lrs.pop() == pytest.approx(5e-3)  # warm-up step 1 of 2

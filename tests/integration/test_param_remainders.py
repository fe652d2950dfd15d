"""fp32 master weights kept as bf16 weights + int16 remainders (--loggra-param-remainders).

The claim is exactness: given the same gradients, the masters rebuilt from weight and
remainder are bit for bit the fp32 masters of Megatron's layout, through refreshes,
clipping, predicted-KL trials and checkpoints, while the fp32 copies are freed.
"""

import gc
import weakref

import pytest
import torch

from loggra_megatron.optim.config import LoGRAConfig
from loggra_megatron.optim.param_remainders import join_master, store_master
from loggra_megatron.testing import run_distributed, tiny_bf16_gpt_model, wrap_ddp

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

HIDDEN, HEADS, VOCAB, SEQ = 40, 4, 64, 8


def _ties(master: torch.Tensor) -> torch.Tensor:
    """Elements whose low 16 bits are exactly half a bf16 ulp (where rounding rules differ)."""
    return (master.contiguous().view(torch.int32) & 0xFFFF) == 0x8000


def test_store_join_is_exact_and_rounds_to_nearest():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=gen) * torch.logspace(-30, 30, 100_000)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0e38, -3.0e38, 1.0, -1.0])])
    bits = x.view(torch.int32)
    x = torch.cat([x, (bits & ~0xFFFF | 0x8000).view(torch.float32)])  # forced ties
    # stored into views of larger buffers, as into the model's parameter buffer
    buffer = torch.full((len(x) + 2,), 7.0, dtype=torch.bfloat16)
    remainders = torch.full((len(x) + 2,), 7, dtype=torch.int16)
    weight, remainder = buffer[1:-1], remainders[1:-1]
    store_master(weight, remainder, x.clone())
    assert buffer[[0, -1]].tolist() == [7.0, 7.0] and remainders[[0, -1]].tolist() == [7, 7]
    assert torch.equal(join_master(weight, remainder).view(torch.int32), x.view(torch.int32))
    ties = _ties(x)
    assert ties.sum() >= 100_000
    assert torch.equal(weight[~ties], x[~ties].to(torch.bfloat16))  # round to nearest
    away = weight[ties].float().abs() > x[ties].abs()
    assert away.all()  # ties away from zero (not to even)
    error = (weight.float() - x).abs()
    ulp = (weight.float().abs() * 2**-7).clamp_min(2**-133)
    assert (error <= ulp / 2 * (1 + 1e-6)).all()
    with pytest.raises(TypeError, match="contiguous fp32 master"):
        store_master(weight, remainder, x.double())
    with pytest.raises(TypeError, match="bf16 weights and int16 remainders"):
        join_master(x, remainder)


def _bf16_ddp(grad_reduce_in_fp32=True):
    model = tiny_bf16_gpt_model(num_layers=2, hidden_size=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ)
    return wrap_ddp(model, grad_reduce_in_fp32=grad_reduce_in_fp32)


def _optimizer(ddp, remainders: bool, clip_grad: float, projection="range_finder", min_dim=1):
    from megatron.core.optimizer import OptimizerConfig

    from loggra_megatron.optim import get_loggra_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.01,
        bf16=True,
        use_distributed_optimizer=True,
        clip_grad=clip_grad,
    )
    loggra = LoGRAConfig(
        loggra_sketch="gradient",
        loggra_min_dim=min_dim,
        loggra_rank=4,
        loggra_oversample=2,
        loggra_update_interval=2,
        loggra_projection=projection,
        loggra_param_remainders=remainders,
    )
    return get_loggra_optimizer(config, [ddp], loggra)


def _set_grads(ddp, step: int) -> None:
    """The same (DP-reduced) gradients on every run: written into Megatron's grad buffer."""
    gen = torch.Generator().manual_seed(100 + step)
    ddp.zero_grad_buffer()
    for _, p in sorted(ddp.module.named_parameters()):
        p.main_grad.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _masters(opt) -> list[torch.Tensor]:
    inner = opt.optimizer
    return [inner.master_of(p).clone() for g in inner.param_groups for p in g["params"]]


def _fixed_grad_steps(rank, remainders, grad_reduce_in_fp32, clip_grad):
    """Three optimizer steps (refresh, plain, refresh) on fixed gradients."""
    ddp = _bf16_ddp(grad_reduce_in_fp32)
    opt = _optimizer(ddp, remainders, clip_grad)
    inner = opt.optimizer
    mains = [p for g in inner.param_groups for p in g["params"]]
    out = {"main_dtypes": {p.dtype for p in mains}, "steps": []}
    for step in range(3):
        _set_grads(ddp, step)
        assert opt.step()[0]
        out["steps"].append(_masters(opt))
    out["weights"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    out["remainder_bytes"] = sum(r.numel() * 2 for r in inner.param_remainders.values())
    out["master_bytes"] = sum(p.numel() * p.element_size() for p in mains)
    out["shards"] = [p.clone() for p in mains]
    return out


@pytest.mark.parametrize(
    ("grad_reduce_in_fp32", "clip_grad"),
    [(True, 0.0), (False, 0.05)],
    ids=["fp32grads", "bf16grads-clip"],
)
def test_masters_are_bitwise_those_of_fp32_master_copies(grad_reduce_in_fp32, clip_grad):
    fp32 = run_distributed(_fixed_grad_steps, 2, False, grad_reduce_in_fp32, clip_grad)
    rem = run_distributed(_fixed_grad_steps, 2, True, grad_reduce_in_fp32, clip_grad)
    for r in range(2):
        assert fp32[r]["main_dtypes"] == {torch.float32}
        assert rem[r]["main_dtypes"] == {torch.bfloat16}
        assert rem[r]["remainder_bytes"] * 2 == fp32[r]["master_bytes"]  # 2 B instead of 4
        for step in range(3):
            for a, b in zip(rem[r]["steps"][step], fp32[r]["steps"][step], strict=True):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"step {step}"
        last, first = rem[r]["steps"][2], rem[r]["steps"][0]
        moved = sum((a != b).sum().item() for a, b in zip(last, first, strict=True))
        assert moved > 1000  # the steps did change the masters
        for shard, master in zip(rem[r]["shards"], rem[r]["steps"][2], strict=True):
            ties = _ties(master)
            assert torch.equal(shard[~ties], master[~ties].to(torch.bfloat16))
    # the model weights (all-gathered over DP) agree with the fp32-master run but at ties
    for name, w in fp32[0]["weights"].items():
        differ = (rem[0]["weights"][name] != w).sum().item()
        assert differ <= max(2, w.numel() // 10_000), name


def _megatron_references_freed(rank):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.optim.megatron.params import keep_masters_as_remainders

    ddp = _bf16_ddp()
    config = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True)
    (leaf,) = get_megatron_optimizer(config, [ddp]).chained_optimizers
    masters = [weakref.ref(p) for g in leaf.shard_fp32_from_float16_groups for p in g]
    remainders = keep_masters_as_remainders(leaf)
    gc.collect()
    alive = sum(ref() is not None for ref in masters)
    return {"masters": len(masters), "alive": alive, "remainders": len(remainders)}


def test_fp32_master_copies_are_freed():
    for result in run_distributed(_megatron_references_freed, 2):
        assert result["masters"] >= 5 and result["remainders"] == result["masters"]
        assert result["alive"] == 0  # nothing in Megatron's optimizer still holds them


def test_config_cross_checks():  # the flags' checks: tests/integration/test_pretrain_rl.py
    from megatron.core.optimizer import OptimizerConfig

    from loggra_megatron.optim.megatron.factory import check_loggra_settings

    remainders = LoGRAConfig(loggra_param_remainders=True)
    with pytest.raises(ValueError, match="--loggra-param-remainders needs bf16"):
        check_loggra_settings(OptimizerConfig(optimizer="adam", lr=1e-3), remainders)
    bf16 = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True)
    check_loggra_settings(bf16, remainders)
    with pytest.raises(ValueError, match="excludes --loggra-fp32-grad-copy"):
        copy = LoGRAConfig(loggra_param_remainders=True, loggra_fp32_grad_copy=True)
        check_loggra_settings(bf16, copy)


TOKENS = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))


def _trained(rank, remainders, steps, save=None, load=None):
    """bf16 GPT at DP=2 with real forward/backward; optional save after ``save[1]`` steps
    or load before training. Returns weights and masters at the end (and after loading)."""
    from megatron.core import parallel_state

    from loggra_megatron.checkpointing import load_checkpoint, save_checkpoint
    from loggra_megatron.testing import train_step

    ddp = _bf16_ddp(grad_reduce_in_fp32=False)
    opt = _optimizer(ddp, remainders, clip_grad=1.0)
    out = {}
    if load is not None:
        load_checkpoint(load, [ddp], opt)
        out["loaded_masters"] = _masters(opt)
        out["loaded_weights"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    dp, dp_rank = (
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_rank(),
    )
    batch = TOKENS[dp_rank::dp]
    for step in range(steps):
        assert train_step(ddp, opt, batch, num_microbatches=batch.shape[0])[1][0]
        if save is not None and step + 1 == save[1]:
            save_checkpoint(save[0], step + 1, [ddp], opt, common={"step": step + 1})
            out["saved_masters"] = _masters(opt)
    out["masters"] = _masters(opt)
    out["weights"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return out


def _bitwise(a: list, b: list) -> bool:
    return all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True)
    )


def test_save_resume_equals_uninterrupted_and_checkpoints_load_across_modes(tmp_path):
    full = run_distributed(_trained, 2, True, 4)
    ckpt, ckpt_fp32 = str(tmp_path / "rem"), str(tmp_path / "fp32")
    run_distributed(_trained, 2, True, 2, save=(ckpt, 2))
    resumed = run_distributed(_trained, 2, True, 2, load=ckpt)
    for r in range(2):
        assert _bitwise(resumed[r]["masters"], full[r]["masters"])
        for name, w in full[r]["weights"].items():
            assert torch.equal(resumed[r]["weights"][name], w), name
    # a checkpoint of fp32 masters loads into remainders exactly (and back)
    saved = run_distributed(_trained, 2, False, 2, save=(ckpt_fp32, 2))
    into_rem = run_distributed(_trained, 2, True, 0, load=ckpt_fp32)
    back = run_distributed(_trained, 2, False, 0, load=ckpt)
    rem_saved = run_distributed(_trained, 2, True, 2)
    for r in range(2):
        assert _bitwise(into_rem[r]["loaded_masters"], saved[r]["saved_masters"])
        assert _bitwise(back[r]["loaded_masters"], rem_saved[r]["masters"])
        # each rank rounded its shard of the weights and the shards were all-gathered
        for name, w in into_rem[r]["loaded_weights"].items():
            assert torch.equal(w, into_rem[1 - r]["loaded_weights"][name]), name


def _kl_trial(rank, trial: bool):
    """A predicted-KL trial at η = 0.5, the weights restored, then a commit at η = 0.5."""
    from loggra_megatron.optim.megatron.stepper import MegatronStepper

    ddp = _bf16_ddp(grad_reduce_in_fp32=False)
    opt = _optimizer(ddp, True, clip_grad=1.0)
    stepper = MegatronStepper(opt)
    stepper.require_separate_model_weights()  # bf16 weights + remainders are accepted
    _set_grads(ddp, 0)
    assert stepper.prepare().ok
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    masters = _masters(opt)
    out = {}
    if trial:
        with stepper.try_candidate(0.5) as t:
            assert t.ok
            out["changed"] = sum(
                (p.detach() != before[n]).sum().item() for n, p in ddp.module.named_parameters()
            )
        stepper.restore_model_weights()
        out["restored"] = all(
            torch.equal(p.detach(), before[n]) for n, p in ddp.module.named_parameters()
        ) and _bitwise(_masters(opt), masters)
    stepper.commit(0.5)
    out["masters"] = _masters(opt)
    return out


def test_kl_trial_restores_weights_and_masters_exactly():
    tried = run_distributed(_kl_trial, 2, True)
    direct = run_distributed(_kl_trial, 2, False)
    for r in range(2):
        assert tried[r]["changed"] > 1000 and tried[r]["restored"]
        assert _bitwise(tried[r]["masters"], direct[r]["masters"])


def _trial_then_commit(rank, remainders: bool):
    """Per step: the weights inside a trial at η, then the weights a commit at η leaves
    (steps 0 and 2 refresh the basis; bf16 grads, clipped)."""
    from loggra_megatron.optim.megatron.stepper import MegatronStepper

    ddp = _bf16_ddp(grad_reduce_in_fp32=False)
    stepper = MegatronStepper(_optimizer(ddp, remainders, clip_grad=0.05))
    out = {"trials_are_commits": stepper.trials_are_commits, "steps": []}
    for step, eta in enumerate((1.0, 0.37, 1.0)):
        _set_grads(ddp, step)
        assert stepper.prepare().ok
        for _ in range(2):  # a second trial at the same η (the cached sketches) is the same
            with stepper.try_candidate(eta) as trial:
                assert trial.ok
                tried = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        stepper.commit(eta)
        committed = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        out["steps"].append((tried, committed))
    return out


@pytest.mark.parametrize("remainders", [False, True])
def test_a_trial_at_eta_leaves_the_weights_a_commit_at_eta_does(remainders):
    """What lets predicted-KL control read kl/realized off its last trial's forward."""
    for out in run_distributed(_trial_then_commit, 2, remainders):
        assert out["trials_are_commits"]
        for tried, committed in out["steps"]:
            for name, w in committed.items():
                assert torch.equal(tried[name].view(torch.int16), w.view(torch.int16)), name


def _trials_with_backup(rank, on_host: bool):
    """Three steps of a probe at η = 1, a trial at η, a commit at η (bf16 weights with
    remainders, the backup of θ's weights on the host or the device): the weights in each
    trial, the committed weights and masters, and what the backup held."""
    from loggra_megatron.optim.megatron.stepper import MegatronStepper

    ddp = _bf16_ddp(grad_reduce_in_fp32=False)
    opt = _optimizer(ddp, True, clip_grad=0.05)
    stepper = MegatronStepper(opt, backup_on_host=on_host)
    backup, out = stepper.trial_backup, {"steps": [], "device_bytes": [], "host_bytes": []}
    for step, eta in enumerate((0.5, 0.37, 0.9)):
        _set_grads(ddp, step)
        assert stepper.prepare().ok
        tried = []
        for scale in (1.0, eta):
            with stepper.try_candidate(scale) as trial:
                assert trial.ok
                tried.append({n: p.detach().clone() for n, p in ddp.module.named_parameters()})
                out["device_bytes"].append(trial.peak_bytes)
                out["host_bytes"].append(backup.host_bytes)
        stepper.commit(eta)
        weights = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        out["steps"].append((tried, weights, _masters(opt)))
    out["snapshots"] = backup.snapshots
    out["backed_up"] = sum(t.numel() * t.element_size() for t in backup.tensors)
    return out


def test_the_trial_backup_on_the_host_gives_the_same_trials_and_commits():
    """--kl-backup-offload: θ's bf16 weights copied to the host once per step (not per
    trial) and back after each trial; every trial's weights, committed weights and masters
    are bitwise those of the backup on the device, whose bytes the trials count and the
    host's do not."""
    on_device = run_distributed(_trials_with_backup, 2, False)
    on_host = run_distributed(_trials_with_backup, 2, True)
    for dev, host in zip(on_device, on_host, strict=True):
        assert host["snapshots"] == dev["snapshots"] == 3
        assert host["backed_up"] > 0 and set(host["host_bytes"]) == {host["backed_up"]}
        assert set(dev["host_bytes"]) == {0}
        assert min(dev["device_bytes"]) >= dev["backed_up"] > max(host["device_bytes"])
        for (tried_d, weights_d, masters_d), (tried_h, weights_h, masters_h) in zip(
            dev["steps"], host["steps"], strict=True
        ):
            for a, b in zip(tried_d, tried_h, strict=True):
                assert all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)
            assert all(torch.equal(weights_d[n], weights_h[n]) for n in weights_d)
            assert _bitwise(masters_d, masters_h)
        probe = tried_d[0]  # the probe at η = 1 is not the committed step
        assert not all(torch.equal(probe[n], weights_d[n]) for n in probe)


def _dense_in_pieces(rank, piece, remainders):
    """Three clipped steps on bf16 grads with every weight updated densely,
    ``DENSE_PIECE_NUMEL = piece`` (None: the default): the masters, a KL trial's candidate
    before each step, and the most gradient elements converted to fp32 at once."""
    from loggra_megatron.optim.gradient_sketch import distributed

    if piece is not None:
        distributed.DENSE_PIECE_NUMEL = piece
    converted = []
    fp32 = distributed.ShardedLoGRAAdamW._fp32

    def recorded(self, p, raw):
        converted.append(raw.numel())
        return fp32(self, p, raw)

    distributed.ShardedLoGRAAdamW._fp32 = recorded
    ddp = _bf16_ddp(grad_reduce_in_fp32=False)
    opt = _optimizer(ddp, remainders, 0.05, min_dim=10_000)  # nothing sketched
    out = {"steps": [], "candidates": []}
    for step in range(3):
        _set_grads(ddp, step)
        candidates = []
        opt.prepare_grads()
        opt.optimizer.model_grad_scale = 0.5  # a clip coefficient, as the chain hands it
        opt.optimizer.write_candidate(lambda p, t, kept=candidates: kept.append(t.clone()), 0.5)
        out["candidates"].append(candidates)
        out.setdefault("sq_norms", []).append(opt.optimizer.update_sq_norm())
        assert opt.step()[0]
        out["steps"].append(_masters(opt))
    out["largest_converted"] = max(converted)
    out["shard"] = max(p.numel() for g in opt.optimizer.param_groups for p in g["params"])
    return out


@pytest.mark.parametrize("remainders", [False, True])
def test_dense_updates_in_pieces_are_bitwise_those_of_whole_shards(remainders):
    """AdamW on a dense shard runs ``DENSE_PIECE_NUMEL`` elements at a time (the fp32
    gradient, direction and rebuilt master of one piece), for the commit and the KL trial's
    candidate alike, with the result of the whole shard at once, bit for bit."""
    whole = run_distributed(_dense_in_pieces, 2, None, remainders)
    pieces = run_distributed(_dense_in_pieces, 2, 7, remainders)
    for a, b in zip(whole, pieces, strict=True):
        assert a["largest_converted"] == a["shard"] > 7 >= b["largest_converted"]
        for key in ("steps", "candidates"):
            for x, y in zip(a[key], b[key], strict=True):
                assert len(x) == len(y) > 0
                for s, t in zip(x, y, strict=True):
                    assert torch.equal(s.view(torch.int32), t.view(torch.int32)), key
        for x, y in zip(a["sq_norms"], b["sq_norms"], strict=True):  # summed per piece
            assert float(y) == pytest.approx(float(x), rel=1e-5) and float(x) > 0

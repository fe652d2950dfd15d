"""Predicted-KL step control with real Megatron GPT policies (bf16, CPU/gloo)."""

import logging
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from shared_launch import shared_run

from loggra_megatron.model.vocab_parallel import vocab_parallel_kl, vocab_parallel_log_probs
from loggra_megatron.rl.config import KLControlConfig
from loggra_megatron.rl.kl_control import PredictedKLController
from loggra_megatron.rl.kl_probe import ProbeKL, gpt_probe_forward
from loggra_megatron.testing import run_distributed, tiny_gpt_model, wrap_ddp
from loggra_megatron.train.build import probe_kl

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

HIDDEN, HEADS, VOCAB, SEQ = 32, 4, 64, 8
TOKENS = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(3))


# ---------------------------------------------------------------- math, single process
def test_full_vocab_kl_and_log_probs_match_torch():
    gen = torch.Generator().manual_seed(0)
    z_old, z_new = torch.randn(3, 5, 50, generator=gen), torch.randn(3, 5, 50, generator=gen)
    exact = F.kl_div(
        z_new.log_softmax(-1), z_old.log_softmax(-1), log_target=True, reduction="none"
    )
    torch.testing.assert_close(vocab_parallel_kl(z_old, z_new), exact.sum(-1), atol=1e-5, rtol=0)
    targets = torch.randint(0, 50, (3, 5), generator=gen)
    expected = z_old.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(vocab_parallel_log_probs(z_old, targets), expected)


def _tp_kl(rank):
    from megatron.core import parallel_state

    gen = torch.Generator().manual_seed(0)
    z_old, z_new = torch.randn(3, 5, 64, generator=gen), torch.randn(3, 5, 64, generator=gen)
    targets = torch.randint(0, 64, (3, 5), generator=gen)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    t = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    shard = slice(t * 64 // tp, (t + 1) * 64 // tp)
    kl = vocab_parallel_kl(z_old[..., shard], z_new[..., shard], group)
    logp = vocab_parallel_log_probs(z_old[..., shard], targets, group)
    return kl, logp, vocab_parallel_kl(z_old, z_new), vocab_parallel_log_probs(z_old, targets)


def test_tp2_kl_equals_tp1_for_identical_logits():
    for kl, logp, kl_full, logp_full in run_distributed(_tp_kl, 2, tp=2):
        torch.testing.assert_close(kl, kl_full, atol=1e-6, rtol=0)
        torch.testing.assert_close(logp, logp_full, atol=1e-6, rtol=0)


def test_config_rejects_bad_flags():
    with pytest.raises(ValueError, match="--kl-target"):
        KLControlConfig(kl_target=-0.1)
    with pytest.raises(ValueError, match="--kl-probe-fraction"):
        KLControlConfig(kl_target=0.1, kl_probe_fraction=0.0)
    with pytest.raises(ValueError, match="--kl-estimator"):
        KLControlConfig(kl_target=0.1, kl_estimator="k4")
    assert KLControlConfig(kl_probe_fraction=0.25).probe_split(8) == (slice(0, 2), slice(2, 4))


# ---------------------------------------------------------------- controller, real models
def _build(kind="loggra", lr=1e-2):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.optim import LoGRAConfig, get_loggra_optimizer

    model = tiny_gpt_model(
        num_layers=2,
        hidden_size=HIDDEN,
        heads=HEADS,
        vocab=VOCAB,
        seq=SEQ,
        use_cpu_initialization=True,
        bf16=True,
    )
    ddp = wrap_ddp(model)
    base = dict(optimizer="adam", lr=lr, bf16=True, use_distributed_optimizer=True, clip_grad=1.0)
    if kind == "dense":
        return ddp, get_megatron_optimizer(OptimizerConfig(**base), [ddp])
    loggra = LoGRAConfig(
        loggra_sketch="gradient", loggra_rank=4, loggra_min_dim=1, loggra_update_interval=2
    )
    return ddp, get_loggra_optimizer(OptimizerConfig(**base), [ddp], loggra)


def _backward(ddp, opt, tokens):
    from loggra_megatron.testing import train_step

    # train_step runs forward/backward and optimizer.step(); here we need the grads only
    step = opt.step
    opt.step = lambda: (True, None, None)
    try:
        train_step(ddp, opt, tokens)
    finally:
        opt.step = step


def _controller(ddp, opt, **cfg):
    from loggra_megatron.optim.megatron.stepper import MegatronStepper

    config = KLControlConfig(**{"kl_realized_interval": 1, **cfg})  # kl/realized every step
    measure = probe_kl(gpt_probe_forward(ddp), config.kl_estimator)
    return PredictedKLController(config, MegatronStepper(opt), measure)


def _count_forwards(ctl) -> list[int]:
    """The rows of each forward the controller runs from now on."""
    forwards, forward = [], ctl.measure.forward
    ctl.measure.forward = lambda batch: forwards.append(len(batch[0])) or forward(batch)
    return forwards


def _local(tokens):
    from megatron.core import parallel_state as ps

    return tokens[ps.get_data_parallel_rank() :: ps.get_data_parallel_world_size()]


def _params(ddp):
    ddp.start_param_sync(force_sync=True)
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _controlled_vs_plain(rank, kind, steps=3, target=1e9):
    """Same model and batches: plain optimizer.step() vs the controller far below target."""
    out = {}
    for mode in ("plain", "controlled"):
        torch.manual_seed(0)
        ddp, opt = _build(kind)
        ctl = _controller(ddp, opt, kl_target=target, kl_probe_fraction=0.25)
        batch = _local(TOKENS)
        metrics = []
        for _ in range(steps):
            _backward(ddp, opt, batch)
            if mode == "plain":
                opt.step()
            else:
                update = ctl.step(ctl.begin(batch))
                assert update.committed
                metrics.append(update.metrics())
        out[mode] = _params(ddp)
        out["metrics"] = metrics
        out["trials_are_commits"] = ctl.stepper.trials_are_commits
    return out


@pytest.mark.parametrize("kind", ["loggra", "dense"])
def test_below_target_the_controller_is_an_exact_no_op(kind):
    for r in run_distributed(_controlled_vs_plain, 2, kind):
        for k, v in r["plain"].items():
            assert torch.equal(r["controlled"][k], v), k
        assert all(m["kl/step_scale"] == 1.0 and m["kl/predicted"] > 0 for m in r["metrics"])
        assert all("kl/realized" in m and m["kl/realized"] > 0 for m in r["metrics"])
        # LoGRA's trials are its commits (kl/realized from the last trial); dense Adam's not
        assert r["trials_are_commits"] == (kind == "loggra")


def _predicted_vs_exact(rank):
    """kl/predicted against KL computed directly from the logits at θ and at θ + Δθ."""
    ddp, opt = _build("loggra")
    ctl = _controller(ddp, opt, kl_target=1e9, kl_probe_fraction=0.5, kl_realized_interval=0)
    forward = ctl.measure.forward
    batch = _local(TOKENS)
    probe, _ = ctl.config.probe_split(batch.shape[0])
    _backward(ddp, opt, batch)
    before = forward((batch[probe], None))
    metrics = ctl.step(ctl.begin(batch)).metrics()
    ddp.start_param_sync(force_sync=True)
    after = forward((batch[probe], None))
    exact = F.kl_div(
        after.logits.float().log_softmax(-1),
        before.logits.float().log_softmax(-1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    from megatron.core import parallel_state as ps

    totals = torch.stack([exact.sum(), torch.tensor(float(exact.numel()))])
    torch.distributed.all_reduce(totals, group=ps.get_data_parallel_group())
    return metrics["kl/predicted"], float(totals[0] / totals[1])


def test_predicted_kl_equals_exact_full_vocab_kl():
    for predicted, exact in run_distributed(_predicted_vs_exact, 2):
        assert exact > 0
        assert abs(predicted - exact) <= 1e-4 * exact + 1e-7


def _scaled_to_target(rank, estimator, pp):
    ddp, opt = _build("loggra", lr=5e-2)
    batch = _local(TOKENS)
    ctl = _controller(ddp, opt, kl_target=1e9, kl_probe_fraction=0.5, kl_estimator=estimator)
    probe, holdout = ctl.config.probe_split(batch.shape[0])
    _backward(ddp, opt, batch)
    opt.prepare_grads()
    opt.clip_grad_norm(opt.config.clip_grad)
    ref = ctl.measure.reference((batch[probe], None))
    with ctl.stepper.try_candidate(1.0):  # the full step's KL, nothing committed
        raw = ctl.measure((batch[probe], None), ref)[0]
    ctl.stepper.restore_model_weights()
    ctl.config.kl_target = raw / 10
    metrics = ctl.step(ctl.begin(batch)).metrics()
    return raw, metrics, ctl.config.kl_target


@pytest.mark.parametrize(("estimator", "pp"), [("full", 1), ("k3", 1), ("full", 2)])
def test_step_at_ten_times_target_is_scaled_down(estimator, pp):
    results = run_distributed(_scaled_to_target, 2, estimator, pp, pp=pp)
    etas = {r[1]["kl/step_scale"] for r in results}
    assert len(etas) == 1  # every DP rank / pipeline stage applies the same η
    for raw, metrics, target in results:
        # the pre-measurement above clipped the gradients once more (a factor 1 - 1e-6)
        assert raw > 0 and metrics["kl/predicted"] == pytest.approx(raw, rel=1e-3)
        assert metrics["kl/step_scale"] < 0.5
        assert metrics["kl/realized"] <= 1.5 * target


def _nan_kl_skips(rank):
    ddp, opt = _build("loggra")
    batch = _local(TOKENS)
    ctl = _controller(ddp, opt, kl_target=1e-3, kl_probe_fraction=0.25)
    _backward(ddp, opt, batch)
    ctl.step(ctl.begin(batch))  # one normal step, so the state is non-trivial
    _backward(ddp, opt, batch)
    before = _params(ddp)
    inner = opt.optimizer
    state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in inner.state.items()}
    mains_before = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
    forward, calls = ctl.measure.forward, []

    def poisoned(batch):
        out = forward(batch)
        calls.append(1)
        if len(calls) == 2 and out is not None:  # probe + held-out ref, then the candidate
            out.logits[0, 0, 0] = float("nan")
        return out

    ctl.measure.forward = poisoned
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("loggra_megatron.rl.kl_control").addHandler(handler)
    update = ctl.step(ctl.begin(batch))
    after = _params(ddp)
    mains_after = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
    state_same = all(
        torch.equal(v, state_before[id(p)][k]) for p, s in inner.state.items() for k, v in s.items()
    )
    return (
        update.committed,
        all(torch.equal(before[k], after[k]) for k in before),
        all(torch.equal(a, b) for a, b in zip(mains_before, mains_after, strict=True)),
        state_same,
        [r.getMessage() for r in records],
    )


def test_nonfinite_kl_skips_the_update_and_leaves_everything_untouched():
    for ok, weights_same, mains_same, state_same, logs in run_distributed(_nan_kl_skips, 2):
        assert not ok and weights_same and mains_same and state_same
        assert any("non-finite" in m and "skipping" in m for m in logs)


def _fp32_refused(rank):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.optim.megatron.stepper import MegatronStepper

    model = tiny_gpt_model(num_layers=1, hidden_size=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ)
    ddp = wrap_ddp(model)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True)
    opt = get_megatron_optimizer(config, [ddp])
    with pytest.raises(ValueError, match="--bf16"):
        PredictedKLController(
            KLControlConfig(kl_target=0.1), MegatronStepper(opt), ProbeKL(lambda b: None, "full")
        )
    return True


def test_fp32_models_are_refused_with_a_clear_error():
    assert run_distributed(_fp32_refused, 1) == [True]


def _kept_vs_probe_forward(rank, estimator, pad_to=1):
    """The probe reference kept from a GRPO training forward (ReferenceCollector) against the
    controller's own probe forward at the same weights, then a step with the kept one."""
    from loggra_megatron.optim.megatron.stepper import MegatronStepper
    from loggra_megatron.rl.actor import forward_backward, split_micro
    from loggra_megatron.rl.losses import AdaptiveKLCoefficient
    from loggra_megatron.rl.policy_loss import PolicyLossConfig, PPOClipLoss

    if pad_to > 1:  # the schedule pads as under FP8 / sequence parallelism (this worker)
        import loggra_megatron.model.forward as forward_module

        forward_module.sequence_multiple = lambda config: pad_to
    torch.manual_seed(0)
    ddp, opt = _build("loggra")

    config = KLControlConfig(
        kl_target=1e-4, kl_probe_fraction=0.5, kl_estimator=estimator, kl_realized_interval=1
    )
    k = estimator != "full"  # the trainer's forward: micro-batched log-probs for k1/k2/k3
    forward = gpt_probe_forward(ddp, micro_batch_size=1 if k else None, log_probs=k)
    ctl = PredictedKLController(config, MegatronStepper(opt), probe_kl(forward, estimator))
    tokens = _local(TOKENS)
    gen = torch.Generator().manual_seed(5)
    mask = torch.ones(len(tokens), SEQ, dtype=torch.bool)
    mask[:, :3] = False
    batch = {
        "tokens": tokens,
        "mask": mask,
        "old": -4.0 + torch.zeros(len(tokens), SEQ),
        "adv": torch.randn(len(tokens), generator=gen),
    }
    loss = PPOClipLoss(PolicyLossConfig(), SEQ, AdaptiveKLCoefficient(0.0))
    loss_fn = partial(loss, counts=(float(mask.sum()) * 2, float(len(tokens)) * 2))
    update = ctl.begin(tokens, mask)
    forward_backward(ddp, opt, split_micro(batch, 1), update.keep_reference(loss_fn), dp=2)
    kept = update.collector.result(SEQ)
    _, holdout = ctl.config.probe_split(len(tokens))  # kl/realized is due: probe + held-out
    own = ctl.measure.reference((tokens[: holdout.stop], mask[: holdout.stop]))
    forwards = _count_forwards(ctl)
    metrics = ctl.step(update).metrics()
    return kept, own, metrics, forwards, holdout


@pytest.mark.parametrize(
    ("estimator", "pad_to"), [("k3", 1), ("full", 1), ("k3", 16), ("full", 16)]
)
def test_reference_kept_from_the_training_forward_equals_the_probe_forward(estimator, pad_to):
    """Predicted-KL control without its own reference forwards: the training forward's
    logits (or their log-probs) of the probe and held-out rows equal what the probe forward
    computes (for k3 in micro-batches of one row, returning log-probs only), and the
    controller steps with them (here scaling the step to a tiny target): its only forwards
    are the candidates', each on the probe and the held-out rows (kl/realized is read off
    the last one). ``pad_to=16``: the schedule pads the micro-batches (FP8, sequence
    parallelism); the kept reference is cut back to the probe's length."""
    results = run_distributed(_kept_vs_probe_forward, 2, estimator, pad_to)
    for kept, own, metrics, forwards, holdout in results:
        assert set(forwards) == {holdout.stop}
        # η = 1, the scaled η and its backtracks: no reference or realized forward
        assert len(forwards) == 2 + metrics["kl/backtracks"]
        assert metrics["kl/realized"] >= 0
        assert kept.logits.shape == own.logits.shape
        assert kept.logits.ndim == (3 if estimator == "full" else 2)
        torch.testing.assert_close(kept.logits, own.logits, atol=1e-6, rtol=0)
        assert torch.equal(kept.targets, own.targets) and torch.equal(kept.mask, own.mask)
        assert metrics["kl/predicted"] > 1e-4 and 0 < metrics["kl/step_scale"] < 1


def _realized(rank, estimator, folded: bool, forward_rows=None):
    """One controlled step scaled to a small target; kl/realized from the last trial's
    forward (folded) or from a forward after the commit (as for dense Adam); the KL forwards
    in calls of ``forward_rows`` rows."""
    from loggra_megatron.optim.megatron.stepper import MegatronStepper

    if not folded:  # this worker process only
        MegatronStepper.trials_are_commits = property(lambda self: False)
    torch.manual_seed(0)
    ddp, opt = _build("loggra", lr=5e-2)
    ctl = _controller(ddp, opt, kl_target=1e-3, kl_probe_fraction=0.25, kl_estimator=estimator)
    ctl.measure.forward_rows = forward_rows
    forwards = _count_forwards(ctl)
    batch = _local(TOKENS)
    _backward(ddp, opt, batch)
    metrics = ctl.step(ctl.begin(batch)).metrics()
    return metrics, forwards, _params(ddp)


@pytest.mark.parametrize(("estimator", "rows"), [("full", None), ("k3", None), ("full", 1)])
def test_realized_kl_from_the_last_trial_equals_a_forward_after_the_commit(estimator, rows):
    """``rows``: the folded KLs in forwards of one row (as pretrain_rl.py does for ``full``
    with micro-batches of one), against whole-batch forwards after the commit."""
    folded = run_distributed(_realized, 2, estimator, True, rows)
    after = shared_run(_realized, 2, estimator, False)  # the same for rows None and 1
    for (m, forwards, params), (m_after, forwards_after, params_after) in zip(
        folded, after, strict=True
    ):
        assert 0 < m["kl/step_scale"] < 1 and m["kl/step_scale"] == m_after["kl/step_scale"]
        for name, w in params.items():
            assert torch.equal(w, params_after[name]), name
        # the same KL at the same committed weights
        assert m["kl/realized"] == pytest.approx(m_after["kl/realized"], rel=1e-5)
        assert m["kl/predicted"] == pytest.approx(m_after["kl/predicted"], rel=1e-5)
        if rows == 1:  # the reference forward, then each trial in one-row calls
            assert forwards[0] == 2 and set(forwards[1:]) == {1}
            continue
        # every forward on probe + held-out rows: one reference forward instead of two, the
        # same trials, no realized forward
        assert set(forwards) == {2} and set(forwards_after) == {1}
        assert len(forwards) == len(forwards_after) - 2

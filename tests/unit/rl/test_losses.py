"""RL losses against hand computations, closed forms and Monte Carlo."""

import math

import pytest
import torch

from loggra_megatron.model.output_head import LastHidden
from loggra_megatron.rl import (
    AGGREGATIONS,
    AdaptiveKLCoefficient,
    aggregate,
    group_advantages,
    kl_to_reference,
    ppo_clip_per_token,
)
from loggra_megatron.rl.policy_loss import (
    Aggregation,
    ClippedSurrogate,
    LossInputs,
    PolicyLossConfig,
    PPOClipLoss,
)

# ---------------------------------------------------------------------------- advantages

# 2 prompts × 4 generations.
#   prompt 0: r = [1, 0, 0, 1]  mean 0.5,  r − mean = [ .5, −.5, −.5,  .5]
#             sample var = 4·0.25/3 = 1/3 → std = 1/√3   → A = ±0.5·√3 = ±0.8660254
#   prompt 1: r = [0, 0, 0, 1]  mean 0.25, r − mean = [−.25, −.25, −.25, .75]
#             sample var = (3·0.0625 + 0.5625)/3 = 0.25 → std = 0.5 → A = [−.5, −.5, −.5, 1.5]
#             (population std would be √0.1875 = 0.4330 → A = [−.577, …, 1.732]: not this)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
S3 = 0.5 * math.sqrt(3.0)


def test_grpo_advantages_hand_computed_sample_std():
    expected = torch.tensor([S3, -S3, -S3, S3, -0.5, -0.5, -0.5, 1.5])
    adv = group_advantages(REWARDS, group_size=4, normalize_std=True, eps=0.0)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    adv_2d = group_advantages(REWARDS.view(2, 4), group_size=4, normalize_std=True, eps=0.0)
    torch.testing.assert_close(adv_2d, expected, atol=1e-6, rtol=0)
    population = torch.tensor([-0.25, -0.25, -0.25, 0.75]) / math.sqrt(0.1875)
    assert not torch.allclose(adv[4:], population, atol=1e-3)  # it is the sample std
    # the default eps = 1e-6 only perturbs at the 1e-6 relative level
    torch.testing.assert_close(group_advantages(REWARDS, 4), expected, atol=1e-5, rtol=0)


def test_dr_grpo_advantages_hand_computed():
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75])
    adv = group_advantages(REWARDS, group_size=4, normalize_std=False)
    torch.testing.assert_close(adv, expected, atol=1e-7, rtol=0)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_identical_rewards_give_zero_advantages(normalize_std):
    rewards = torch.tensor([[0.7, 0.7, 0.7, 0.7], [1.0, 0.0, 1.0, 0.0]])
    adv = group_advantages(rewards, group_size=4, normalize_std=normalize_std)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:4], torch.zeros(4))
    assert adv[4:].abs().min() > 0


def test_rewards_near_the_float32_limit_give_finite_grpo_advantages():
    """A group of rewards of ±3e38 (each a finite float32) overflowed float32's own sum, and
    the NaN advantages skipped every step; the group's statistics are float64."""
    rewards = torch.tensor([3e38, 3e38, 0.0, 1.0, 3e38, -3e38, 0.0, 1.0])
    adv = group_advantages(rewards, group_size=4)
    assert adv.dtype == torch.float32 and torch.isfinite(adv).all()
    torch.testing.assert_close(
        adv[:4], torch.tensor([1.0, 1.0, -1.0, -1.0]) * S3, rtol=1e-6, atol=0
    )


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 3), group_size=4)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), group_size=1)


# ---------------------------------------------------------------------------- PPO clip

# ε_low = 0.2, ε_high = 0.28: clip range [0.8, 1.28]. ℓ = max(−ρA, −clip(ρ)A).
RATIOS = [0.5, 0.78, 1.0, 1.1, 1.25, 1.5]
#   A = +1: ℓ = −min(ρ, clip ρ)  = −[0.5, 0.78, 1.0, 1.1, 1.25, 1.28]; clipped only at 1.5
#   A = −1: ℓ =  max(ρ, clip ρ)  =  [0.8, 0.8,  1.0, 1.1, 1.25, 1.5 ]; clipped at 0.5, 0.78
LOSS_POS = [-0.5, -0.78, -1.0, -1.1, -1.25, -1.28]
LOSS_NEG = [0.8, 0.8, 1.0, 1.1, 1.25, 1.5]
CLIP_POS = [False, False, False, False, False, True]
CLIP_NEG = [True, True, False, False, False, False]


def _ratio_batch():
    logp_old = torch.zeros(2, len(RATIOS))
    logp = torch.log(torch.tensor([RATIOS, RATIOS])).requires_grad_()
    return logp, logp_old, torch.tensor([1.0, -1.0])


def test_ppo_clip_hand_computed_with_clip_higher():
    logp, logp_old, adv = _ratio_batch()
    loss, clipped, ratio = ppo_clip_per_token(logp, logp_old, adv, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([LOSS_POS, LOSS_NEG]), atol=1e-6, rtol=0)
    assert clipped.tolist() == [CLIP_POS, CLIP_NEG]
    torch.testing.assert_close(ratio, torch.tensor([RATIOS, RATIOS]), atol=1e-6, rtol=0)
    # clipped tokens carry no gradient; unclipped ones d(−ρA)/dlogp = −ρA
    loss.sum().backward()
    expected_grad = torch.tensor([[-r for r in RATIOS], RATIOS])
    expected_grad[torch.tensor([CLIP_POS, CLIP_NEG])] = 0.0
    torch.testing.assert_close(logp.grad, expected_grad, atol=1e-6, rtol=0)


def test_clip_higher_is_asymmetric():
    logp, logp_old, adv = _ratio_batch()
    sym, sym_clipped, _ = ppo_clip_per_token(logp, logp_old, adv, clip_low=0.2, clip_high=0.2)
    # ρ = 1.25, A > 0: clipped to 1.2 by the symmetric range, free under clip-higher
    assert sym_clipped[0, 4] and sym[0, 4].item() == pytest.approx(-1.2)
    # ρ = 1.5, A > 0: capped at 1.2 instead of 1.28
    assert sym[0, 5].item() == pytest.approx(-1.2)
    # the lower side is the same in both (0.8): ρ = 0.78, A < 0 clipped to 0.8
    assert sym_clipped[1, 1] and sym[1, 1].item() == pytest.approx(0.8)


def _surrogate(logp, logp_old, adv, mask, aggregation="token_mean"):
    """The policy loss's clipped-surrogate term (ε_low 0.2, ε_high 0.28) on given log-probs."""
    inputs = LossInputs({"old": logp_old, "adv": adv, "mask": mask}, logp, Aggregation(aggregation))
    return ClippedSurrogate(clip_low=0.2, clip_high=0.28)(inputs)


def test_policy_loss_token_mean_and_metrics():
    logp, logp_old, adv = _ratio_batch()
    mask = torch.ones(2, len(RATIOS), dtype=torch.bool)
    loss, metrics = _surrogate(logp, logp_old, adv, mask)
    assert loss.item() == pytest.approx(sum(LOSS_POS + LOSS_NEG) / 12, abs=1e-6)
    assert metrics["loss/policy"] == loss.detach()
    assert metrics["clip/fraction"].item() == pytest.approx(3 / 12)
    assert metrics["ratio/mean"].item() == pytest.approx(sum(RATIOS) / 6, abs=1e-6)
    # kl/old_new = k3 of KL(π_old ‖ π_θ): δ = log ρ, k3 = ρ − 1 − log ρ
    k3 = sum(r - 1 - math.log(r) for r in RATIOS) / 6
    assert metrics["kl/old_new"].item() == pytest.approx(k3, abs=1e-6)


def test_on_policy_old_is_the_forward_itself():
    """Without ``old`` in the batch (one update per RL step), π_old is this forward's own
    log-probs, detached: ratio 1, nothing clipped, and the gradient is −A·∇log π / n."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv, mask = torch.tensor([2.0]), torch.ones(1, 3, dtype=torch.bool)
    x = LossInputs({"adv": adv, "mask": mask}, logp, Aggregation())
    loss, metrics = ClippedSurrogate(0.2, 0.28)(x)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert metrics["ratio/mean"] == 1 and metrics["clip/fraction"] == 0
    assert metrics["kl/old_new"] == 0 and "rollout/logprob_mismatch" not in metrics
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -2.0 / 3))


def test_truncated_importance_sampling_hand_computed():
    """``--tis-cap C``: each token's loss × min(π_old/π_rollout, C), detached; π_old the
    trainer's (here: the forward's own), π_rollout the engine's. Padding never leaks."""
    new = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -1.0, -0.5, float("nan")]])  # π_old/π_rollout: e^0.5, e^-1, 1
    mask = torch.tensor([[True, True, True, False]])
    adv = torch.tensor([1.0])
    batch = {"adv": adv, "mask": mask, "rollout": rollout}
    loss, metrics = ClippedSurrogate(0.2, 0.28, tis_cap=1.5)(LossInputs(batch, new, Aggregation()))
    loss.backward()
    w = [1.5, math.exp(-1.0), 1.0]  # e^0.5 = 1.65 is capped at 1.5
    assert loss.item() == pytest.approx(-sum(w) / 3)
    torch.testing.assert_close(new.grad, -torch.tensor([[*w, 0.0]]) / 3)
    assert metrics["tis/weight_mean"].item() == pytest.approx(sum(w) / 3)
    assert metrics["rollout/logprob_mismatch"].item() == pytest.approx((0.5 + 1.0 + 0) / 3)
    # without the cap the weights are 1, the mismatch is still measured
    plain, metrics = ClippedSurrogate(0.2, 0.28)(LossInputs(batch, new, Aggregation()))
    assert plain.item() == pytest.approx(-1.0) and "tis/weight_mean" not in metrics
    with pytest.raises(ValueError, match="tis-cap"):
        ClippedSurrogate(0.2, 0.28, tis_cap=2.0)(
            LossInputs({"adv": adv, "mask": mask}, new, Aggregation())
        )


def test_tis_cap_setting_is_checked():
    from loggra_megatron.config import ConfigError
    from loggra_megatron.rl.policy_loss import PolicyLossConfig

    assert PolicyLossConfig(tis_cap=2.0).tis_cap == 2.0
    with pytest.raises(ConfigError, match="--tis-cap=0.5: must be >= 1"):
        PolicyLossConfig(tis_cap=0.5)


# ---------------------------------------------------------------------------- aggregation

# values with padding (NaN in padded slots must not leak):
#   row 0: [1, 2, 3, pad]   n = 3, sum 6
#   row 1: [4, pad, pad, pad] n = 1, sum 4
#   row 2: all padding      (not a sequence)
NAN = float("nan")
VALUES = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, 100.0, NAN], [NAN, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
HAND = {
    "token_mean": (6 + 4) / 4,  # 2.5
    "seq_mean_token_sum_norm": (6 + 4) / (2 * 4),  # 1.25, L = T = 4
    "seq_mean_token_mean": (6 / 3 + 4 / 1) / 2,  # 3.0
}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_aggregations_hand_computed_with_padding(aggregation):
    assert aggregate(VALUES, MASK, aggregation).item() == pytest.approx(HAND[aggregation])
    # the surrogate with ρ = 1 has per-token loss −A: same numbers through the full path
    logp = torch.zeros(3, 4)
    loss, _ = _surrogate(logp, logp, -VALUES, MASK, aggregation)
    assert loss.item() == pytest.approx(HAND[aggregation])


def test_aggregation_explicit_denominators():
    assert aggregate(VALUES, MASK, "seq_mean_token_sum_norm", max_len=10).item() == 0.5
    assert aggregate(VALUES, MASK, "token_mean", num_tokens_global=20).item() == 0.5
    assert aggregate(VALUES, MASK, "seq_mean_token_mean", num_seqs_global=6).item() == 1.0
    with pytest.raises(ValueError):
        aggregate(VALUES, MASK, "sum")


# ---------------------------------------------------------------------------- KL to reference


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_to_reference_closed_forms(estimator):
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=gen) * 3
    logp_ref = -torch.rand(3, 5, generator=gen) * 3
    mask = torch.rand(3, 5, generator=gen) > 0.3
    logp_ref[~mask] = -math.inf  # padding garbage
    d = (logp_ref - logp)[mask]  # δ = log π_ref − log π_θ
    closed = {"k1": -d, "k2": 0.5 * d**2, "k3": torch.exp(d) - 1 - d}[estimator]
    kl = kl_to_reference(logp, logp_ref, mask, estimator)
    torch.testing.assert_close(kl[mask], closed, atol=1e-6, rtol=1e-6)
    assert torch.equal(kl[~mask], torch.zeros(int((~mask).sum())))
    if estimator != "k1":
        assert (kl >= 0).all()


def test_k3_nonnegative_on_random_inputs():
    gen = torch.Generator().manual_seed(1)
    logp, logp_ref = torch.randn(2, 64, 64, generator=gen) * 5
    assert (kl_to_reference(logp, logp_ref, torch.ones(64, 64), "k3") >= 0).all()


def test_k1_k3_monte_carlo_match_exact_kl():
    """Samples from p = π_θ over 5 categories; estimators of KL(p ‖ q) vs Σ p log(p/q).

    N = 200 000 samples, fixed seed; tolerance 4 standard errors of each estimator's mean
    (about 2e-3 for k1, 1e-3 for k3 here).
    """
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1], dtype=torch.float64)
    exact = (p * (p / q).log()).sum().item()  # ≈ 0.3397
    n = 200_000
    a = torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, logp_ref = p.log()[a].view(1, n), q.log()[a].view(1, n)
    mask = torch.ones(1, n, dtype=torch.bool)
    for est in ("k1", "k3"):
        kl = kl_to_reference(logp, logp_ref, mask, est).double()
        stderr = kl.std().item() / math.sqrt(n)
        assert abs(kl.mean().item() - exact) < 4 * stderr, (est, kl.mean().item(), exact)
        assert stderr < 2e-3


# ---------------------------------------------------------------------------- micro-batching


def _random_batch(seed=0, b=6, t=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 1, 5, 0, 6])  # one all-padding row
    mask = torch.arange(t) < lengths[:, None]
    logp_old = -torch.rand(b, t, generator=gen) * 2
    logp = logp_old + 0.3 * torch.randn(b, t, generator=gen)  # ratios around and past the clip
    logp_ref = logp_old + 0.2 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, generator=gen)
    return logp, logp_old, logp_ref, adv, mask


def _hidden_batch(seed=0, b=6, t=7, vocab=5, h=3):
    """A micro-batch as the loss reads it: last hidden states ``[b, t, h]``, an output weight
    ``[V, h]``, and the batch whose sampling and reference log-probs lie around the model's
    own (ratios around and past the clip)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 1, 5, 0, 6])  # one all-padding row
    tokens = torch.randint(0, vocab, (b, t + 1), generator=gen)
    hidden, weight = torch.randn(b, t, h, generator=gen), torch.randn(vocab, h, generator=gen)
    logits = hidden @ weight.t()
    logp = logits.log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    batch = {
        "tokens": tokens,
        "mask": torch.arange(t) < lengths[:, None],
        "old": logp - 0.3 * torch.randn(b, t, generator=gen),
        "ref": logp - 0.2 * torch.randn(b, t, generator=gen),
        "adv": torch.randn(b, generator=gen),
    }
    return batch, hidden, weight


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batch_losses_sum_to_full_batch(aggregation):
    batch, hidden, weight = _hidden_batch()
    mask = batch["mask"]
    loss = PPOClipLoss(
        PolicyLossConfig(loss_aggregation=aggregation),
        max_len=7,
        kl_coef=AdaptiveKLCoefficient(0.05),
    )

    def run(x, sl, counts=None):
        micro = {k: v[sl] for k, v in batch.items()}
        return loss(micro, LastHidden(x[sl], weight, micro, chunk=4), counts)

    full_hidden = hidden.clone().requires_grad_()
    full, _ = run(full_hidden, slice(None))
    full.backward()

    counts = (int(mask.sum()), int(mask.any(-1).sum()))
    micro_hidden = hidden.clone().requires_grad_()
    total = torch.zeros(())
    for sl in (slice(0, 2), slice(2, 3), slice(3, 6)):  # uneven; slice(2, 3) is 1 token
        micro, metrics = run(micro_hidden, sl, counts)
        micro.backward()
        total += micro.detach()
        assert metrics["loss/total"] == micro.detach()
    torch.testing.assert_close(total, full.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(micro_hidden.grad, full_hidden.grad, atol=1e-7, rtol=1e-6)
    # without the global denominators the micro-batch losses do not add up
    local = sum(run(hidden, sl)[0] for sl in (slice(0, 2), slice(2, 6)))
    assert abs(local.item() - full.item()) > 1e-4


# ---------------------------------------------------------------------------- grpo_loss, grads


def _ppo_clip_terms(logp, batch, kl_coef):
    """The terms of the ``ppo_clip`` loss on given log-probs (this micro-batch's counts)."""
    loss = PPOClipLoss(PolicyLossConfig(), max_len=None, kl_coef=AdaptiveKLCoefficient(kl_coef))
    return loss.sum_terms(LossInputs(batch, logp, Aggregation()))


def test_grpo_loss_metrics_and_gradients():
    logp, logp_old, logp_ref, adv, mask = _random_batch(seed=3)
    logp_old[~mask], logp_ref[~mask] = -math.inf, math.nan  # hostile padding
    logp = logp.masked_fill(~mask, -math.inf).requires_grad_()
    batch = {"old": logp_old, "adv": adv, "mask": mask, "ref": logp_ref}
    loss, m = _ppo_clip_terms(logp, batch, kl_coef=0.1)
    keys = {"loss/policy", "loss/kl_ref", "loss/total", "kl/ref", "clip/fraction", "ratio/mean"}
    assert keys <= set(m) and all(torch.isfinite(v) and v.dim() == 0 for v in m.values())
    assert m["loss/total"].item() == pytest.approx((m["loss/policy"] + m["loss/kl_ref"]).item())
    kl = kl_to_reference(logp.detach(), logp_ref, mask, "k3")
    assert m["loss/kl_ref"].item() == pytest.approx(0.1 * kl[mask].mean().item(), rel=1e-6)
    assert 0 < m["clip/fraction"] < 1
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[~mask], torch.zeros(int((~mask).sum())))
    assert (logp.grad[mask] != 0).any()
    # no reference: KL terms are zero, not missing
    del batch["ref"]
    _, m0 = _ppo_clip_terms(logp, batch, kl_coef=0.0)
    assert m0["kl/ref"] == 0 and m0["loss/kl_ref"] == 0
    with pytest.raises(ValueError):
        _ppo_clip_terms(logp, batch, kl_coef=0.1)


# ---------------------------------------------------------------------------- adaptive β


def test_adaptive_kl_coefficient_direction_and_clipping():
    ctl = AdaptiveKLCoefficient(0.1, ref_kl_target=0.05, horizon=1000)
    # KL 10 % above target: e = 0.1, K = 64/1000 → β · (1 + 0.0064)
    assert ctl.update(0.055, n_steps=64) == pytest.approx(0.1 * 1.0064)
    ctl.load_state_dict({"value": 0.1, "ref_kl_target": 0.05, "horizon": 1000.0})
    assert ctl.update(0.045, n_steps=64) == pytest.approx(0.1 * (1 - 0.0064))  # below: down
    ctl.load_state_dict({"value": 0.1, "kl_target": 0.05, "horizon": 1000.0})
    assert ctl.update(5.0, n_steps=100) == pytest.approx(0.1 * 1.02)  # e clipped at +0.2
    assert ctl.update(0.0, n_steps=100) == pytest.approx(0.1 * 1.02 * 0.98)  # e clipped at −0.2
    assert ctl.update(torch.tensor(0.05), n_steps=100) == pytest.approx(0.1 * 1.02 * 0.98)


def test_fixed_kl_coefficient_and_state_dict_roundtrip():
    fixed = AdaptiveKLCoefficient(0.04)
    assert not fixed.adaptive and fixed.update(10.0, n_steps=64) == 0.04
    ctl = AdaptiveKLCoefficient(0.2, ref_kl_target=0.1, horizon=500)
    for kl in (0.3, 0.12, 0.01):
        ctl.update(kl, n_steps=32)
    state = ctl.state_dict()
    assert all(type(v) is float for v in state.values())
    clone = AdaptiveKLCoefficient(1.0)
    clone.load_state_dict(state)
    assert clone.adaptive and clone.update(0.2, 32) == ctl.update(0.2, 32)
    with pytest.raises(ValueError):
        ctl.update(0.2, n_steps=5000)  # K_β = 10 would flip β's sign

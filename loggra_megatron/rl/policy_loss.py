"""The policy loss: an object with its own settings that reads a micro-batch's last hidden
states and returns ``(loss, metrics)``, registered by name (``--policy-loss``; cf. verl's
policy-loss registry, torchtitan's ``DAPOLoss``).

A loss is the sum of its *terms* (``LossTerm``). Each term reads a ``LossInputs``:
the batch, the token log-probs computed once from the hidden states in token chunks with the
TP group (``model.output_head``: no ``[b, s, V/TP]`` logits exist, and
no shard is ever gathered), the hidden states and output weight themselves, and the
``Aggregation`` that turns per-token values into this micro-batch's share of the
mini-batch loss (``--loss-aggregation`` over the DP-global counts, ``rl/losses.py``). It
returns its value and its metrics, each a key declared in ``metric_keys``.

``PPOClipLoss`` (``ppo_clip``) is GRPO / Dr.GRPO / DAPO (by the aggregation) with
clip-higher: the clipped surrogate (``ClippedSurrogate``) plus β · KL to the reference
(``KLToReference``, β the adaptive coefficient). Adding a term (e.g. an entropy bonus):
its class here, its setting in ``PolicyLossConfig``, one line in
``PPOClipLoss.build_terms``, and its metric in ``metric_keys.py``
(``docs/architecture.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from loggra_megatron.config import applies, at_least, check_fields, one_of
from loggra_megatron.model.output_head import LastHidden
from loggra_megatron.model.vocab_parallel import sampled_kl
from loggra_megatron.rl.losses import (
    AGGREGATIONS,
    AdaptiveKLCoefficient,
    aggregate,
    kl_to_reference,
    masked_mean,
    ppo_clip_per_token,
)


@dataclass
class PolicyLossConfig:
    """The policy loss (``--policy-loss``) and the settings of its terms."""

    policy_loss: str = "ppo_clip"
    """ppo_clip: the clipped surrogate (GRPO / Dr.GRPO / DAPO by --loss-aggregation) + β·KL to
    the reference model."""
    clip_low: float = 0.2
    """PPO clip range below 1."""
    clip_high: float = 0.28
    """PPO clip range above 1 (clip-higher)."""
    loss_aggregation: str = "token_mean"
    """token_mean (DAPO) | seq_mean_token_sum_norm (Dr.GRPO) | seq_mean_token_mean (GRPO)."""
    kl_ref_estimator: str = applies("k3", "with --kl-coef > 0", lambda s: s["kl_coef"] > 0)
    """k1 | k2 | k3."""
    tis_cap: float | None = None
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"): each response token's policy loss is weighted by
    ``min(π_old / π_rollout, C)``, π_old the trainer's log-probs at the rollout's weights and
    π_rollout the rollout engine's, so that the engine's numerics do not bias the gradient;
    ``C`` this cap (2 in the paper; ≥ 1). None: off. Needs an engine that samples its own
    log-probs (``--rollout-engine static``); the trainer's π_old then comes from the training
    forward (one PPO epoch, one mini-batch) or a forward after the rollout."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("policy_loss", one_of(*POLICY_LOSSES), f"one of {', '.join(POLICY_LOSSES)}"),
                ("clip_low", lambda c: 0 <= c < 1, "in [0, 1)"),
                ("clip_high", at_least(0), ">= 0"),
                ("loss_aggregation", one_of(*AGGREGATIONS), f"one of {', '.join(AGGREGATIONS)}"),
                ("kl_ref_estimator", one_of("k1", "k2", "k3"), "one of k1, k2, k3"),
                ("tis_cap", at_least(1), ">= 1 (2 is typical; omit it to disable)"),
            ],
        )


@dataclass(frozen=True)
class Aggregation:
    """Per-token values ``[b, s]`` → this micro-batch's share of the mini-batch loss
    (``aggregate``)."""

    mode: str = "token_mean"
    """``--loss-aggregation``."""
    num_tokens: float | None = None
    """Valid tokens of the mini-batch over all micro-batches and DP ranks (None: this
    micro-batch's own)."""
    num_seqs: float | None = None
    """Sequences of the mini-batch over all micro-batches and DP ranks (None: its own)."""
    max_len: int | None = None
    """Dr.GRPO's constant length (``--max-new-tokens``; None: the micro-batch's width)."""

    def __call__(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return aggregate(values, mask, self.mode, self.num_tokens, self.num_seqs, self.max_len)


@dataclass
class LossInputs:
    """One micro-batch as the terms read it (position ``t`` scores ``tokens[:, t + 1]``)."""

    batch: dict[str, torch.Tensor]
    """``tokens [b, s + 1]``, ``mask [b, s]`` (response targets), ``adv [b]`` (advantages),
    and where they exist: ``old [b, s]`` (π_old of the PPO ratio; absent: this forward's own
    log-probs, the one update of an on-policy step), ``rollout [b, s]`` (the log-probs the
    rollout engine sampled with), ``ref [b, s]`` (reference log-probs)."""
    log_probs: torch.Tensor
    """``[b, s]`` log π_θ of the targets (differentiable)."""
    aggregate: Aggregation
    output: LastHidden | None = None
    """The micro-batch's last hidden states and output weight shard (None where a term is
    tried on given log-probs alone): a term that needs more than ``log_probs`` (e.g. an
    entropy bonus) computes it from these in token chunks, as
    ``model.output_head`` does for the log-probs."""

    @property
    def mask(self) -> torch.Tensor:
        return self.batch["mask"]


class LossTerm(Protocol):
    """One additive term: ``(its value, its metrics)`` on a micro-batch; the value carries the
    term's coefficient and the aggregation's global denominators."""

    def __call__(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class ClippedSurrogate:
    """The PPO-clip surrogate with clip-higher (``rl/losses.py``), each token's loss weighted
    by the truncated importance weight ``w = min(exp(log π_old − log π_rollout), C)`` (detached)
    with ``--tis-cap C``. π_old is the batch's ``old``, or this forward's own log-probs
    (detached: ratio 1) where the batch has none. Metrics (declared in ``metric_keys.py``):
    the term, the clipped fraction, the mean ratio, the k3 KL(π_old ‖ π_θ), and with the
    rollout engine's log-probs their mismatch and the mean TIS weight."""

    def __init__(self, clip_low: float, clip_high: float, tis_cap: float | None = None):
        self.clip_low, self.clip_high, self.tis_cap = clip_low, clip_high, tis_cap

    def __call__(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        b, m, new = x.batch, x.mask.bool(), x.log_probs.detach()
        old = b["old"].detach() if "old" in b else new
        per_token, clipped, ratio = ppo_clip_per_token(
            x.log_probs, old, b["adv"], m, self.clip_low, self.clip_high
        )
        metrics = {}
        sampled = b.get("rollout")
        if sampled is not None:
            metrics["rollout/logprob_mismatch"] = masked_mean((sampled - new).abs(), m)
        if self.tis_cap is not None:
            if sampled is None:
                raise ValueError("--tis-cap needs the rollout engine's log-probs ('rollout')")
            log_w = (old - sampled).clamp(max=math.log(self.tis_cap))
            weight = torch.where(m, log_w.exp(), 1.0)  # [b, s]
            per_token = per_token * weight
            metrics["tis/weight_mean"] = masked_mean(weight, m)
        loss = x.aggregate(per_token, m)
        old_new = sampled_kl(torch.where(m, old, 0.0), torch.where(m, new, 0.0), "k3")
        return loss, {
            "loss/policy": loss.detach(),
            "clip/fraction": masked_mean(clipped.float(), m),
            "ratio/mean": masked_mean(ratio, m),
            "kl/old_new": masked_mean(old_new, m),
            **metrics,
        }


class KLToReference:
    """β · the aggregated k1/k2/k3 estimate of KL(π_θ ‖ π_ref), β read at each call from the
    (adaptive) coefficient. Metrics (``metric_keys.py``): the β-scaled term and the unscaled
    token mean; zeros without a reference model."""

    def __init__(self, estimator: str, coef: AdaptiveKLCoefficient):
        self.estimator, self.coef = estimator, coef

    def __call__(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        beta, ref = self.coef.value, x.batch.get("ref")
        if ref is None:
            if beta != 0.0:
                raise ValueError("a KL coefficient != 0 needs the reference log-probs ('ref')")
            zero = x.log_probs.new_zeros(())
            return zero, {"loss/kl_ref": zero, "kl/ref": zero}
        kl = kl_to_reference(x.log_probs, ref, x.mask, self.estimator)  # [b, s]
        loss = beta * x.aggregate(kl, x.mask)
        return loss, {"loss/kl_ref": loss.detach(), "kl/ref": masked_mean(kl, x.mask)}


class PolicyLoss:
    """``loss(batch, last_hidden, counts) -> (loss, metrics)``: the sum of ``terms`` on a
    micro-batch, plus ``loss/total``. ``counts``: ``(valid tokens, sequences)`` of the
    mini-batch over DP (``global_counts``), so that the
    micro-batch losses add up to the mini-batch loss (None: this micro-batch's own).

    A registered loss is built as ``cls(settings, max_len, kl_coef)`` and says
    which terms it sums (``build_terms``)."""

    def __init__(
        self,
        settings: PolicyLossConfig,
        max_len: int | None,
        kl_coef: AdaptiveKLCoefficient,
    ):
        self.settings, self.max_len = settings, max_len
        self.terms: list[LossTerm] = self.build_terms(settings, kl_coef)

    def build_terms(
        self, settings: PolicyLossConfig, kl_coef: AdaptiveKLCoefficient
    ) -> list[LossTerm]:
        raise NotImplementedError

    def __call__(
        self,
        batch: dict[str, torch.Tensor],
        output: LastHidden,
        counts: tuple[float, float] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        num_tokens, num_seqs = counts if counts is not None else (None, None)
        aggregation = Aggregation(
            self.settings.loss_aggregation, num_tokens, num_seqs, self.max_len
        )
        return self.sum_terms(LossInputs(batch, output.log_probs(), aggregation, output))

    def sum_terms(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The terms, in order, on ``x``: ``(their sum, their metrics + loss/total)``."""
        total, metrics = None, {}
        for term in self.terms:
            value, term_metrics = term(x)
            total = value if total is None else total + value
            metrics.update(term_metrics)
        metrics["loss/total"] = total.detach()
        return total, metrics


class PPOClipLoss(PolicyLoss):
    """GRPO / Dr.GRPO / DAPO: the clipped surrogate + β · KL to the reference, one aggregation
    for both."""

    def build_terms(
        self, settings: PolicyLossConfig, kl_coef: AdaptiveKLCoefficient
    ) -> list[LossTerm]:
        return [
            ClippedSurrogate(settings.clip_low, settings.clip_high, settings.tis_cap),
            KLToReference(settings.kl_ref_estimator, kl_coef),
        ]


POLICY_LOSSES: dict[str, type[PolicyLoss]] = {"ppo_clip": PPOClipLoss}
"""``--policy-loss`` name → loss class (one line per loss)."""

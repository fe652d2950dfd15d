"""The per-token math of the GRPO / PPO-clip losses (the loss object that sums them:
``rl.policy_loss``), the KL penalty to a reference model, and adaptive β::

    A_i = (r_i − mean(r)) / (std(r) + eps)    (GRPO; Dr.GRPO: r_i − mean(r))
    ℓ = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A),   ρ = exp(log π_θ − log π_old)
    k1 = −δ,  k2 = δ²/2,  k3 = e^δ − 1 − δ,   δ = log π_ref − log π_θ
    β_{t+1} = β_t (1 + K_β · clip((KL_t − KL_target) / KL_target, −0.2, 0.2))

Per-token values are aggregated (``token_mean``, ``seq_mean_token_sum_norm``,
``seq_mean_token_mean``) over DP-global denominators, so the micro-batch losses add up exactly
to the full-batch loss and their gradients are summed. Citations: GRPO (Shao et al. 2024,
DeepSeekMath), Dr.GRPO (Liu et al. 2025), PPO (Schulman et al. 2017), DAPO's clip-higher
(Yu et al. 2025), KL estimators (Schulman 2020), adaptive β (Ziegler et al. 2019).

Formulas, aggregation and their sources: docs/losses.md#advantages
"""

from __future__ import annotations

import math

import torch

from loggra_megatron.model.vocab_parallel import sampled_kl

AGGREGATIONS = ("token_mean", "seq_mean_token_sum_norm", "seq_mean_token_mean")
_MAX_LOG_RATIO = 20.0  # exp(20) ≈ 4.9e8: keeps ρ finite in fp32 for wildly stale tokens
_MAX_KL_ERROR = 0.2  # Ziegler et al.: clip of the proportional error


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages; ``rewards [P*G]`` or ``[P, G]`` (prompt-major) → ``[P*G]``.

    ``normalize_std=True``: GRPO, divide by the sample std plus ``eps``;
    ``False``: Dr.GRPO, mean-centering only.
    """
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2 (a group of one has no baseline), got {group_size}"
        )
    r = rewards.double()  # a group of rewards near float32's range overflows its own sums
    if r.dim() == 2 and r.shape[1] != group_size:
        raise ValueError(f"rewards of shape {tuple(r.shape)} do not have group_size={group_size}")
    if r.dim() not in (1, 2) or r.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(r.shape)} do not split into groups of {group_size}"
        )
    r = r.reshape(-1, group_size)  # [P, G]
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, correction=1, keepdim=True) + eps)
    return adv.reshape(-1).float()  # [P*G]


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str = "token_mean",
    num_tokens_global: int | float | torch.Tensor | None = None,
    num_seqs_global: int | float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values [B, T]`` over the valid tokens ``mask [B, T]`` to a scalar.

    Padded positions may hold anything (even NaN/inf): they are selected away, not
    multiplied by zero. Denominators default to this micro-batch's own counts, floored
    at 1 so that an all-padding micro-batch contributes 0.
    """
    m = mask.bool()
    x = torch.where(m, values.float(), 0.0)  # [B, T]
    if aggregation == "token_mean":
        denom = m.sum().clamp(min=1) if num_tokens_global is None else num_tokens_global
        return x.sum() / denom
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    n_seqs = m.any(dim=-1).sum().clamp(min=1) if num_seqs_global is None else num_seqs_global
    if aggregation == "seq_mean_token_sum_norm":
        return x.sum() / (n_seqs * (max_len if max_len is not None else m.shape[-1]))
    per_seq = x.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)  # [B]; empty rows give 0
    return per_seq.sum() / n_seqs


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain token mean over this micro-batch (for logged metrics), detached."""
    m = mask.bool()
    return (torch.where(m, values.detach().float(), 0.0).sum() / m.sum().clamp(min=1)).detach()


def ppo_clip_per_token(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate; returns ``(loss [B, T], clipped [B, T] bool, ρ [B, T])``.

    ``advantages`` is ``[B]`` (one per sequence, GRPO) or ``[B, T]`` (per token, e.g. GAE).
    ``logp_old`` is treated as a constant. Masked tokens get log-ratio 0 (ρ = 1) before
    the exp, so non-finite padding never reaches the values or the gradients.
    """
    log_ratio = logp.float() - logp_old.detach().float()  # [B, T]
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, 0.0)
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()  # [B, T]
    adv = advantages.detach().float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # [B, 1]
    unclipped = -adv * ratio
    clipped_branch = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = clipped_branch > unclipped  # the min picks the constant branch: zero gradient
    return torch.where(clipped, clipped_branch, unclipped), clipped, ratio


def kl_to_reference(
    logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token estimate of ``KL(π_θ ‖ π_ref)`` ``[B, T]``, zero on padding.

    Gradients flow into ``logp`` only; reduce with ``aggregate`` (as the policy loss's
    ``KLToReference`` does) to stay consistent with
    the policy loss.
    """
    m = mask.bool()
    kl = sampled_kl(  # samples from p = π_θ, so logp_old=policy, logp_new=reference
        torch.where(m, logp.float(), 0.0), torch.where(m, logp_ref.detach().float(), 0.0), estimator
    )
    return torch.where(m, kl, 0.0)


class AdaptiveKLCoefficient:
    """β for the KL-to-reference penalty: adaptive (Ziegler et al. 2019) or fixed.

    ``ref_kl_target=None`` → fixed β (``--kl-ref-target``; not ``--kl-target``, which is
    predicted-KL step control's). ``update(kl, n_steps)`` takes the measured KL (same units
    as ``ref_kl_target``, e.g. the ``kl/ref`` metric averaged over the step) and the
    step's size in the units of ``horizon`` (Ziegler et al.: samples, horizon 10 000).
    """

    def __init__(
        self, init_coef: float, ref_kl_target: float | None = None, horizon: float = 10_000.0
    ):
        if init_coef < 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if ref_kl_target is not None and ref_kl_target <= 0:
            raise ValueError(
                f"ref_kl_target must be > 0 (or None for a fixed β), got {ref_kl_target}"
            )
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.ref_kl_target = None if ref_kl_target is None else float(ref_kl_target)
        self.horizon = float(horizon)

    @property
    def adaptive(self) -> bool:
        return self.ref_kl_target is not None

    def update(self, kl: float | torch.Tensor, n_steps: float = 1) -> float:
        """One controller step; returns the new β (unchanged in fixed mode)."""
        if not self.adaptive:
            return self.value
        k_beta = float(n_steps) / self.horizon
        if k_beta * _MAX_KL_ERROR >= 1.0:
            raise ValueError(f"n_steps/horizon = {k_beta} would make β non-positive (max 5)")
        kl = float(kl)
        if not math.isfinite(kl):
            raise ValueError(f"measured KL is not finite: {kl}")
        target = self.ref_kl_target
        error = min(max((kl - target) / target, -_MAX_KL_ERROR), _MAX_KL_ERROR)
        self.value *= 1.0 + k_beta * error
        return self.value

    def state_dict(self) -> dict[str, float | None]:
        return {"value": self.value, "ref_kl_target": self.ref_kl_target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.value = float(state["value"])
        target = state.get("ref_kl_target", state.get("kl_target"))  # older checkpoints
        self.ref_kl_target = None if target is None else float(target)
        self.horizon = float(state["horizon"])

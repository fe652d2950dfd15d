"""Token log-probabilities and KL divergences from vocab-parallel logits.

With tensor parallelism the output layer's logits are split over the vocabulary: TP rank
t holds ``z[..., V_t]`` for its shard ``V_t`` of the vocabulary. Every per-token quantity
is then a sum over shards, so each function computes its shard's partial and combines the
partials with an all-reduce over the TP group (``tp_group=None``: the logits are whole).

Log-softmax (per token)::

    lse(z) = log Σ_v e^{z_v} = M + log Σ_t Σ_{v∈V_t} e^{z_v − M},   M = max_t max_{v∈V_t} z_v
    log π(a) = z_a − lse(z)             # z_a lives on one shard; the others add 0

Exact KL(π_old ‖ π_new) per token, from the *partial log-prob deltas*::

    KL = Σ_v p_v (log p_v − log q_v)
       = Σ_t Σ_{v∈V_t} p_v (z_v − z'_v)  −  lse(z) + lse(z')          (Σ_v p_v = 1)

so one all-reduce of ``[tokens]`` floats combines ``Σ_{v∈V_t} p_v (z_v − z'_v)`` after the
two log-sum-exps (each a max and a sum all-reduce of ``[tokens]``).

Sampled estimators (Schulman 2020, "Approximating KL divergence"), for tokens ``a ~ π_old``
and ``δ = log q(a) − log p(a)``: ``k1 = −δ`` (unbiased, high variance, can be negative),
``k2 = δ²/2`` (biased, low variance), ``k3 = e^δ − 1 − δ`` (unbiased, non-negative).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ESTIMATORS = ("full", "k1", "k2", "k3")


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def vocab_parallel_logsumexp(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """``log Σ_v e^{z_v}`` over the whole vocabulary; ``logits [..., V/TP]`` → ``[...]``."""
    z = logits.float()
    m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, tp_group)
    s = _all_reduce((z - m.unsqueeze(-1)).exp().sum(dim=-1), dist.ReduceOp.SUM, tp_group)
    return m + s.log()


def vocab_parallel_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0, tp_group=None
) -> torch.Tensor:
    """``log π(targets)`` from vocab-parallel ``logits [..., V/TP]`` and ``targets [...]``.

    ``vocab_start`` is the first vocabulary id of this rank's shard.
    """
    z = logits.float()
    local = targets - vocab_start
    mine = (local >= 0) & (local < z.shape[-1])
    target_logit = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _all_reduce(target_logit * mine, dist.ReduceOp.SUM, tp_group)
    return target_logit - vocab_parallel_logsumexp(z, tp_group)


def vocab_parallel_kl(
    logits_old: torch.Tensor, logits_new: torch.Tensor, tp_group=None
) -> torch.Tensor:
    """Exact per-token ``KL(softmax(z_old) ‖ softmax(z_new))`` over the full vocabulary."""
    z_old, z_new = logits_old.float(), logits_new.float()
    lse_old = vocab_parallel_logsumexp(z_old, tp_group)
    lse_new = vocab_parallel_logsumexp(z_new, tp_group)
    p_old = (z_old - lse_old.unsqueeze(-1)).exp()
    partial = (p_old * (z_old - z_new)).sum(dim=-1)  # this shard's Σ p (z − z')
    return _all_reduce(partial, dist.ReduceOp.SUM, tp_group) - lse_old + lse_new


def sampled_kl(logp_old: torch.Tensor, logp_new: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token k1/k2/k3 estimate of ``KL(π_old ‖ π_new)`` at tokens sampled from π_old."""
    delta = logp_new.float() - logp_old.float()
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return torch.expm1(delta) - delta
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of k1, k2, k3")

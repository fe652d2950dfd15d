"""Token log-probabilities and KL divergences from vocab-parallel logits.

With tensor parallelism the output layer's logits are split over the vocabulary: TP rank
t holds ``z[..., V_t]`` for its shard ``V_t`` of the vocabulary. Every per-token quantity
is then a sum over shards, so each function computes its shard's partial and combines the
partials with an all-reduce over the TP group (``tp_group=None``: the logits are whole).
Megatron splits the (padded) vocabulary evenly, so TP rank ``t``'s shard starts at id
``t · V/TP`` (:func:`vocab_shard_start`, the one place that offset is derived).

Log-softmax (per token)::

    lse(z) = log Σ_v e^{z_v} = M + log Σ_t Σ_{v∈V_t} e^{z_v − M},   M = max_t max_{v∈V_t} z_v
    log π(a) = z_a − lse(z)             # z_a lives on one shard; the others add 0

Exact KL(π_old ‖ π_new) per token, from the *partial log-prob deltas*::

    KL = Σ_v p_v (log p_v − log q_v)
       = Σ_t Σ_{v∈V_t} p_v (z_v − z'_v)  −  lse(z) + lse(z')          (Σ_v p_v = 1)

so one all-reduce of ``[tokens]`` floats combines the shards' ``Σ_{v∈V_t} e^{z_v−M}
(z_v − z'_v)`` (divided by the log-sum-exp's sum afterwards), next to the two
log-sum-exps (each a max and a sum all-reduce of ``[tokens]``).

Gradients. Every rank back-propagates the same (replicated) per-token result, so the
gradient of a TP sum with respect to this rank's partial is the identity: the sums
(:func:`vocab_parallel_sum`) use :class:`_AllReduceSum` (all-reduce forward, identity
backward; Megatron's
``reduce_from_tensor_model_parallel_region`` with an explicit group). The max ``M`` is a
numerical shift that cancels in ``lse``, so it is detached; an all-reduce that autograd
cannot see would otherwise route a wrong gradient to each shard's local maximum.

Sampled estimators (Schulman 2020, "Approximating KL divergence"), for tokens ``a ~ π_old``
and ``δ = log q(a) − log p(a)``: ``k1 = −δ`` (unbiased, high variance, can be negative),
``k2 = δ²/2`` (biased, low variance), ``k3 = e^δ − 1 − δ`` (unbiased, non-negative).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ESTIMATORS = ("full", "k1", "k2", "k3")


def _split(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` in the forward pass, identity in the backward pass."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def vocab_parallel_sum(partial: torch.Tensor, tp_group=None) -> torch.Tensor:
    """The sum over the TP group of this rank's per-token ``partial`` (a sum over its shard
    of the vocabulary), the same on every rank, with the identity backward."""
    return _AllReduceSum.apply(partial, tp_group) if _split(tp_group) else partial


def vocab_shard_start(shard_width: int, tp_group=None) -> int:
    """The first vocabulary id of this TP rank's shard of ``shard_width`` ids."""
    return dist.get_rank(tp_group) * shard_width if _split(tp_group) else 0


def _shifted_exp(z: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M [...], e^{z − M} [..., V/TP])`` with ``M`` the (detached) global max."""
    m = z.detach().max(dim=-1).values  # a shift: every result below is independent of it
    if _split(tp_group):
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    return m, (z - m.unsqueeze(-1)).exp()


def vocab_parallel_logsumexp(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """``log Σ_v e^{z_v}`` over the whole vocabulary; ``logits [..., V/TP]`` → ``[...]``."""
    m, e = _shifted_exp(logits.float(), tp_group)
    return m + vocab_parallel_sum(e.sum(dim=-1), tp_group).log()


def vocab_parallel_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, tp_group=None
) -> torch.Tensor:
    """``log π(targets)`` from vocab-parallel ``logits [..., V/TP]`` and ``targets [...]``."""
    z = logits.float()
    local = targets - vocab_shard_start(z.shape[-1], tp_group)
    mine = (local >= 0) & (local < z.shape[-1])
    target_logit = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = vocab_parallel_sum(target_logit * mine, tp_group)
    return target_logit - vocab_parallel_logsumexp(z, tp_group)


def vocab_parallel_kl(
    logits_old: torch.Tensor, logits_new: torch.Tensor, tp_group=None
) -> torch.Tensor:
    """Exact per-token ``KL(softmax(z_old) ‖ softmax(z_new))`` over the full vocabulary.

    ``Σ_v p_v (z_v − z'_v) = A / S`` with the TP sums ``A = Σ e^{z−M} (z − z')`` and
    ``S = Σ e^{z−M}``, so that everything after the two all-reduces is replicated over TP
    (and the identity backward of the sums is exact)."""
    z_old, z_new = logits_old.float(), logits_new.float()
    m, e = _shifted_exp(z_old, tp_group)
    a = vocab_parallel_sum((e * (z_old - z_new)).sum(dim=-1), tp_group)
    s = vocab_parallel_sum(e.sum(dim=-1), tp_group)
    return a / s - (m + s.log()) + vocab_parallel_logsumexp(z_new, tp_group)


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

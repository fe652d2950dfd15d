"""Token log-probabilities and KL divergences from vocab-parallel logits.

With tensor parallelism TP rank ``t`` holds the logits ``z[..., V_t]`` of its vocabulary
shard ``V_t``, which starts at id ``t · V/TP`` (``vocab_shard_start``). Every per-token
quantity is a sum over shards: each function computes its shard's partial and all-reduces
``[tokens]`` floats over the TP group (``tp_group=None``: the logits are whole)::

    lse(z) = M + log Σ_t Σ_{v∈V_t} e^{z_v − M},   log π(a) = z_a − lse(z)
    KL(π_old ‖ π_new) = Σ_t Σ_{v∈V_t} p_v (z_v − z'_v) − lse(z) + lse(z')

The sums back-propagate as the identity (``_AllReduceSum``, Megatron's
``reduce_from_tensor_model_parallel_region``) and the max ``M`` is detached, so gradients are
exact at any TP size. Sampled estimators (Schulman 2020, "Approximating KL divergence"):
``k1 = −δ``, ``k2 = δ²/2``, ``k3 = e^δ − 1 − δ`` with ``δ = log q(a) − log p(a)``, ``a ~ π_old``.

Derivation and the communication pattern: docs/kl_control.md#vocab-parallel-log-probs-and-kl
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


def vocab_parallel_max(z: torch.Tensor, tp_group=None) -> torch.Tensor:
    """``M [...]``: the (detached) max of ``z [..., V/TP]`` over the whole vocabulary, a shift
    every log-softmax result below is independent of."""
    m = z.detach().max(dim=-1).values
    if _split(tp_group):
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    return m


def shard_targets(
    targets: torch.Tensor, shard_width: int, tp_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index into this rank's shard, clamped; whether the target is in the shard)`` of
    vocabulary ids ``targets [...]``."""
    local = targets - vocab_shard_start(shard_width, tp_group)
    mine = (local >= 0) & (local < shard_width)
    return local.clamp(0, shard_width - 1), mine


def _shifted_exp(z: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M [...], e^{z − M} [..., V/TP])`` with ``M`` the (detached) global max."""
    m = vocab_parallel_max(z, tp_group)
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
    local, mine = shard_targets(targets, z.shape[-1], tp_group)
    target_logit = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
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

"""Vocab-parallel log-probs and KL: TP=2 values *and gradients* equal TP=1 (float64)."""

import pytest
import torch

from loggra_megatron.model.vocab_parallel import (
    sampled_kl,
    vocab_parallel_kl,
    vocab_parallel_log_probs,
)
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

VOCAB = 16


def _paths(z_old, z_new, targets, group):
    """Every per-token quantity the trainer and the KL controller differentiate or use."""
    logp_old = vocab_parallel_log_probs(z_old, targets, group)
    logp_new = vocab_parallel_log_probs(z_new, targets, group)
    out = {"log_probs": logp_new, "exact_kl": vocab_parallel_kl(z_old, z_new, group)}
    for k in ("k1", "k2", "k3"):
        out[k] = sampled_kl(logp_old, logp_new, k)
    return out


def _values_and_grads(rank):
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(0)
    # spread-out logits so that the two shards have different local maxima
    z_old = 3 * torch.randn(3, 5, VOCAB, generator=gen, dtype=torch.float64)
    z_new = z_old + torch.randn(3, 5, VOCAB, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    tp, t = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    shard = slice(t * VOCAB // tp, (t + 1) * VOCAB // tp)
    results = {}
    for name in ("log_probs", "exact_kl", "k1", "k2", "k3"):
        runs = {}
        for split in (True, False):
            old = (z_old[..., shard] if split else z_old).clone().requires_grad_()
            new = (z_new[..., shard] if split else z_new).clone().requires_grad_()
            group = ps.get_tensor_model_parallel_group() if split else None
            value = _paths(old, new, targets, group)[name]
            (value * weights).sum().backward()
            grads = [
                g if g is not None else torch.zeros_like(x)
                for x, g in ((old, old.grad), (new, new.grad))
            ]
            if not split:
                grads = [g[..., shard] for g in grads]
            runs[split] = (value.detach(), *grads)
        results[name] = runs
    return results


@pytest.fixture(scope="module")
def tp2_results():
    return run_distributed(_values_and_grads, 2, tp=2)


@pytest.mark.parametrize("path", ["log_probs", "exact_kl", "k1", "k2", "k3"])
def test_tp2_gradient_equals_tp1(tp2_results, path):
    for rank_result in tp2_results:
        tp2, tp1 = rank_result[path][True], rank_result[path][False]
        for what, a, b in zip(("value", "grad old", "grad new"), tp2, tp1, strict=True):
            assert a.abs().max() > 0 or what != "grad new", (path, what)  # a real signal
            err = (a - b).abs().max().item()
            assert err <= 1e-6, f"{path} {what}: TP=2 differs from TP=1 by {err:.3g}"

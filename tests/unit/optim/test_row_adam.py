"""RowAdam, row SGD and the backward sketch's projection (torch only) against float64
references written from the formulas (docs/optimizer.md#the-backward-sketch)."""

import math

import pytest
import torch

from loggra_megatron.optim.backward_sketch.row_adam import RowAdam
from loggra_megatron.optim.backward_sketch.sketch import (
    draw_signs,
    gram_sq_norm,
    projection_seed,
    reconstruct,
)
from loggra_megatron.optim.param_remainders import join_master, weight_of

M, N, R = 12, 20, 6


def _reference(w0, grads, signs, lr, beta2, eps, wd, kind, clip=None):
    """float64 RowAdam/SGD: S = G Aᵀ (clipped by ‖S A‖), v, D, W ← (1 − lr λ) W − lr D A."""
    w, v = w0.double().clone(), torch.zeros(w0.shape[0], dtype=torch.float64)
    for t, (g, b) in enumerate(zip(grads, signs, strict=True), start=1):
        a = b.double() / math.sqrt(b.shape[0])
        s = g.double() @ a.t()
        if clip is not None:
            norm = (s @ a).norm()
            s = s * min(1.0, clip / (float(norm) + 1e-6))
        if kind == "adam":
            v = beta2 * v + (1 - beta2) * (s * s).mean(dim=1)
            d = s / ((v / (1 - beta2**t)).sqrt() + eps).unsqueeze(1)
        else:
            d = s
        w = (1 - lr * wd) * w - lr * d @ a
    return w


def _run(w0, grads, signs, kind, clip=None, remainders=False, **hp):
    if remainders:
        p = w0.to(torch.bfloat16).clone()
        rem = {p: torch.zeros(p.shape, dtype=torch.int16)}
    else:
        p, rem = w0.clone(), None
    opt = RowAdam([p], row_optimizer=kind, param_remainders=rem, **hp)
    if remainders:  # the master starts as the fp32 weight exactly
        opt.set_master(p, w0)
    for g, b in zip(grads, signs, strict=True):
        s = g @ (b.float() / math.sqrt(R)).t()
        if clip is not None:
            norm = gram_sq_norm(s, b).sqrt()
            opt.model_grad_scale = min(1.0, clip / (float(norm) + 1e-6))
        opt.set_sketches({p: (s, b)})
        opt.step()
    return opt.master_of(p).float(), opt, p


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("refresh", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_matches_float64_formulas_over_steps_with_redraws(kind, refresh, clip):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(M, N, generator=gen)
    grads = [torch.randn(M, N, generator=gen) for _ in range(5)]
    signs = [
        draw_signs(
            "rademacher", 3, step // refresh, "layer1.linear_qkv", R, N, "cpu", torch.float32
        )
        for step in range(5)
    ]
    hp = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    got, opt, p = _run(w0, grads, signs, kind, clip=clip, **hp)
    ref = _reference(w0, grads, signs, 0.01, 0.95, 1e-8, 0.1, kind, clip=clip)
    # fp32 round-off of |w| ~ 1 is ~1e-7 per element; the update itself is ~1e-2 per element
    assert (got.double() - ref).abs().max() < 1e-6
    assert (got.double() - ref).norm() / (ref - w0.double()).norm() < 1e-4
    assert opt.num_steps == 5
    assert set(opt.state.get(p, {})) == ({"exp_avg_sq"} if kind == "adam" else set())


def test_rowadam_has_one_moment_per_row_and_no_first_moment():
    w0 = torch.randn(M, N)
    _, opt, p = _run(w0, [torch.randn(M, N)], [torch.ones(R, N)], "adam", lr=0.1)
    (state,) = opt.state.values()
    assert state["exp_avg_sq"].shape == (M,) and state["exp_avg_sq"].dtype == torch.float32


def test_candidate_is_the_commit_bitwise_and_changes_nothing():
    gen = torch.Generator().manual_seed(1)
    for remainders in (False, True):
        w0 = torch.randn(M, N, generator=gen)
        g, b = (
            torch.randn(M, N, generator=gen),
            draw_signs("gaussian", 0, 0, "x", R, N, "cpu", torch.float32),
        )
        p = w0.to(torch.bfloat16).clone() if remainders else w0.clone()
        rem = {p: torch.zeros(p.shape, dtype=torch.int16)} if remainders else None
        opt = RowAdam([p], lr=0.05, weight_decay=0.1, param_remainders=rem)
        s = g @ (b / math.sqrt(R)).t()
        opt.set_sketches({p: (s, b)})
        before = opt.master_of(p).clone()
        seen = {}
        opt.write_candidate(lambda q, c, seen=seen: seen.setdefault("c", c.clone()), scale=0.5)
        assert torch.equal(opt.master_of(p), before)
        assert not opt.state.get(p, {}).get("exp_avg_sq", torch.zeros(1)).any()
        opt.param_groups[0]["lr"] = 0.05 * 0.5  # a commit at η = 0.5
        opt.step()
        committed = opt.master_of(p)
        assert torch.equal(seen["c"], committed)
        if remainders:  # the bf16 weight is the master rounded as the trial writes it
            assert torch.equal(p, weight_of(committed.clone()))


def test_remainder_masters_equal_fp32_masters_bitwise():
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(M, N, generator=gen).to(torch.bfloat16).float()
    grads = [torch.randn(M, N, generator=gen) for _ in range(3)]
    signs = [draw_signs("rademacher", 0, i, "w", R, N, "cpu", torch.float32) for i in range(3)]
    fp32, _, _ = _run(w0, grads, signs, "adam", lr=0.01, weight_decay=0.1)
    rem, opt, p = _run(w0, grads, signs, "adam", remainders=True, lr=0.01, weight_decay=0.1)
    assert torch.equal(fp32, rem)
    assert torch.equal(join_master(p, opt.param_remainders[p]), fp32)


def test_update_sq_norm_is_the_gram_form():
    gen = torch.Generator().manual_seed(3)
    w0, g = torch.randn(M, N, generator=gen), torch.randn(M, N, generator=gen)
    b = draw_signs("rademacher", 0, 0, "w", R, N, "cpu", torch.float32)
    p = w0.clone()
    opt = RowAdam([p], lr=0.1, weight_decay=0.0)
    opt.set_sketches({p: (g @ (b / math.sqrt(R)).t(), b)})
    dense = {}
    opt.write_candidate(lambda q, c: dense.setdefault("d", c - w0))
    assert float(opt.update_sq_norm()) == pytest.approx(float(dense["d"].square().sum()), rel=1e-5)


def test_projection_is_seeded_by_seed_draw_and_name_and_unbiased():
    a = draw_signs("rademacher", 1, 0, "layer1.linear_qkv", 64, 32, "cpu", torch.bfloat16)
    assert torch.equal(
        a, draw_signs("rademacher", 1, 0, "layer1.linear_qkv", 64, 32, "cpu", torch.bfloat16)
    )
    assert set(a.float().unique().tolist()) == {-1.0, 1.0}
    for other in (
        (2, 0, "layer1.linear_qkv"),
        (1, 1, "layer1.linear_qkv"),
        (1, 0, "layer2.linear_qkv"),
    ):
        assert not torch.equal(a, draw_signs("rademacher", *other, 64, 32, "cpu", torch.bfloat16))
    assert projection_seed(1, 0, "x") != projection_seed(1, 0, "y")
    # E[AᵀA] = I: the mean over many draws of AᵀA (A = B/√r) is close to the identity
    n, r = 16, 8
    acc = (
        sum(
            (lambda b: b.t() @ b / r)(draw_signs(kind, 0, i, "w", r, n, "cpu", torch.float64))
            for i in range(400)
            for kind in ("rademacher", "gaussian")
        )
        / 800
    )
    assert (acc - torch.eye(n)).abs().max() < 0.15


def test_reconstruct_and_gram_agree():
    gen = torch.Generator().manual_seed(4)
    s = torch.randn(5, R, generator=gen)
    b = draw_signs("gaussian", 0, 0, "w", R, N, "cpu", torch.float32)
    assert float(gram_sq_norm(s, b)) == pytest.approx(
        float(reconstruct(s, b).square().sum()), rel=1e-5
    )

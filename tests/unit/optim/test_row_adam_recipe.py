"""RowAdam's options from the published RL recipe (relative ε, per-weight norm restoration,
the update ratio) against float64 references written from the formulas
(docs/optimizer.md#the-published-rl-recipe)."""

import math

import torch

from loggra_megatron.optim.backward_sketch.row_adam import RowAdam
from loggra_megatron.optim.backward_sketch.sketch import draw_signs

R = 4
BETA2, EPS = 0.95, 1e-3


def _weights_and_sketches(seed=0):
    """Two weights of different widths, their sketches and signs (one draw)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 10), (5, 8)]
    weights = [torch.randn(m, n, generator=g) for m, n in shapes]
    signs = [
        draw_signs("rademacher", 3, 0, f"w{i}", R, n, "cpu", torch.float32)
        for i, (_, n) in enumerate(shapes)
    ]
    # rows of very different scales, so that a relative ε and RowAdam's reweighting matter
    scales = [torch.logspace(-3, 1, m).unsqueeze(1) for m, _ in shapes]
    sketches = [
        torch.randn(m, R, generator=g) * s for (m, _), s in zip(shapes, scales, strict=True)
    ]
    return weights, sketches, signs


def _reference_direction(s, relative_eps, restore_norm):
    s = s.double()
    v = (1 - BETA2) * (s * s).mean(dim=1)
    root = (v / (1 - BETA2)).sqrt()
    eps = EPS * float(root.mean()) if relative_eps else EPS
    d = s / (root + eps).unsqueeze(1)
    if restore_norm:
        d = d * (s.norm() / d.norm())
    return d


def _step(lr=0.01, **options):
    weights, sketches, signs = _weights_and_sketches()
    params = [w.clone() for w in weights]
    opt = RowAdam(params, lr=lr, betas=(0.9, BETA2), eps=EPS, **options)
    opt.set_sketches({p: (s, b) for p, s, b in zip(params, sketches, signs, strict=True)})
    opt.step()
    return weights, sketches, signs, params, opt


def test_relative_eps_and_norm_restoration_follow_their_formulas():
    for relative_eps in (False, True):
        for restore_norm in (False, True):
            weights, sketches, signs, params, _ = _step(
                relative_eps=relative_eps, restore_norm=restore_norm
            )
            for w, s, b, p in zip(weights, sketches, signs, params, strict=True):
                d = _reference_direction(s, relative_eps, restore_norm)
                expected = w.double() - 0.01 * d @ (b.double() / math.sqrt(R))
                torch.testing.assert_close(p.double(), expected, rtol=1e-5, atol=1e-6)


def test_a_relative_eps_changes_the_step_of_small_rows():
    """The rows 1e-3 below the largest would be divided by nearly ε alone; relative to the
    rows' mean √v̂ it is not negligible: the two steps differ."""
    _, _, _, absolute, _ = _step()
    _, _, _, relative, _ = _step(relative_eps=True)
    assert not torch.allclose(absolute[0], relative[0])


def test_restored_norm_equals_the_sketch_norm_per_weight():
    weights, sketches, signs, params, opt = _step(restore_norm=True)
    for w, s, b, p in zip(weights, sketches, signs, params, strict=True):
        step = (w - p).double()  # lr · D A
        d = step @ torch.linalg.pinv(b.double() / math.sqrt(R))  # recover lr · D
        assert math.isclose(float(d.norm() / 0.01), float(s.norm()), rel_tol=1e-4)


def test_update_ratio_sets_the_step_length_of_all_targets_together():
    ratio = 6e-5
    weights, _, _, params, opt = _step(lr=123.0, update_ratio=ratio)  # --lr is not read
    delta = math.sqrt(
        sum(float((w - p).double().square().sum()) for w, p in zip(weights, params, strict=True))
    )
    norm = math.sqrt(sum(float(w.double().square().sum()) for w in weights))
    # the rate is rounded to bf16 (8 bits of mantissa): within 2^-8 of the exact ratio
    assert abs(delta / norm - ratio) <= ratio * 2**-8
    assert opt.step_size == float(torch.tensor(opt.step_size).to(torch.bfloat16))


def test_trials_and_commit_share_one_plan_and_a_scale_above_one_is_exact():
    """``write_candidate`` at η is θ + η·Δθ of the committed step (η may exceed 1: KL control
    may grow a step), with the same update-ratio rate the commit uses."""
    weights, sketches, signs = _weights_and_sketches()
    params = [w.clone() for w in weights]
    opt = RowAdam(
        params,
        lr=0.0,
        betas=(0.9, BETA2),
        eps=EPS,
        update_ratio=1e-3,
        relative_eps=True,
        restore_norm=True,
    )
    opt.set_sketches({p: (s, b) for p, s, b in zip(params, sketches, signs, strict=True)})
    trials = {}
    opt.write_candidate(lambda p, c: trials.__setitem__(id(p), c.clone()), scale=2.5)
    before = [p.clone() for p in params]
    opt.step()
    for p, w in zip(params, before, strict=True):
        torch.testing.assert_close(trials[id(p)], w + 2.5 * (p - w), rtol=1e-5, atol=1e-7)

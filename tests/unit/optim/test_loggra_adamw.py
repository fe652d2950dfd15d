"""LoGRAAdamW against references: torch AdamW, exact subspaces, bitwise resume."""

import copy
import math
import warnings

import pytest
import torch

from loggra_megatron.optim import LoGRAAdamW, state_bytes
from loggra_megatron.optim.gradient_sketch.projection import (
    align_basis,
    gaussian_test_matrix,
    gram_svd_basis,
    range_finder_basis,
    svd_basis,
    transport_moments,
)


def _params(seed=0, shapes=((48, 80), (80, 48), (48,), (8, 6))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]


def _feed_grads(params, step, seed=1):
    gen = torch.Generator().manual_seed(seed * 10_000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_identity_projection_equals_torch_adamw():
    ours, ref = _params(), _params()
    opt = LoGRAAdamW(
        ours,
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        rank=8,  # unused: the identity projection keeps every column
        projection="identity",
        min_dim=1,
    )
    ref_opt = torch.optim.AdamW(ref, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(25):
        _feed_grads(ours, step)
        _feed_grads(ref, step)
        opt.step()
        ref_opt.step()
    assert all("basis" in opt.state[p] for p in ours[:2])  # the matrices took the sketch path
    assert _max_diff(ours, ref) <= 1e-6


def test_range_finder_recovers_exact_low_rank_subspace():
    gen = torch.Generator().manual_seed(3)
    m, n, r = 200, 120, 7
    a, b = torch.randn(m, r, generator=gen), torch.randn(n, r, generator=gen)
    grad = a @ b.t()
    omega = gaussian_test_matrix(m, r + 4, seed=11, device=torch.device("cpu"), dtype=torch.float32)
    q = range_finder_basis(grad, r, oversample=4, power_iters=0, omega_rows=omega)
    assert q.shape == (n, r)
    torch.testing.assert_close(q.t() @ q, torch.eye(r), atol=1e-5, rtol=0)
    true_basis = torch.linalg.qr(b).Q
    residual = true_basis - q @ (q.t() @ true_basis)  # part of span(b) that Q misses
    assert residual.norm() / true_basis.norm() < 1e-4
    # and it is the same subspace the full SVD (GaLore's basis) finds
    q_svd = svd_basis(grad, r)
    assert (q_svd - q @ (q.t() @ q_svd)).norm() < 1e-4


def test_gram_svd_basis_from_row_shards_equals_full_svd_columnwise():
    gen = torch.Generator().manual_seed(4)
    m, n, r = 90, 48, 6
    grad = torch.randn(m, n, generator=gen) @ torch.diag(0.8 ** torch.arange(n).float())
    shards = [grad[:31], grad[31:]]
    partial = [s.double().t() @ s.double() for s in shards]
    total = partial[0] + partial[1]

    def all_reduce(t):  # what a 2-rank sum over the row shards would return
        assert t.shape == (n, n)
        t.copy_(total)

    q = gram_svd_basis(shards[0], r, all_reduce)
    q_svd = svd_basis(grad, r)
    # the same vectors up to each column's sign
    torch.testing.assert_close((q.t() @ q_svd).abs(), torch.eye(r), atol=1e-4, rtol=0)
    assert not torch.allclose(gram_svd_basis(shards[0], r), q, atol=1e-2)  # needs the sum


def test_range_finder_with_power_iteration_beats_random_on_decaying_spectrum():
    gen = torch.Generator().manual_seed(5)
    m, n, r = 256, 128, 8
    u = torch.linalg.qr(torch.randn(m, n, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(n, n, generator=gen)).Q
    grad = u @ torch.diag(0.7 ** torch.arange(n, dtype=torch.float32)) @ v.t()
    omega = gaussian_test_matrix(m, r + 8, seed=2, device=torch.device("cpu"), dtype=torch.float32)
    q = range_finder_basis(grad, r, oversample=8, power_iters=1, omega_rows=omega)
    captured = (grad @ q).norm() ** 2 / grad.norm() ** 2
    optimal = (grad @ svd_basis(grad, r)).norm() ** 2 / grad.norm() ** 2
    assert captured > 0.999 * optimal


def test_align_and_transport_are_identity_for_a_rotated_basis():
    gen = torch.Generator().manual_seed(7)
    q_old = torch.linalg.qr(torch.randn(50, 6, generator=gen)).Q
    rot = torch.linalg.qr(torch.randn(6, 6, generator=gen)).Q
    q_new = align_basis(q_old @ rot, q_old)
    torch.testing.assert_close(q_new, q_old, atol=1e-5, rtol=0)
    m0, v0 = torch.randn(9, 6, generator=gen), torch.rand(9, 6, generator=gen)
    m, v = transport_moments(m0, v0, q_old, q_new)
    torch.testing.assert_close(m, m0, atol=1e-5, rtol=0)
    torch.testing.assert_close(v, v0, atol=1e-5, rtol=0)


def test_transport_permutation_is_exact_and_v_stays_nonnegative():
    gen = torch.Generator().manual_seed(8)
    q_old = torch.linalg.qr(torch.randn(30, 4, generator=gen)).Q
    perm = torch.tensor([2, 0, 3, 1])
    m0, v0 = torch.randn(5, 4, generator=gen), torch.rand(5, 4, generator=gen)
    m, v = transport_moments(m0, v0, q_old, q_old[:, perm])
    torch.testing.assert_close(m, m0[:, perm], atol=1e-6, rtol=0)
    torch.testing.assert_close(v, v0[:, perm], atol=1e-6, rtol=0)
    q_other = torch.linalg.qr(torch.randn(30, 4, generator=gen)).Q
    _, v = transport_moments(m, v, q_old, q_other)
    assert (v >= 0).all()


def _low_rank_regression(interval: int, steps: int = 12):
    """Least squares whose gradient (W X − Y) Xᵀ always has the row space span(X)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 5, generator=gen)
    y = torch.randn(96, 5, generator=gen)
    w = torch.nn.Parameter(torch.randn(96, 64, generator=gen) * 0.1)
    opt = LoGRAAdamW(
        [w], lr=1e-2, weight_decay=0.05, rank=5, oversample=3, update_interval=interval, min_dim=1
    )
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * (w @ x - y).pow(2).sum()).backward()
        opt.step()
    return w.detach()


def test_refresh_into_same_subspace_leaves_trajectory_unchanged():
    # interval=1 refreshes every step: each refresh finds the same 5-dim subspace in a
    # different rotation (fresh Gaussian test matrix); interval=1000 never refreshes.
    refreshed, never = _low_rank_regression(1), _low_rank_regression(1000)
    assert (refreshed - never).abs().max().item() < 1e-5


def test_state_bytes_matches_formula():
    shapes = ((48, 80), (80, 48), (48,), (8, 6))
    params = _params(shapes=shapes)
    rank = 12
    opt = LoGRAAdamW(params, rank=rank, min_dim=16)
    _feed_grads(params, 0)
    opt.step()
    sketched = [(48, 80), (80, 48)]
    dense_numel = 48 + 8 * 6
    floats = sum(2 * m * rank + n * rank for m, n in sketched) + 2 * dense_numel
    scalars = 2 * len(sketched) + (len(shapes) - len(sketched))  # int64 each: step (+ seed)
    assert state_bytes(opt) == 4 * floats + 8 * scalars
    dense = torch.optim.AdamW(_params(shapes=shapes))
    for p in dense.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    dense.step()
    assert sum(2 * m * n for m, n in sketched) * 4 > 3 * (state_bytes(opt) - 4 * 2 * dense_numel)


@pytest.mark.parametrize("projection", ["range_finder", "random", "svd"])
def test_save_load_continue_is_bitwise(projection):
    def make():
        params = _params()
        return params, LoGRAAdamW(
            params, lr=1e-2, rank=6, update_interval=3, projection=projection, min_dim=8
        )

    base_params, base = make()
    for step in range(10):
        _feed_grads(base_params, step)
        base.step()

    params, opt = make()
    for step in range(4):  # stop mid-interval, after a refresh
        _feed_grads(params, step)
        opt.step()
    saved_state = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in params]
    del opt, params

    params = [torch.nn.Parameter(t) for t in saved_params]
    opt = LoGRAAdamW(params, lr=99.0, rank=6)  # hyper-parameters come from the checkpoint
    opt.load_state_dict(saved_state)
    for step in range(4, 10):
        _feed_grads(params, step)
        opt.step()
    for a, b in zip(params, base_params, strict=True):
        assert torch.equal(a, b)
    assert opt.state[params[0]]["basis_seed"].dtype == torch.int64


@pytest.mark.parametrize("projection", ["range_finder", "svd", "random"])
def test_loggra_trains_a_small_mlp(projection):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=gen)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    with torch.no_grad():
        y = teacher(x)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = LoGRAAdamW(
        model.parameters(), lr=1e-2, rank=4, update_interval=10, projection=projection, min_dim=8
    )
    losses = []
    for _ in range(150):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert "basis" in opt.state[model[0].weight]
    assert losses[-1] < 0.2 * losses[0]


def test_residual_term_matches_hand_computed_first_step():
    gen = torch.Generator().manual_seed(9)
    w = torch.nn.Parameter(torch.randn(40, 30, generator=gen))
    w0 = w.detach().clone()
    grad = torch.randn(40, 30, generator=gen)
    lr, wd, rho, alpha, eps = 0.1, 0.01, 0.5, 0.8, 1e-8
    opt = LoGRAAdamW(
        [w], lr=lr, weight_decay=wd, rank=4, scale=alpha, residual_scale=rho, eps=eps, min_dim=1
    )
    w.grad = grad.clone()
    opt.step()
    q = opt.state[w]["basis"]
    s = grad @ q
    u = s / (s.abs() + eps)  # first bias-corrected Adam step: m̂ = s, v̂ = s²
    gamma = alpha * u.norm() / s.norm()
    expected = w0 * (1 - lr * wd) - lr * alpha * u @ q.t() - lr * rho * gamma * (grad - s @ q.t())
    torch.testing.assert_close(w.detach(), expected, atol=1e-5, rtol=0)


def test_nonfinite_gradient_skips_and_counts_without_touching_state():
    params = _params()
    opt = LoGRAAdamW(params, rank=6, update_interval=2, min_dim=8)
    for step in range(3):
        _feed_grads(params, step)
        opt.step()
    before_p = [p.detach().clone() for p in params]
    before_s = copy.deepcopy(opt.state_dict())
    _feed_grads(params, 3)
    params[0].grad[3, 5] = float("nan")  # sketched matrix, non-refresh step 4
    params[1].grad[0, 0] = float("inf")  # sketched matrix
    params[2].grad[1] = float("nan")  # dense vector
    opt.step()
    assert opt.num_nonfinite_skips == 3
    for i in range(3):
        assert torch.equal(params[i], before_p[i])
        for k, v in opt.state[params[i]].items():
            assert torch.equal(v, before_s["state"][i][k]), k
    assert not torch.equal(params[3], before_p[3])  # the finite param still stepped
    # a refresh step (step 5 with interval 2) with a NaN also skips before the basis is touched
    _feed_grads(params, 4)
    opt.step()
    _feed_grads(params, 5)
    params[0].grad[0, 0] = float("nan")
    basis = opt.state[params[0]]["basis"].clone()
    opt.step()
    assert torch.equal(opt.state[params[0]]["basis"], basis)
    assert all(torch.isfinite(t).all() for s in opt.state.values() for t in s.values())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(rank=0), "rank"),
        (dict(rank=-3), "rank"),
        (dict(update_interval=0), "update_interval"),
        (dict(projection="qr"), "projection"),
        (dict(betas=(1.0, 0.9)), "betas"),
        (dict(betas=(0.9, -0.1)), "betas"),
        (dict(lr=-1.0), "lr"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(lr=math.nan), "lr"),
    ],
)
def test_bad_input_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}="):
        LoGRAAdamW(_params(), **{"rank": 4, **kwargs})


def test_the_rank_has_no_default_here():
    """The rank depends on the model: its one default is ``LoGRAConfig.rank_for``
    (hidden size / 8), which a bare torch optimizer cannot know."""
    with pytest.raises(TypeError, match="rank"):
        LoGRAAdamW(_params())
    from loggra_megatron.optim.config import LoGRAConfig

    assert LoGRAConfig().rank_for(1024) == 128 and LoGRAConfig(loggra_rank=7).rank_for(1024) == 7


def test_bad_input_in_a_param_group_is_rejected():
    p = _params()
    with pytest.raises(ValueError, match="rank="):
        LoGRAAdamW([{"params": p[:2]}, {"params": p[2:], "rank": 0}], rank=4)


def test_rank_larger_than_matrix_is_clamped_with_one_warning():
    params = _params(shapes=((20, 30), (25, 10), (30, 30)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = LoGRAAdamW(params, rank=24, min_dim=1)
    messages = [str(w.message) for w in caught if "clamped" in str(w.message)]
    assert len(messages) == 1 and "2 matrices" in messages[0]
    _feed_grads(params, 0)
    opt.step()
    assert [opt.state[p]["basis"].shape[1] for p in params] == [20, 10, 24]


@pytest.mark.parametrize("projection", ["identity", "range_finder", "random"])
def test_captured_energy_of_a_weight_is_its_sketch_share(projection):
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(12, 10)), torch.nn.Parameter(torch.randn(10))
    opt = LoGRAAdamW([w, b], lr=1e-2, rank=3, min_dim=4, projection=projection)
    assert opt.captured_energy_of(w) is None  # no state yet
    for _ in range(2):
        w.grad, b.grad = torch.randn(12, 10), torch.randn(10)
        opt.step()
    got = opt.captured_energy_of(w)
    if projection == "identity":
        assert got == pytest.approx(1.0, abs=1e-12)
    else:
        q = opt.state[w]["basis"].double()
        g = w.grad.double()
        assert got == pytest.approx(float((g @ q).square().sum() / g.square().sum()), rel=1e-12)
        assert 0 < got < 1
    assert opt.captured_energy_of(b) is None  # dense

"""LoGRA-AdamW: AdamW whose state lives in low-rank gradient sketches.

For each sketched 2-D weight ``W ∈ R^{m×n}`` with gradient ``G`` and orthonormal right
basis ``Q ∈ R^{n×r}`` (see ``optim.gradient_sketch.projection``)::

    S = G Q;  M ← β1 M + (1 − β1) S;  V ← β2 V + (1 − β2) S ∘ S    # [m, r]
    W ← W − lr·(λ W + α M̂/(√V̂ + ε) Qᵀ)   # decoupled weight decay λ, scale α

``Q`` is refreshed every ``update_interval`` steps and the moments are transported into the
new basis; with ``projection="identity"`` (``Q = I``) this is exactly ``torch.optim.AdamW``.
No communication (single process; the distributed version is
``optim.gradient_sketch.distributed``).

Residual, dense params, state and exactness: docs/optimizer.md#update-rule.
References: GaLore (Zhao et al., ICML 2024), Flora (Hao et al., ICML 2024),
LDAdam (Robert et al., ICLR 2025), Fira (Chen et al., 2024), Halko et al. (SIAM Rev. 2011).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch

from loggra_megatron.optim.gradient_sketch.projection import (
    PROJECTIONS,
    align_basis,
    transport_moments,
)
from loggra_megatron.optim.gradient_sketch.settings import GradientSketchSettings

_SEED_STRIDE = 1_000_003
_SEED_MODULUS = 2**63  # seeds stay int64 (a checkpointed tensor) for any --seed below 2^63


_DEFAULTS = GradientSketchSettings()  # the one declaration of the defaults


def projection_of(group: dict):
    """The ``Projection`` of a param group."""
    return PROJECTIONS[group["projection"]]


def is_sketched(param: torch.Tensor, group: dict) -> bool:
    """Whether ``param`` takes the low-rank update under ``group``'s settings."""
    return group["sketch"] and projection_of(group).sketches(tuple(param.shape), group["min_dim"])


def sketch_rank(shape: tuple[int, int], group: dict) -> int:
    """Effective rank r for a sketched ``[m, n]`` weight (identity: n; else clamped)."""
    return projection_of(group).rank(shape, group["rank"])


class LoGRAAdamW(torch.optim.Optimizer):
    """AdamW with Adam's moments kept in low-rank gradient sketches.

    Args:
        params: parameters or param groups. Groups may override every keyword below,
            e.g. ``{"params": embeddings, "sketch": False}``.
        lr: learning rate (≥ 0).
        betas: ``(β1, β2)``, each in [0, 1).
        eps: term added to √V̂ (≥ 0).
        weight_decay: decoupled weight decay λ (≥ 0).
        rank: sketch rank r (> 0), required: it depends on the model (``pretrain_rl.py``
            takes hidden size / 8, ``LoGRAConfig.rank_for``). Clamped to ``min(m, n)``
            with one warning.
        update_interval: steps between basis refreshes (> 0).
        projection: ``"range_finder"`` | ``"svd"`` | ``"random"`` | ``"identity"``.
        oversample: extra range-finder probe vectors p (≥ 0).
        power_iters: range-finder power iterations q (≥ 0).
        scale: α, multiplies the low-rank update (> 0).
        residual_scale: ρ, weight of the stateless norm-matched residual (≥ 0; 0 = off).
        min_dim: matrices with a side shorter than this are updated densely (≥ 1).
        sketch: if False, every param of the group is updated densely.
        seed: base seed of the range finder's Gaussian test matrices.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        rank: int,
        update_interval: int = _DEFAULTS.loggra_update_interval,
        projection: str = _DEFAULTS.loggra_projection,
        oversample: int = _DEFAULTS.loggra_oversample,
        power_iters: int = _DEFAULTS.loggra_power_iters,
        scale: float = _DEFAULTS.loggra_scale,
        residual_scale: float = 0.0,
        min_dim: int = _DEFAULTS.loggra_min_dim,
        sketch: bool = True,
        seed: int = 0,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            rank=rank,
            update_interval=update_interval,
            projection=projection,
            oversample=oversample,
            power_iters=power_iters,
            scale=scale,
            residual_scale=residual_scale,
            min_dim=min_dim,
            sketch=sketch,
            seed=seed,
        )
        self._num_params_seen = 0
        self.num_nonfinite_skips = 0
        """How many (param, step) updates were skipped for non-finite gradients (not
        checkpointed; the trainer counts skipped steps itself)."""
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ validation
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        validate_group(group)
        clamped = []
        for p in group["params"]:
            p._loggra_index = self._num_params_seen  # stable id for the basis seed
            self._num_params_seen += 1
            if is_sketched(p, group) and projection_of(group).clamps(tuple(p.shape), group["rank"]):
                clamped.append(tuple(p.shape))
        if clamped:
            warnings.warn(
                f"LoGRAAdamW: rank={group['rank']} exceeds min(m, n) of {len(clamped)} "
                f"matrices (e.g. {clamped[0]}); their rank is clamped to min(m, n).",
                stacklevel=4,  # the caller of LoGRAAdamW(...)
            )

    # ------------------------------------------------------------------ state
    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        if not is_sketched(p, group):
            self.state[p] = dense_state(p)
            return self.state[p]
        m, n = p.shape
        r = sketch_rank((m, n), group)
        f32 = dict(device=p.device, dtype=torch.float32)
        self.state[p] = {
            "step": torch.zeros((), dtype=torch.int64),
            "exp_avg": torch.zeros(m, r, **f32),
            "exp_avg_sq": torch.zeros(m, r, **f32),
            "basis": projection_of(group).initial_basis(n, r, **f32),
            "basis_seed": torch.tensor(
                basis_seed(group["seed"], p._loggra_index), dtype=torch.int64
            ),
        }
        return self.state[p]

    def load_state_dict(self, state_dict: dict) -> None:
        """Like ``torch.optim.Optimizer.load_state_dict`` but keeps saved dtypes exactly
        (torch would cast the fp32 sketches and int64 seeds to the param dtype)."""
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        id_to_param = dict(zip(saved_ids, params, strict=True))
        for pid, saved in state_dict["state"].items():
            p = id_to_param[pid]
            self.state[p] = {
                k: v.to(p.device if v.dim() else "cpu", copy=True) for k, v in saved.items()
            }

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] if p in self.state else self._init_state(p, group)
                master = p if p.dtype == torch.float32 else p.float()
                grad = p.grad.float()
                if "basis" in state:
                    applied = self._sketched_update(master, grad, state, group)
                else:
                    applied = self._dense_update(master, grad, state, group)
                if not applied:
                    self.num_nonfinite_skips += 1
                elif master is not p:
                    p.copy_(master)
        return loss

    @torch.no_grad()
    def captured_energy_of(self, p: torch.Tensor) -> float | None:
        """``‖G Q‖² / ‖G‖²`` of ``p``'s gradient in its basis: after ``step``, the share of
        the gradient energy that step's sketch kept (1 for the identity projection). None
        for a param that is not a sketched matrix here (dense, no gradient or no state yet,
        or a 1-D shard of ``ShardedLoGRAAdamW``,
        whose per-family metric is ``optim.megatron.gradient_energy``). Computed
        on request: one pass over ``G``, none in ``step``."""
        state = self.state.get(p, {})
        if p.grad is None or p.dim() != 2 or "basis" not in state:
            return None
        grad = p.grad.double()
        energy = float(grad.square().sum())
        return float((grad @ state["basis"].double()).square().sum()) / energy if energy else None

    def _dense_update(self, p, grad, state, group) -> bool:
        if not torch.isfinite(grad).all():
            return False
        direction, step_size = self._adam_direction(p, grad, state, group)
        p.add_(direction, alpha=-step_size)
        return True

    def _sketched_update(self, p, grad, state, group) -> bool:
        basis = state["basis"]  # [n, r]
        refresh = needs_refresh(int(state["step"]), group)
        if refresh:
            if not torch.isfinite(grad).all():
                return False
            self._refresh_basis(grad, state, group, first=int(state["step"]) == 0)
        sketch = grad @ basis  # [m, r]
        if not refresh and not torch.isfinite(sketch).all():
            return False  # a non-finite entry of G makes its whole sketch row non-finite
        direction, step_size = self._adam_direction(p, sketch, state, group)  # [m, r]
        p.addmm_(direction, basis.t(), alpha=-step_size * group["scale"])
        if group["residual_scale"] > 0:  # lr·ρ·γ with γ = α‖Û‖/‖S‖ (norm-matched)
            gain = float(direction.norm() / sketch.norm().clamp_min(1e-30))
            coef = step_size * group["scale"] * group["residual_scale"] * gain
            p.add_(grad, alpha=-coef).addmm_(sketch, basis.t(), alpha=coef)
        return True

    @staticmethod
    def _adam_direction(p, g, state, group) -> tuple[torch.Tensor, float]:
        """Advance the step, decay ``p``, update the moments with ``g`` (a gradient or a
        sketch) and return ``(M / (√V̂ + ε), lr / (1 − β1^t))``, as torch's AdamW does."""
        state["step"] += 1
        p.mul_(1 - group["lr"] * group["weight_decay"])
        _, _, direction, step_size = adam_moments(
            state["exp_avg"], state["exp_avg_sq"], g, int(state["step"]), group, inplace=True
        )
        return direction, step_size

    @staticmethod
    def _refresh_basis(grad, state, group, first: bool) -> None:
        r = state["basis"].shape[1]
        seed = refresh_seed(int(state["basis_seed"]), int(state["step"]), group)
        install_basis(projection_of(group).local_basis(grad, r, seed, group), state, first)


def dense_state(p: torch.Tensor, dtype: torch.dtype | None = None) -> dict:
    """Fresh AdamW state of a densely updated param (moments in ``dtype``, default the
    param's)."""
    return {
        "step": torch.zeros((), dtype=torch.int64),
        "exp_avg": torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format),
    }


def needs_refresh(steps_done: int, group: dict) -> bool:
    """Whether the basis is recomputed before step ``steps_done + 1``."""
    return projection_of(group).refreshes and steps_done % group["update_interval"] == 0


def basis_seed(base_seed: int, param_index: int) -> int:
    """Seed of one weight's test matrices: its index mixed with the optimizer's seed."""
    return (base_seed * _SEED_STRIDE + param_index) % _SEED_MODULUS


def refresh_seed(basis_seed: int, steps_done: int, group: dict) -> int:
    """Seed of the Gaussian test matrix of one refresh: a function of state only."""
    return (basis_seed * _SEED_STRIDE + steps_done // group["update_interval"]) % _SEED_MODULUS


def refreshed_state(q_raw: torch.Tensor, state: dict, first: bool):
    """``(basis, exp_avg, exp_avg_sq)`` after installing ``q_raw``: aligned to the old basis
    with the moments transported (new tensors; ``state`` is not changed)."""
    if first:
        return q_raw, state["exp_avg"], state["exp_avg_sq"]
    q_new = align_basis(q_raw, state["basis"])
    exp_avg, exp_avg_sq = transport_moments(
        state["exp_avg"], state["exp_avg_sq"], state["basis"], q_new
    )
    return q_new, exp_avg, exp_avg_sq


def install_basis(q_raw: torch.Tensor, state: dict, first: bool) -> None:
    """Make ``q_raw`` the basis: align it to the old one and transport the moments."""
    for key, value in zip(
        ("basis", "exp_avg", "exp_avg_sq"), refreshed_state(q_raw, state, first), strict=True
    ):
        state[key].copy_(value)


def adam_moments(exp_avg, exp_avg_sq, g, step: int, group: dict, inplace: bool, lr=None):
    """Adam's moments updated with ``g`` (a gradient or a sketch) at 1-based ``step``, the
    direction ``M / (√V̂ + ε)`` and the step size ``lr / (1 − β1^t)``, computed as torch's
    AdamW does (``lr``: the group's unless given). In place for a step; on new tensors for a
    candidate that changes nothing.

    Returns ``(exp_avg, exp_avg_sq, direction, step_size)``.
    """
    beta1, beta2 = group["betas"]
    if inplace:
        m = exp_avg.lerp_(g, 1 - beta1)
        v = exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    else:
        m = exp_avg.lerp(g, 1 - beta1)
        v = exp_avg_sq.mul(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
    return m, v, m / denom, (group["lr"] if lr is None else lr) / (1 - beta1**step)


def validate_group(group: dict) -> None:
    """Raise ``ValueError`` naming the first invalid hyper-parameter of ``group``."""

    def bad(name: str, why: str):
        raise ValueError(f"LoGRAAdamW: invalid {name}={group[name]!r}: {why}")

    for name in ("lr", "eps", "weight_decay", "residual_scale"):
        if not group[name] >= 0:
            bad(name, "must be >= 0")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        bad("betas", "each beta must be in [0, 1)")
    for name in ("rank", "update_interval", "min_dim"):
        if isinstance(group[name], bool) or not isinstance(group[name], int) or group[name] <= 0:
            bad(name, "must be a positive integer")
    for name in ("oversample", "power_iters"):
        if not isinstance(group[name], int) or group[name] < 0:
            bad(name, "must be a non-negative integer")
    if group["projection"] not in PROJECTIONS:
        bad("projection", f"choose one of {', '.join(PROJECTIONS)}")
    if not group["scale"] > 0:
        bad("scale", "must be > 0")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Exact bytes of a torch optimizer's state: every tensor in ``optimizer.state`` (a
    Megatron-Core optimizer: ``optim.megatron.optimizer_state.state_bytes``)."""
    return sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )

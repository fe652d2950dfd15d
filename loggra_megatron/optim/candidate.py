"""Side-effect-free candidate updates of an inner optimizer (for predicted-KL control).

``write_candidate(inner, write, scale)`` computes the parameters the next ``step()`` would
produce, scaled by η (``θ + η·Δθ``), and hands them to ``write(param, candidate)`` one
param at a time, without changing any parameter or optimizer state. Transients are one
param's worth; LoGRA's sketched updates are applied from their factors (``U Qᵀ``), dense
ones are recomputed from the Adam moments. Because AdamW's decay and update both scale
with lr, committing ``θ + η·Δθ`` is exactly a ``step()`` with ``lr·η``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loggra_megatron.optim.gradient_sketch.adamw import adam_moments

WriteFn = Callable[[torch.Tensor, torch.Tensor], None]


def write_candidate(inner: torch.optim.Optimizer, write: WriteFn, scale: float = 1.0) -> bool:
    """Pass ``θ + scale·Δθ`` of every param with a gradient to ``write``; change nothing.

    Supports LoGRA's optimizers and ``torch.optim.AdamW`` (Megatron's dense Adam on CPU
    and without TE/apex). Returns False if the step would be skipped (LoGRA: a
    non-finite gradient on some rank).
    """
    if hasattr(inner, "write_candidate"):
        return inner.write_candidate(write, scale)
    if isinstance(inner, torch.optim.AdamW):
        return _adamw_candidate(inner, write, scale)
    raise TypeError(
        f"predicted-KL control cannot compute a candidate update for {type(inner).__name__}; "
        "use --optimizer loggra or torch's AdamW"
    )


def update_sq_norm(inner: torch.optim.Optimizer) -> torch.Tensor | None:
    """``‖Δθ‖²`` of the update the next ``step()`` would make at the group's lr over the
    params this optimizer holds, weight decay left out (local: the caller all-reduces);
    changes nothing. None when the optimizer cannot tell."""
    if hasattr(inner, "update_sq_norm"):
        return inner.update_sq_norm()
    if isinstance(inner, torch.optim.AdamW):
        return _adamw_update_sq_norm(inner)
    return None


def _adamw_directions(opt: torch.optim.AdamW):
    """``(param, group, direction, step size)`` of this step's AdamW update of every param
    with a gradient, computed aside (the state is not changed)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = opt.state.get(p, {})
            exp_avg = state.get("exp_avg", torch.zeros_like(p))
            exp_avg_sq = state.get("exp_avg_sq", torch.zeros_like(p))
            step = int(state.get("step", 0)) + 1
            _, _, direction, step_size = adam_moments(
                exp_avg, exp_avg_sq, p.grad, step, group, inplace=False
            )
            yield p, group, direction, step_size


@torch.no_grad()
def _adamw_update_sq_norm(opt: torch.optim.AdamW) -> torch.Tensor:
    total = None
    for _, _, direction, step_size in _adamw_directions(opt):
        norm = step_size**2 * direction.float().square().sum()
        total = norm if total is None else total + norm
    return torch.zeros(()) if total is None else total


@torch.no_grad()
def _adamw_candidate(opt: torch.optim.AdamW, write: WriteFn, scale: float) -> bool:
    if any(g.get("amsgrad") or g.get("maximize") for g in opt.param_groups):
        raise NotImplementedError("candidate updates need AdamW without amsgrad/maximize")
    for p, group, direction, step_size in _adamw_directions(opt):
        target = p.detach().clone().mul_(1 - scale * group["lr"] * group["weight_decay"])
        write(p, target.add_(direction, alpha=-scale * step_size))
    return True

"""RowAdam: the published LoGRA's optimizer of sketched weights (torch only).

Each parameter is a block of whole rows ``W[rows]`` (``[k, n]``) of a sketched weight (a DP
rank's own rows, ``optim.megatron.backward_sites``). Its gradient is never
formed: the caller hands the optimizer the rows' sketch ``S = G Aᵀ`` (``[k, r]``, fp32, already
reduced) and the projection's signs ``B`` (``A = B/√r``, or a function returning them, called
at each use: the Megatron adapter's unpacks the update's one draw, kept as bits) with
``RowAdam.set_sketches`` before each step; ``model_grad_scale`` is the clip coefficient
(Megatron's chained optimizer sets it, ``optim.megatron.model_grads``). With ``t`` the number
of updates so far + 1:

    adam:  v_i ← β₂ v_i + (1 − β₂) · mean_j S_ij²       one fp32 second moment per row
           D   = S / (√v̂ + ε)                           v̂ = v / (1 − β₂ᵗ), row by row
    sgd:   D   = S
    both:  W ← (1 − lr·λ) W − lr · D A                   decoupled weight decay

A fresh ``A`` every update makes a first moment in sketch space meaningless, hence none
(arXiv:2610.06647, "RowAdam"). β₂ is RowAdam's own (``--loggra-row-beta2``, 0.95 as in the
paper's recipe), not Adam's. State: ``exp_avg_sq`` (``[k]`` fp32) per parameter (adam);
nothing per parameter (sgd).

The paper's RL recipe adds three options, each a whole-weight or all-targets quantity (the
caller sums the partial sums over the ranks that hold parts of it: ``sum_over_layer``,
``sum_over_targets``):

    relative_eps:  ε ← ε · mean_i √v̂_i                  over the rows of the whole weight
    restore_norm:  D ← D · ‖S‖_F / ‖D‖_F                  per weight: RowAdam reweights rows,
                                                          the weight's step length is the sketch's
    update_ratio:  lr ← round_bf16(ρ · ‖W‖ / ‖D A‖)       over all targets together, so that
                                                          ‖ΔW‖_F / ‖W‖_F = ρ (``--lr`` unused)

Masters: a parameter is an fp32 master (its own tensor, or the fp32 weight rows), or, with
``param_remainders``, the bf16 weight rows whose exact fp32 master is ``weight + int16
remainder`` (``optim.param_remainders``).

Predicted-KL control: ``write_candidate`` hands ``θ + η·Δθ`` of every parameter to a
callback with nothing changed; it runs the very arithmetic of ``step`` at ``lr·η``, so a
commit at η is the trial bit for bit. ``update_sq_norm`` is ``‖Δθ‖²`` in the Gram form. The
directions are computed once per step (``_plan``) and reused by the trials and the commit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loggra_megatron.optim.backward_sketch.row_updates import ROW_UPDATES
from loggra_megatron.optim.backward_sketch.sketch import gram_sq_norm, reconstruct
from loggra_megatron.optim.param_remainders import join_master, store_master


def row_target(master, rate: float, weight_decay: float, direction, signs) -> torch.Tensor:
    """``(1 − rate·λ)·master − rate·D·A``: a row block's updated fp32 master (a new tensor),
    the one arithmetic of every commit (``RowAdam.step``) and of its repetition elsewhere."""
    target = master.float().mul(1 - rate * weight_decay)
    return target.sub_(reconstruct(direction, signs).mul_(rate))


@dataclass
class _Plan:
    """What an update needs beyond each parameter's own rows: computed once per step."""

    grad_scale: float
    """The clip coefficient it was computed under."""
    eps: dict
    """``{p: ε}`` (relative ε: ``ε·mean √v̂`` of p's weight)."""
    factor: dict
    """``{p: ‖S‖/‖D‖}`` of p's weight (``restore_norm``), else 1."""
    rate: float | None
    """The update ratio's rate of every target, or None (each group's ``lr``)."""


def _no_sum(x):
    return x


class RowAdam(torch.optim.Optimizer):
    """RowAdam (or row SGD) over row blocks of sketched weights (module docstring).

    Args:
        params: row blocks ``[k, n]`` (fp32 masters, or bf16 rows with ``param_remainders``).
        lr, betas, eps, weight_decay: as AdamW (β₁ is unused: there is no first moment; β₂
            is RowAdam's own).
        row_optimizer: a ``ROW_UPDATES`` entry (``adam`` | ``sgd``).
        param_remainders: ``{bf16 row block: int16 remainder}`` of the same shape.
        relative_eps, restore_norm, update_ratio: the paper's recipe (module docstring).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        row_optimizer: str = "adam",
        param_remainders: dict[torch.Tensor, torch.Tensor] | None = None,
        relative_eps: bool = False,
        restore_norm: bool = False,
        update_ratio: float | None = None,
    ):
        if row_optimizer not in ROW_UPDATES:
            raise ValueError(f"row_optimizer={row_optimizer!r}: one of {', '.join(ROW_UPDATES)}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.row_optimizer = row_optimizer
        self.row_update = ROW_UPDATES[row_optimizer]
        self.param_remainders = param_remainders or {}
        self.relative_eps, self.restore_norm = relative_eps, restore_norm
        self.update_ratio = update_ratio
        self.num_steps = 0
        """Updates committed (bias correction; the projection's draw index)."""
        self.candidates_are_commits = True
        self.model_grad_scale = 1.0
        """The clip coefficient the sketches are scaled by (1: not clipped)."""
        self.sum_over_layer: Callable[[dict], dict] = _no_sum
        """``{p: [c] partial sums over p's rows}`` → the sums over the whole weight ``p`` is a
        block of (the Megatron adapter adds the other DP / TP ranks' blocks)."""
        self.sum_over_targets: Callable[[torch.Tensor], torch.Tensor] = _no_sum
        """A tensor of partial sums over this rank's blocks → the sums over every target."""
        self.rate_scale = 1.0
        """η of a commit under ``update_ratio`` (``MegatronStepper.commit`` sets it, as it
        scales each group's lr otherwise): the rate is ``η·ρ‖W‖/‖D A‖``."""
        self.step_size = float("nan")
        """The last step's rate of the targets (``lr``, or the update ratio's)."""
        self._sketches: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._planned: _Plan | None = None
        self.recorded: list[tuple] | None = None
        """A list (None: off): ``step`` appends ``(p, D, rate, weight decay, updates before
        it)`` of each update it commits, what ``row_target`` needs to repeat it elsewhere
        (the low-rank weight sync: ``placement.lowrank``)."""

    # ------------------------------------------------------------------ state
    def init_state_of(self, p: torch.Tensor) -> dict:
        """``p``'s state, allocated (zeros) if it has none yet."""
        state = self.state[p]
        for key, zeros in self.row_update.init_state(p).items():
            state.setdefault(key, zeros)
        return state

    def set_sketches(self, sketches: dict):
        """``{param: (S rows [k, r] fp32, signs B [r, n] or a function returning them)}`` of
        the coming step."""
        self._sketches = sketches
        self._planned = None

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s fp32 master (a new tensor with remainders, else ``p`` itself)."""
        if p in self.param_remainders:
            return join_master(p, self.param_remainders[p])
        return p

    def set_master(self, p: torch.Tensor, master: torch.Tensor) -> None:
        """Set ``p``'s fp32 master (a checkpoint's), exactly."""
        if p in self.param_remainders:
            store_master(p, self.param_remainders[p], master.detach().float().clone())
        else:
            p.copy_(master.view_as(p))

    # ------------------------------------------------------------------ the update
    def _scaled_sketches(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p in self._sketches:
                    sketch, signs = self._sketches[p]
                    if self.model_grad_scale != 1.0:
                        sketch = sketch * self.model_grad_scale
                    yield p, group, sketch, signs

    def _row_update(self, p, group, sketch) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
        """``(p's new state, N, its rows' root or None)`` of the row update, computed aside."""
        state = self.init_state_of(p)
        return self.row_update.update(sketch, state, group["betas"][1], self.num_steps + 1)

    def _direction(self, p, group, sketch, plan: _Plan):
        """``(D, p's new state)`` under ``plan``, computed aside."""
        new_state, direction, root = self._row_update(p, group, sketch)
        if root is not None:
            direction = direction / root.add_(plan.eps.get(p, group["eps"])).unsqueeze(1)
        factor = plan.factor.get(p, 1.0)
        return (direction if factor == 1.0 else direction * factor), new_state

    def _updates(self):
        """``(p, group, signs, D, p's new state, rate)`` of every parameter with a sketch."""
        plan = self._plan()
        for p, group, sketch, signs in self._scaled_sketches():
            signs = signs() if callable(signs) else signs
            rate = group["lr"] if plan.rate is None else plan.rate * self.rate_scale
            yield p, group, signs, *self._direction(p, group, sketch, plan), rate

    def _plan(self) -> _Plan:
        """The step's whole-weight and all-target quantities, computed once (collective with
        ``relative_eps``, ``restore_norm`` or ``update_ratio``: every rank plans each step)."""
        if self._planned is not None and self._planned.grad_scale == self.model_grad_scale:
            return self._planned
        plan = _Plan(self.model_grad_scale, {}, {}, None)
        if self.relative_eps and self.row_update.has_root:
            plan.eps = self._relative_eps()
        if self.restore_norm:
            plan.factor = self._norm_factors(plan)
        if self.update_ratio is not None:
            plan.rate = self._ratio_rate(plan)
        self._planned = plan
        return plan

    def _relative_eps(self) -> dict:
        sums, eps = {}, {}
        for p, group, sketch, _ in self._scaled_sketches():
            _, _, root = self._row_update(p, group, sketch)
            sums[p] = torch.stack([root.sum(), root.new_tensor(float(root.numel()))])
            eps[p] = group["eps"]
        sums = self.sum_over_layer(sums)
        return {p: eps[p] * float(s[0] / s[1]) for p, s in sums.items()}

    def _norm_factors(self, plan: _Plan) -> dict:
        sums = {}
        for p, group, sketch, _ in self._scaled_sketches():
            direction, _ = self._direction(p, group, sketch, plan)
            sums[p] = torch.stack([sketch.square().sum(), direction.square().sum()])
        sums = self.sum_over_layer(sums)
        return {p: float((s[0] / s[1]).sqrt()) if float(s[1]) > 0 else 1.0 for p, s in sums.items()}

    def _ratio_rate(self, plan: _Plan) -> float:
        """``ρ·‖W‖/‖D A‖`` over all targets, rounded to bf16 (0 when there is no update)."""
        local = torch.zeros(2, dtype=torch.float32)
        for p, group, sketch, signs in self._scaled_sketches():
            direction, _ = self._direction(p, group, sketch, plan)
            signs = signs() if callable(signs) else signs
            local = local.to(direction.device)
            local[0] += self.master_of(p).float().square().sum()
            local[1] += gram_sq_norm(direction, signs)
        total = self.sum_over_targets(local)
        if not float(total[1]) > 0:
            return 0.0
        rate = self.update_ratio * float((total[0] / total[1]).sqrt())
        return float(torch.tensor(rate).to(torch.bfloat16))

    def _target(self, p, group, lr: float, direction, signs) -> torch.Tensor:
        return row_target(self.master_of(p), lr, group["weight_decay"], direction, signs)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One update of every parameter with a sketch; then the sketches are consumed."""
        for p, group, signs, direction, new_state, rate in self._updates():
            self.step_size = rate
            target = self._target(p, group, rate, direction, signs)
            for key, value in new_state.items():
                self.state[p][key].copy_(value)
            if self.recorded is not None:
                self.recorded.append((p, direction, rate, group["weight_decay"], self.num_steps))
            if p in self.param_remainders:
                store_master(p, self.param_remainders[p], target)
            else:
                p.copy_(target)
        self.num_steps += 1
        self.set_sketches({})

    @torch.no_grad()
    def write_candidate(self, write: Callable, scale: float = 1.0) -> bool:
        """``write(p, θ_p + scale·Δθ_p)`` for every parameter; nothing changes."""
        for p, group, signs, direction, _, rate in self._updates():
            write(p, self._target(p, group, rate * scale, direction, signs))
        return True

    @torch.no_grad()
    def update_sq_norm(self) -> torch.Tensor:
        """``‖Δθ‖²`` at the step's rate, weight decay left out (local; Gram form)."""
        total = torch.zeros((), dtype=torch.float32)
        for _, _, signs, direction, _, rate in self._updates():
            total = total.to(direction.device) + gram_sq_norm(direction, signs) * rate**2
        return total

    def basis_refresh_due(self) -> bool:
        """A fresh ``A`` is the method, not a change of subspace: never due."""
        return False

"""RowAdam: the published LoGRA's optimizer of sketched weights (torch only).

Each parameter is a block of whole rows ``W[rows]`` (``[k, n]``) of a sketched weight (a DP
rank's own rows, ``optim.megatron.sketch_sites``). Its gradient is never
formed: the caller hands the optimizer the rows' sketch ``S = G Aᵀ`` (``[k, r]``, fp32, already
reduced) and the projection's signs ``B`` (``A = B/√r``, or a function that draws them) with
``RowAdam.set_sketches`` before each step; ``model_grad_scale`` is the clip coefficient
(Megatron's chained optimizer sets it, ``optim.megatron.model_grads``). With ``t`` the number of updates so far + 1:

    adam:  v_i ← β₂ v_i + (1 − β₂) · mean_j S_ij²       one fp32 second moment per row
           D   = S / (√(v / (1 − β₂ᵗ)) + ε)              row by row; no first moment
    sgd:   D   = S
    both:  W ← (1 − lr·λ) W − lr · D A                   decoupled weight decay

A fresh ``A`` every update makes a first moment in sketch space meaningless, hence none
(arXiv:2610.06647, "RowAdam"). State: ``exp_avg_sq`` (``[k]`` fp32) per parameter (adam);
nothing per parameter (sgd).

Masters: a parameter is an fp32 master (its own tensor, or the fp32 weight rows), or, with
``param_remainders``, the bf16 weight rows whose exact fp32 master is ``weight + int16
remainder`` (``optim.param_remainders``).

Predicted-KL control: ``write_candidate`` hands ``θ + η·Δθ`` of every parameter to a
callback with nothing changed; it runs the very arithmetic of ``step`` at ``lr·η``, so a
commit at η is the trial bit for bit. ``update_sq_norm`` is ``‖Δθ‖²`` in the Gram form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loggra_megatron.optim.backward_sketch import gram_sq_norm, reconstruct
from loggra_megatron.optim.param_remainders import join_master, store_master

ROW_OPTIMIZERS = ("adam", "sgd")
"""``--loggra-row-optimizer`` choices."""


class RowAdam(torch.optim.Optimizer):
    """RowAdam (or row SGD) over row blocks of sketched weights (module docstring).

    Args:
        params: row blocks ``[k, n]`` (fp32 masters, or bf16 rows with ``param_remainders``).
        lr, betas, eps, weight_decay: as AdamW (β₁ is unused: there is no first moment).
        row_optimizer: ``adam`` | ``sgd``.
        param_remainders: ``{bf16 row block: int16 remainder}`` of the same shape.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        row_optimizer: str = "adam",
        param_remainders: dict[torch.Tensor, torch.Tensor] | None = None,
    ):
        if row_optimizer not in ROW_OPTIMIZERS:
            raise ValueError(f"row_optimizer={row_optimizer!r}: one of {', '.join(ROW_OPTIMIZERS)}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.row_optimizer = row_optimizer
        self.param_remainders = param_remainders or {}
        self.num_steps = 0
        """Updates committed (bias correction; the projection's draw index)."""
        self.candidates_are_commits = True
        self.model_grad_scale = 1.0
        """The clip coefficient the sketches are scaled by (1: not clipped)."""
        self._sketches: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ state
    def init_state_of(self, p: torch.Tensor) -> dict:
        """``p``'s state, allocated (zeros) if it has none yet."""
        state = self.state[p]
        if self.row_optimizer == "adam" and "exp_avg_sq" not in state:
            state["exp_avg_sq"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
        return state

    def set_sketches(self, sketches: dict):
        """``{param: (S rows [k, r] fp32, signs B [r, n] or a function returning them)}`` of
        the coming step."""
        self._sketches = sketches

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
    def _direction(self, p: torch.Tensor, group: dict, sketch: torch.Tensor):
        """``(D, new exp_avg_sq)`` of this update, computed aside."""
        if self.model_grad_scale != 1.0:
            sketch = sketch * self.model_grad_scale
        if self.row_optimizer == "sgd":
            return sketch, None
        beta2, eps = group["betas"][1], group["eps"]
        v = self.init_state_of(p)["exp_avg_sq"]
        new_v = v * beta2 + sketch.square().mean(dim=1) * (1 - beta2)
        correction = 1 - beta2 ** (self.num_steps + 1)
        denom = (new_v / correction).sqrt_().add_(eps)
        return sketch / denom.unsqueeze(1), new_v

    def _target(self, p, group, lr: float, direction, signs) -> torch.Tensor:
        """``(1 − lr·λ)·master − lr·D·A``: a new fp32 tensor."""
        target = self.master_of(p).float().mul(1 - lr * group["weight_decay"])
        return target.sub_(reconstruct(direction, signs).mul_(lr))

    def _updates(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p in self._sketches:
                    sketch, signs = self._sketches[p]
                    signs = signs() if callable(signs) else signs
                    yield p, group, signs, *self._direction(p, group, sketch)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One update of every parameter with a sketch; then the sketches are consumed."""
        for p, group, signs, direction, new_v in self._updates():
            target = self._target(p, group, group["lr"], direction, signs)
            if new_v is not None:
                self.state[p]["exp_avg_sq"].copy_(new_v)
            if p in self.param_remainders:
                store_master(p, self.param_remainders[p], target)
            else:
                p.copy_(target)
        self.num_steps += 1
        self._sketches = {}

    @torch.no_grad()
    def write_candidate(self, write: Callable, scale: float = 1.0) -> bool:
        """``write(p, θ_p + scale·Δθ_p)`` for every parameter; nothing changes."""
        for p, group, signs, direction, _ in self._updates():
            write(p, self._target(p, group, group["lr"] * scale, direction, signs))
        return True

    @torch.no_grad()
    def update_sq_norm(self) -> torch.Tensor:
        """``‖Δθ‖²`` at the group's lr, weight decay left out (local; Gram form)."""
        total = torch.zeros((), dtype=torch.float32)
        for _, group, signs, direction, _ in self._updates():
            total = total.to(direction.device) + gram_sq_norm(direction, signs) * group["lr"] ** 2
        return total

    def basis_refresh_due(self) -> bool:
        """A fresh ``A`` is the method, not a change of subspace: never due."""
        return False

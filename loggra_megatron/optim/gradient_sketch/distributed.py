"""LoGRA-AdamW on data-parallel shards: the inner optimizer of Megatron's DistributedOptimizer.

Megatron-Core's ``DistributedOptimizer`` (ZeRO-1) hands its inner optimizer 1-D fp32
slices ``[start, end)`` of each flattened, TP-local weight ``W ∈ R^{m×n}``; the slices
partition the weight across the data-parallel (DP) ranks without respecting rows. A
slice is at most a partial head row, a run of whole rows (the *body*) and a partial tail
row. With a right basis ``Q ∈ R^{n×r}`` shared by the DP ranks, row i of ``S = G Q``
depends only on row i of ``G``: each rank sketches its rows locally, the partial sketches
of rows split between ranks are summed with a small DP all-reduce (``[split rows, r]``
floats per weight), and a basis refresh all-reduces the range finder's row sums (over
TP × DP for column-parallel weights, none over TP for row-parallel ones), so the ranks
compute the same ``Q`` and the trajectory is DP-invariant. Non-finite gradients skip the
whole step on every rank. With ``projection="identity"`` the update is dense AdamW.

Sharding and communication per step and per refresh, TP, PP, bf16 gradients and
remainders: docs/optimizer.md#sharding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loggra_megatron.optim.gradient_sketch.adamw import (
    LoGRAAdamW,
    adam_moments,
    dense_state,
    needs_refresh,
    projection_of,
    refresh_seed,
    refreshed_state,
    validate_group,
)
from loggra_megatron.optim.gradient_sketch.energy_log import EnergyLog
from loggra_megatron.optim.gradient_sketch.row_sketch import RowShardedSketch, all_reduce_fn
from loggra_megatron.optim.gradient_sketch.weight_layout import WeightLayout
from loggra_megatron.optim.param_remainders import join_master, store_master

DENSE_PIECE_NUMEL = 1 << 22
"""Elements of a densely updated shard that one AdamW piece converts and updates at once
(4 Mi: 16 MiB per fp32 transient)."""


class ShardedLoGRAAdamW(LoGRAAdamW):
    """LoGRA-AdamW over 1-D shards of 2-D weights, with DP/TP collectives.

    Args:
        params: param groups of shard params (Megatron's fp32 main-param shards).
        all_layouts: every sketched weight of this optimizer in a canonical order that is
            the same on all ranks of ``dp_group`` (and of ``tp_dp_group``), including the
            weights this rank holds no slice of.
        held: ``{index into all_layouts: shard param}`` for the sketched shards held here.
        dp_rank: this rank's index in ``dp_group`` (its slice is ``dp_ranges[dp_rank]``).
        dp_group: data-parallel group the slices are spread over (None: one rank).
        tp_dp_group: TP × DP group for column-parallel weights (None: no TP).
        consensus_group: group over which a non-finite gradient anywhere skips the step.
        param_remainders: ``{bf16 shard param: int16 remainder}`` of params whose fp32
            master is kept as remainders (the shard is a view of the model's weight).
        energy_slots: rows of the captured-energy record of a step (0: none recorded); see
            ``energy``.
        **defaults: LoGRAAdamW hyper-parameters.
    """

    def __init__(
        self,
        params,
        all_layouts: list[WeightLayout],
        held: dict[int, torch.Tensor],
        dp_rank: int = 0,
        dp_group=None,
        tp_dp_group=None,
        consensus_group=None,
        param_remainders: dict[torch.Tensor, torch.Tensor] | None = None,
        energy_slots: int = 0,
        **defaults,
    ):
        self.param_remainders = param_remainders or {}
        self._all_layouts = all_layouts
        self._held = held
        self._index_of = {p: w for w, p in held.items()}
        self._dp_rank = dp_rank
        self._consensus_group = consensus_group
        self.num_steps = 0
        """Optimizer steps taken (skipped steps excluded); drives the refresh schedule."""
        self.skipped_last_step = False
        """The last ``step`` found a non-finite gradient on some rank and changed
        nothing. Skipped steps are counted by the trainer (``train.steps.SkipCounter``);
        through ``MegatronStepper`` the global
        grad norm catches them before this optimizer runs."""
        self.model_grads: dict[torch.Tensor, torch.Tensor] = {}
        """Gradients of main params whose ``.grad`` is None, in the model's precision (views
        of Megatron's grad buffer); see ``set_model_grads``."""
        self.model_grad_scale = 1.0
        """Clipping coefficient still to be applied to ``model_grads``."""
        self._candidates: dict | None = None
        """This step's sketches (and refreshed bases) by weight, kept from the first
        ``write_candidate`` for the later trials and the commit; see
        ``clear_candidate_cache``."""
        super().__init__(params, **defaults)
        group = self.param_groups[0]
        if any(g["residual_scale"] > 0 for g in self.param_groups):
            raise ValueError("loggra residual_scale > 0 is not supported with Megatron optimizers")
        self._settings = {k: group[k] for k in ("projection", "update_interval", "oversample")}
        self._settings["power_iters"] = group["power_iters"]
        self._projection = projection_of(group)
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        self._device = next(iter(self._group_of), torch.zeros(())).device
        """Where collective buffers live (also on ranks that hold no slice of a weight)."""
        self.energy = EnergyLog(energy_slots, self._device)
        """Captured energy of the committed steps (``optim.gradient_sketch.energy_log``)."""
        self._rows = RowShardedSketch(
            all_layouts,
            dp_rank,
            all_reduce_fn(dp_group),
            all_reduce_fn(tp_dp_group),
            self._projection,
            self._device,
        )

    candidates_are_commits = True
    """``write_candidate`` at η hands out, bit for bit, the fp32 masters that a step at
    ``lr·η`` stores (same sketch, same operations in the same order)."""

    def add_param_group(self, param_group: dict) -> None:
        """Register a group of shard params. Megatron's fp32 shards are views into its
        flat buffers (non-leaf tensors), which ``torch.optim.Optimizer.add_param_group``
        rejects, so groups are registered the way Megatron's DistributedOptimizer does."""
        group = dict(param_group)
        group["params"] = list(group["params"])
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        validate_group(group)
        self.param_groups.append(group)

    # ------------------------------------------------------------------ state
    def _init_state(self, p, group):
        if p not in self._index_of:
            self.state[p] = state = dense_state(p, torch.float32)
            state["step"].fill_(self.num_steps)
            return state
        layout = self._all_layouts[self._index_of[p]]
        lo, hi = layout.touched_rows(self._dp_rank)
        f32 = dict(device=p.device, dtype=torch.float32)
        n, r = layout.shape[1], layout.rank
        self.state[p] = state = {
            "step": torch.tensor(self.num_steps, dtype=torch.int64),
            "exp_avg": torch.zeros(hi - lo, r, **f32),
            "exp_avg_sq": torch.zeros(hi - lo, r, **f32),
            "basis": self._projection.initial_basis(n, r, **f32),
            "basis_seed": torch.tensor(layout.seed, dtype=torch.int64),
        }
        return state

    def init_state_of(self, p: torch.Tensor) -> dict:
        """Allocate (zero) state for ``p`` now, e.g. to load a checkpoint into."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        return self._init_state(p, group)

    def set_model_grads(self, grads: dict[torch.Tensor, torch.Tensor]) -> None:
        """Use ``{main param: low-precision gradient shard}`` as this step's gradients of
        main params whose ``.grad`` is None; each is converted to fp32 (and multiplied by
        ``model_grad_scale``, reset here to 1) only when its weight is updated."""
        self.model_grads, self.model_grad_scale = grads, 1.0
        self._candidates = None

    def _raw_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        return p.grad if p.grad is not None else self.model_grads.get(p)

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 (clipped) gradient of ``p``: a model-precision one is converted now."""
        return self._fp32(p, self._raw_grad(p))

    def _fp32(self, p: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` of ``p``'s raw gradient in fp32, clipped if it is a model grad (never
        in place: an fp32 model grad is a view of the grad buffer)."""
        if p.grad is not None or self.model_grad_scale == 1.0:
            return piece.float()
        if piece.dtype == torch.float32:
            return piece * self.model_grad_scale
        return piece.float().mul_(self.model_grad_scale)  # the conversion is ours

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master weight of shard param ``p`` (a new tensor if it is kept as a
        remainder, else ``p`` itself)."""
        remainder = self.param_remainders.get(p)
        return p.detach() if remainder is None else join_master(p.detach(), remainder)

    def set_master(self, p: torch.Tensor, master: torch.Tensor) -> None:
        """Set the fp32 master weight of shard param ``p`` (and the bf16 weight)."""
        remainder = self.param_remainders.get(p)
        if remainder is None:
            p.detach().copy_(master.view_as(p))
        else:
            store_master(p.detach(), remainder, master.detach().float().contiguous().clone())

    def _target(self, p: torch.Tensor, commit: bool) -> torch.Tensor:
        """The fp32 tensor an update is applied to: the master itself on a commit without
        remainders, else a transient copy."""
        master = self.master_of(p)
        return master if (commit or p in self.param_remainders) else master.clone()

    def _finish(self, p, target, commit: bool, write) -> None:
        """Hand a candidate to ``write``, or store a committed master (``target`` is the
        transient from ``_target`` and is consumed)."""
        if not commit:
            write(p, target)
        elif p in self.param_remainders:
            store_master(p.detach(), self.param_remainders[p], target)

    def layout_of(self, p: torch.Tensor) -> WeightLayout | None:
        """The layout of a sketched shard held here (None for densely updated params)."""
        w = self._index_of.get(p)
        return None if w is None else self._all_layouts[w]

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "ShardedLoGRAAdamW does not take a closure"
        self._run(commit=True)

    @torch.no_grad()
    def write_candidate(self, write, scale: float = 1.0) -> bool:
        """Compute this step's update without changing any parameter or state.

        Calls ``write(param, θ + scale·Δθ)`` once per param with a gradient (a transient
        tensor of the param's shape; sketched updates are applied from their factors).
        Collective like ``step``. Returns False if the step would be skipped.
        """
        return self._run(commit=False, write=write, scale=scale)

    def clear_candidate_cache(self) -> None:
        """Forget the sketches kept by ``write_candidate`` (new gradients are coming;
        ``MegatronStepper`` calls it when it
        prepares a step, and a commit clears it)."""
        self._candidates = None

    def _run(self, commit: bool, write=None, scale: float = 1.0) -> bool:
        """One step (``commit``) or one candidate, weight by weight in canonical order so
        that every rank issues the same collectives and transients stay per weight.

        The first candidate of a step (or ``project_gradients``) keeps each weight's
        sketch ``S = G Q`` (and the refreshed basis and moments on a refresh step): later
        candidates (other η) and the commit reuse them, so a step's gradient is projected
        once and its collectives (non-finite check, split-row all-gather and all-reduces)
        run once, however many trials predicted-KL control makes. The cache is
        ``[touched rows, r]`` per weight, the size of one Adam moment."""
        held = self._held_with_state()
        cache = self._candidate_cache(held, keep=not commit)
        if commit:
            self._candidates = None
            self.skipped_last_step = not cache["ok"]
        if not cache["ok"]:
            return False
        refresh = needs_refresh(self.num_steps, self._settings)
        for w, layout in enumerate(self._all_layouts):
            p = self._stepped(w)
            if w not in cache:
                cache[w] = self._project(w, layout, p, refresh, cache)
            basis_and_moments, sketch = cache.pop(w) if commit else cache[w]
            if p is not None:
                self._update_sketched(
                    p, layout, basis_and_moments, sketch, refresh, commit, scale, write
                )
        for p, group, state in held:
            if p not in self._index_of:
                self._update_dense(p, group, state, commit, scale, write)
        if commit:
            self.energy.record(cache["energy"])
            self.num_steps += 1
            self.model_grads = {}  # views of grad buffers that are about to be zeroed
        return True

    def _update_sketched(self, p, layout, basis_and_moments, sketch, refresh, commit, scale, write):
        """Adam on weight ``p``'s sketch and ``θ ← θ(1 − lr·wd) − step·(D Qᵀ)`` on its slice,
        handed to ``write`` (a candidate) or committed: the moments updated in place, after a
        refresh's new basis and moments replace the state's."""
        state, group = self.state[p], self._group_of[p]
        if commit and refresh:
            for key, value in zip(
                ("basis", "exp_avg", "exp_avg_sq"), basis_and_moments, strict=True
            ):
                state[key].copy_(value)
            basis_and_moments = (state["basis"], state["exp_avg"], state["exp_avg_sq"])
        basis, exp_avg, exp_avg_sq = basis_and_moments
        lr = group["lr"] * scale  # as a commit at lr·η computes it: trial == commit
        _, _, direction, step_size = adam_moments(
            exp_avg, exp_avg_sq, sketch, self.num_steps + 1, group, inplace=commit, lr=lr
        )
        target = self._target(p, commit)
        target.mul_(1 - lr * group["weight_decay"])
        self._rows.add_low_rank(target, layout, direction, basis, -step_size * group["scale"])
        state["step"] += int(commit)
        self._finish(p, target, commit, write)

    def _update_dense(self, p, group, state, commit, scale, write):
        """Dense AdamW on a param that is not sketched (as ``_update_sketched``), piece
        by piece (``_dense_directions``); a commit updates the master in place (with
        remainders: one piece's rebuilt master at a time), a candidate ``θ + Δθ`` is one whole
        transient."""
        lr = group["lr"] * scale
        decay = 1 - lr * group["weight_decay"]
        remainder = self.param_remainders.get(p)
        weight = p.detach().view(-1)
        target = None if commit else self._target(p, commit).view(-1)
        for lo, hi, direction, step_size in self._dense_directions(p, group, state, commit, lr):
            if target is not None:
                piece = target[lo:hi]
            elif remainder is not None:
                piece = join_master(weight[lo:hi], remainder.view(-1)[lo:hi])
            else:
                piece = weight[lo:hi]
            piece.mul_(decay).add_(direction, alpha=-step_size)
            if target is None and remainder is not None:
                store_master(weight[lo:hi], remainder.view(-1)[lo:hi], piece)
        state["step"] += int(commit)
        if not commit:
            write(p, target.view_as(p))

    def _dense_directions(self, p, group, state, commit: bool, lr=None):
        """``(lo, hi, direction, step size)`` of AdamW on flat elements ``[lo, hi)`` of ``p``,
        ``DENSE_PIECE_NUMEL`` at a time: the fp32 gradient and direction of one piece
        exist at once, not of the whole shard (a ``[V/t, h]`` embedding shard is the
        largest). Elementwise, so bitwise the whole shard's; the moments are updated in
        place when ``commit``."""
        raw = self._raw_grad(p).view(-1)
        m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        for lo in range(0, raw.numel(), DENSE_PIECE_NUMEL):
            hi = lo + DENSE_PIECE_NUMEL
            g = self._fp32(p, raw[lo:hi])
            _, _, direction, step_size = adam_moments(
                m[lo:hi], v[lo:hi], g, self.num_steps + 1, group, inplace=commit, lr=lr
            )
            yield lo, hi, direction, step_size

    @torch.no_grad()
    def project_gradients(self) -> bool:
        """Project this step's gradients now (every weight's sketch, and the refreshed bases
        on a refresh step; collective) and keep them for the candidates and the commit, which
        would otherwise compute them at the first of them (predicted-KL control calls it with
        the other gradient preparation, so its timer holds only its own work). Returns False
        if the step would be skipped."""
        cache = self._candidate_cache(self._held_with_state(), keep=True)
        if cache["ok"]:
            refresh = needs_refresh(self.num_steps, self._settings)
            for w, layout in enumerate(self._all_layouts):
                if w not in cache:
                    cache[w] = self._project(w, layout, self._stepped(w), refresh, cache)
        return cache["ok"]

    @torch.no_grad()
    def update_sq_norm(self) -> torch.Tensor | None:
        """``‖Δθ‖²`` of this step's update at the group's lr over the params held here,
        weight decay left out: a sketched weight's ``step·D Qᵀ`` has the norm of ``step·D``
        (Q has orthonormal columns; a row split between DP ranks counts on each). From the
        sketches kept by ``project_gradients`` (None before it, or when the step would be
        skipped); changes nothing, local (the caller all-reduces)."""
        cache = self._candidates
        if cache is None or not cache["ok"]:
            return None
        total = torch.zeros((), device=self._device)
        for w in range(len(self._all_layouts)):
            p = self._stepped(w)
            if p is not None:
                (_, exp_avg, exp_avg_sq), sketch = cache[w]
                group = self._group_of[p]
                _, _, direction, step_size = adam_moments(
                    exp_avg, exp_avg_sq, sketch, self.num_steps + 1, group, inplace=False
                )
                total += (step_size * group["scale"]) ** 2 * direction.square().sum()
        for p, group, state in self._held_with_state():
            if p not in self._index_of:
                for *_, direction, step_size in self._dense_directions(p, group, state, False):
                    total += step_size**2 * direction.square().sum()
        return total

    def basis_refresh_due(self) -> bool:
        """Whether the next step (or candidate) refreshes the sketch bases."""
        return needs_refresh(self.num_steps, self._settings)

    def _held_with_state(self) -> list[tuple[torch.Tensor, dict, dict]]:
        """``(param, group, state)`` of every param held here that has a gradient."""
        return [
            (p, g, self.state[p] if p in self.state else self._init_state(p, g))
            for g in self.param_groups
            for p in g["params"]
            if self._raw_grad(p) is not None
        ]

    def _candidate_cache(self, held, keep: bool) -> dict:
        """This step's kept projections; a new cache (non-finite check: collective) if there
        is none, kept for later candidates if ``keep``."""
        cache = self._candidates
        if cache is None:
            bad, norms = self._any_nonfinite([self._raw_grad(p) for p, _, _ in held])
            cache = {
                "ok": not bad,
                "norms": dict(zip((p for p, _, _ in held), norms, strict=True)),
                "energy": {},
            }
            if keep:
                self._candidates = cache
        return cache

    def _stepped(self, w: int) -> torch.Tensor | None:
        """The shard of sketched weight ``w`` held here if it has a gradient this step (else
        None: not held, or frozen; it joins the collectives with zeros)."""
        p = self._held.get(w)
        return p if p is not None and self._raw_grad(p) is not None else None

    def _project(self, w, layout, p, refresh: bool, cache: dict):
        """``(basis and moments, sketch)`` of weight ``w`` this step (collective)."""
        if refresh and self._projection.uses_gradient and "split_rows" not in cache:
            cache["split_rows"] = self._rows.gather_split_rows(self._raw_grad_of, self._fp32_of)
        state = self.state[p] if p is not None else None
        grad = self._grad(p).view(-1) if p is not None else None  # this weight's slice
        basis_and_moments = None
        if refresh:
            basis_and_moments = self._refreshed(w, grad, state, cache.get("split_rows", {}))
        elif p is not None:
            basis_and_moments = (state["basis"], state["exp_avg"], state["exp_avg_sq"])
        basis, moment = (basis_and_moments or (None, None))[:2]
        shape = None if moment is None else moment.shape
        sketch = self._rows.sketch(layout, grad, basis, shape)
        if p is not None and layout.energy_slot >= 0 and self.energy.slots:
            scale = self.model_grad_scale if p.grad is None else 1.0
            measured = EnergyLog.measure(layout, self._dp_rank, sketch, cache["norms"][p], scale)
            cache["energy"].setdefault(layout.energy_slot, []).append(measured)
        return basis_and_moments, sketch

    def _any_nonfinite(self, grads) -> tuple[bool, list[torch.Tensor]]:
        """Whether any rank of the consensus group holds a non-finite gradient: one fused
        norm per gradient (a non-finite entry makes its norm non-finite) and one scalar
        all-reduce. Also returns the norms (of the raw gradients, in ``grads``' order)."""
        bad, norms = torch.zeros(()), []
        if grads:
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # no fp32 grad copies
            bad = (~torch.isfinite(torch.stack(norms))).sum().float()
        group = self._consensus_group
        if group is not None and dist.get_world_size(group) > 1:
            bad = bad.to(self._device)
            dist.all_reduce(bad, group=group)
        return bool(bad > 0), list(norms)

    # ------------------------------------------------------------------ refresh
    def _refreshed(self, w, grad, state, split_rows):
        """``(basis, exp_avg, exp_avg_sq)`` of weight ``w`` after this step's basis refresh,
        as new tensors (None where this rank holds no slice, ``grad`` None). Collective over
        DP (and TP for column-parallel weights) unless the projection is random."""
        seed = refresh_seed(self._all_layouts[w].seed, self.num_steps, self._settings)
        q_raw = self._rows.basis(w, grad, seed, self._settings, split_rows)
        return None if grad is None else refreshed_state(q_raw, state, self.num_steps == 0)

    def _raw_grad_of(self, w: int) -> torch.Tensor | None:
        """The raw gradient slice of sketched weight ``w`` held here (None: none)."""
        p = self._held.get(w)
        return None if p is None else self._raw_grad(p)

    def _fp32_of(self, w: int, piece: torch.Tensor) -> torch.Tensor:
        return self._fp32(self._held[w], piece)

"""The backward sketch's optimizer inside Megatron-Core: a leaf chained with the dense one.

``--optimizer loggra --loggra-sketch backward`` builds a
``LoGRAChainedOptimizer`` (Megatron's
``ChainedOptimizer``) over

* the dense leaves: Megatron's (distributed) optimizer with LoGRA's AdamW inside and nothing
  sketched (``get_loggra_optimizer``) for every
  parameter that is not a target (embeddings, output layer, norms, biases). The targets were
  frozen before DDP wrapped the model (``optim.megatron.backward_sites``), so
  they are in none of its grad buffers;
* one ``BackwardSketchOptimizer`` (a ``MegatronOptimizer``) whose inner optimizer is
  ``RowAdam`` over this DP rank's rows of every target.

Together they have one ``step()`` (Megatron's ``ChainedOptimizer.step`` or
``MegatronStepper``), one clip norm (this leaf adds
``Σ ⟨S_i (A Aᵀ), S_i⟩`` over its rows to Megatron's single norm all-reduce; the chain hands the
clip coefficient to RowAdam as ``model_grad_scale``, as to the dense leaves), one non-finite
skip (a non-finite sketch makes the norm non-finite), and one ``sharded_state_dict``.

A step of this leaf:

1. ``prepare_grads``: reduce-scatter the flat sketch buffer over DP (each rank receives the
   summed ``S`` of its own rows, scaled as Megatron's DDP scales gradients; with
   ``--loggra-sketch-reduce microbatch`` the backward hooks did it), then all-reduce the rows
   of row-parallel targets over TP (their ``S`` was summed from column blocks) in one
   collective: they lie after the column-parallel rows of each segment.
2. ``step_with_ready_grads``: RowAdam updates the fp32 masters of its rows (or the bf16
   rows + int16 remainders), the rows are copied into the bf16 weights and all-gathered over
   DP (flat buffers of at most 40M elements, one all-gather each, pipelined with
   ``--overlap-param-gather``: ``backward_row_gather.py``), and the projection's draw index advances.

Bytes communicated per step: docs/optimizer.md#the-backward-sketch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer.optimizer import MegatronOptimizer

from loggra_megatron.optim.backward_sketch.row_adam import RowAdam
from loggra_megatron.optim.backward_sketch.sketch import ROW_GATHER_BUCKET_NUMEL
from loggra_megatron.optim.config import LoGRAConfig
from loggra_megatron.optim.megatron.backward_row_gather import row_gathers, sync_buckets
from loggra_megatron.optim.megatron.backward_sites import SketchSite, SketchSites
from loggra_megatron.optim.megatron.checkpoint import checkpoint_master, flat_sharded
from loggra_megatron.optim.megatron.model_grads import clip_coefficient
from loggra_megatron.optim.megatron.params import shares_storage
from loggra_megatron.optim.registry import SKETCH_MODES, UNTAGGED_SKETCH

FORMAT_VERSION = 1
LEGACY_META = {"sketch_matrix": "rademacher", "refresh_interval": 1}
"""What a checkpoint written before its meta carried these keys was saved with (the only
values the backward sketch had then)."""


class BackwardSketchOptimizer(MegatronOptimizer):
    """RowAdam on this rank's rows of the backward-sketched targets (module docstring).

    Args:
        config: the chain's Megatron ``OptimizerConfig`` (lr, betas, eps, weight decay,
            clipping, precision).
        loggra: LoGRA's settings (``loggra_row_optimizer``, ``loggra_param_remainders``).
        sites: the ``SketchSites`` of each model chunk.
        model_chunks: the DDP-wrapped chunks.
        grad_stats_group: the dense leaves' grad-stats group (one norm all-reduce).
    """

    def __init__(
        self, config, loggra: LoGRAConfig, sites: list[SketchSites], model_chunks, grad_stats_group
    ):
        if config.fp16:
            raise ValueError("--loggra-sketch backward supports bf16 and fp32 models, not fp16")
        self.sites = sites
        self.model_chunks = model_chunks
        self.grad_stats_parallel_group = grad_stats_group
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.dp_size = dist.get_world_size(self.dp_group)
        self.segment = self.dp_group.rank() if sites[0].segments > 1 else 0
        self.grad_scale = (
            1.0 if model_chunks[0].config.calculate_per_token_loss else 1 / self.dp_size
        )
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.row_optimizer = loggra.loggra_row_optimizer
        self.sketch = SKETCH_MODES[loggra.loggra_sketch].checkpoint_tag
        """The tag of its ``--loggra-sketch`` mode that its checkpoints record."""
        remainders = loggra.loggra_param_remainders
        self.rows_of: dict[torch.Tensor, tuple[SketchSites, SketchSite, int, int]] = {}
        masters, param_remainders = [], {}
        for chunk_sites in sites:
            for site in chunk_sites:
                lo, hi = site.owned_rows(self.segment)
                if hi == lo:
                    continue
                rows = site.weight.detach()[lo:hi]
                if rows.dtype == torch.float32:
                    main = rows  # fp32 weights are their own masters
                elif remainders:
                    main = rows  # the bf16 rows; the master is rows + remainder
                    param_remainders[main] = torch.zeros_like(rows, dtype=torch.int16)
                else:
                    main = rows.float()
                self.rows_of[main] = (chunk_sites, site, lo, hi)
                masters.append(main)
        inner = RowAdam(
            [{"params": masters}],  # may be empty: more DP ranks than rows
            lr=config.lr if config.lr is not None else 0.0,
            betas=(config.adam_beta1, loggra.loggra_row_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            row_optimizer=self.row_optimizer,
            param_remainders=param_remainders,
            relative_eps=loggra.loggra_row_relative_eps,
            restore_norm=loggra.loggra_row_restore_norm,
            update_ratio=loggra.loggra_update_ratio,
        )
        inner.sum_over_layer = self._sum_over_layer
        inner.sum_over_targets = self._sum_over_targets
        super().__init__(inner, config)
        self.is_stub_optimizer = False
        self.row_gathers = [
            gather
            for chunk_sites in sites
            if chunk_sites.segments > 1
            for gather in row_gathers(
                chunk_sites, self.segment, self.dp_group, ROW_GATHER_BUCKET_NUMEL
            )
        ]
        """The weight sync of the targets, one ``RowGather`` per bucket (none: the rows are
        not split over DP)."""
        self.overlap_weight_sync = any(
            getattr(getattr(c, "ddp_config", None), "overlap_param_gather", False)
            for c in model_chunks
        )
        """Whether a sync pipelines its buckets (``--overlap-param-gather``)."""
        self._reduced = False
        self.sketch_norm = float("nan")

    # ------------------------------------------------------------------ Megatron's API
    def get_parameters(self) -> list:
        return []  # the sketches are clipped through RowAdam.model_grad_scale

    def _sketch_norms(self) -> list[torch.Tensor]:
        """``[‖S‖]`` of this rank's rows: the norm the clip counts for the targets, an
        unbiased estimate of the dense gradient's (``E‖S‖² = ‖G‖²`` for ``E[AᵀA] = I``; the
        Gram form ``‖S A‖`` is ``√(1 + (n−1)/r)`` times larger). A row-parallel target's
        rows are the same on every TP rank (summed in ``prepare_grads``): TP rank 0 counts
        them. Also keeps the global value for ``loggra/sketch_norm`` (one scalar all-reduce)."""
        total = torch.zeros((), dtype=torch.float32, device=self.sites[0].buffer.device)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        for chunk_sites, site, _, _ in self.rows_of.values():
            if site.column_parallel or tp_rank == 0:
                total += chunk_sites.rows_view(site, self.segment).square().sum()
        overall = total.clone()
        dist.all_reduce(overall, group=self.grad_stats_parallel_group)
        self.sketch_norm = float(overall.sqrt())
        return [total.sqrt().reshape(1)]

    def _layer_index(self) -> dict[str, int]:
        """Every target's position among all targets of this stage (the same on every DP and
        TP rank)."""
        names = [site.name for chunk_sites in self.sites for site in chunk_sites]
        return {name: i for i, name in enumerate(names)}

    @torch.no_grad()
    def _sum_over_layer(self, partial: dict) -> dict:
        """RowAdam's per-weight sums: ``{main: [c]}`` over this rank's rows → over the whole
        weight (all-reduced over DP when the rows are split there, and over TP for a
        column-parallel target, whose rows TP splits; a row-parallel target's rows are whole
        and equal on every TP rank)."""
        width = 2  # every caller's sums are pairs (the same on every rank, rows or none)
        index = self._layer_index()
        device = self.sites[0].buffer.device
        table = torch.zeros(len(index), width, dtype=torch.float32, device=device)
        column = torch.zeros(len(index), 1, dtype=torch.bool, device=device)
        for main, value in partial.items():
            site = self.rows_of[main][1]
            table[index[site.name]] = value.to(table)
            column[index[site.name]] = site.column_parallel
        if self.sites[0].segments > 1:
            dist.all_reduce(table, group=self.dp_group)
        if dist.get_world_size(self.tp_group) > 1:
            summed = table * column
            dist.all_reduce(summed, group=self.tp_group)
            table = torch.where(column, summed, table)
        return {main: table[index[self.rows_of[main][1].name]] for main in partial}

    @torch.no_grad()
    def _sum_over_targets(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial sums over this rank's rows → over every target of the model (the
        grad-stats group: DP when the rows are split there, TP and PP)."""
        total = partial.to(self.sites[0].buffer.device, torch.float32).clone()
        dist.all_reduce(total, group=self.grad_stats_parallel_group)
        return total

    def step_metrics(self) -> dict[str, float]:
        """``loggra/sketch_norm`` of the last norm computed, and the targets' rate under the
        update ratio (``loggra/step_size``)."""
        metrics = {"loggra/sketch_norm": self.sketch_norm}
        if self.optimizer.update_ratio is not None:
            metrics["loggra/step_size"] = self.optimizer.step_size
        return metrics

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:  # megatron-core ≤ 0.18
        return self._sketch_norms()

    def get_grads_for_grad_norm(self, grad_norm_group=None) -> list[torch.Tensor]:  # ≥ 0.19
        return self._sketch_norms() if grad_norm_group is None else []

    def count_zeros(self) -> float:
        return 0.0

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Sum the sketches over DP (reduce-scatter by rows) and TP (row-parallel targets),
        once per backward; hand them to RowAdam. Returns False (no fp16 loss scaling)."""
        if self._reduced:
            return False
        for chunk_sites in self.sites:
            buffer = chunk_sites.buffer  # reduced_in_backward: the hooks summed it over DP
            if chunk_sites.segments > 1 and not chunk_sites.reduced_in_backward:
                own = torch.empty_like(buffer[0])
                dist.reduce_scatter_tensor(
                    own, buffer.view(-1, buffer.shape[-1]), group=self.dp_group
                )
                buffer[self.segment].copy_(own)
                del own
            elif chunk_sites.segments == 1 and self.dp_size > 1:
                dist.all_reduce(buffer, group=self.dp_group)
            if self.grad_scale != 1.0:
                chunk_sites.segment_view(self.segment).mul_(self.grad_scale)
            chunk_sites.all_reduce_row_parallel(self.segment, self.tp_group)  # one collective
        self.optimizer.model_grad_scale = 1.0
        self.optimizer.set_sketches(
            {
                main: (
                    chunk_sites.rows_view(site, self.segment),
                    lambda s=chunk_sites, t=site: s.signs(t, torch.float32),
                )
                for main, (chunk_sites, site, _, _) in self.rows_of.items()
            }
        )
        self._reduced = True
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        self.sync_weights()
        for chunk_sites in self.sites:
            chunk_sites.updates = self.optimizer.num_steps
        return True

    @torch.no_grad()
    def step(self):
        """Megatron's step of this leaf alone (the chain's step is the one that runs):
        its own norm, clipped by its own coefficient."""
        self.prepare_grads()
        grad_norm = self.get_grad_norm()
        ok = bool(torch.isfinite(torch.as_tensor(grad_norm)))
        if ok:
            self.optimizer.model_grad_scale = clip_coefficient(self.config.clip_grad, grad_norm)
            self.step_with_ready_grads()
        return ok, grad_norm, None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for chunk_sites in self.sites:
            chunk_sites.zero()
        self._reduced = False

    def get_loss_scale(self) -> torch.Tensor:
        return torch.ones(1, device=self.sites[0].buffer.device)

    # ------------------------------------------------------------------ weights
    def main_params(self) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
        """``(main, model param, start, end)``: each main holds ``weight.view(-1)[start:end]``."""
        return [
            (main, site.weight, lo * site.cols, hi * site.cols)
            for main, (_, site, lo, hi) in self.rows_of.items()
        ]

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        for main, (_, site, lo, hi) in self.rows_of.items():
            rows = site.weight.detach()[lo:hi]
            if not shares_storage(main, rows):
                rows.copy_(main)

    @torch.no_grad()
    def _copy_model_params_to_main_params(self, state_dict=None) -> None:
        for main, (_, site, lo, hi) in self.rows_of.items():
            if main in self.optimizer.param_remainders:
                self.optimizer.param_remainders[main].zero_()
            else:
                main.copy_(site.weight.detach()[lo:hi])

    def reload_model_params(self, state_dict=None) -> None:
        self._copy_model_params_to_main_params(state_dict)

    @torch.no_grad()
    def sync_weights(self) -> None:
        """All-gather every target's rows over DP (each rank updated its own), and wait: one
        flat buffer and one all-gather per bucket (``ROW_GATHER_BUCKET_NUMEL`` elements at
        most), pipelined with the DDP config's ``overlap_param_gather`` (``backward_row_gather.py``)."""
        sync_buckets(self.row_gathers, self.overlap_weight_sync)

    # ------------------------------------------------------------------ checkpoints
    def _meta(self) -> dict:
        s = self.sites[0]
        return {
            "format": FORMAT_VERSION,
            "sketch": self.sketch,
            "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "seed": s.seed,
            "rank": s.rank,
            "targets": sorted({site.name.partition(".")[2] for site in s}),
            "row_optimizer": self.row_optimizer,
            "sketch_matrix": s.kind,
            "refresh_interval": s.refresh_interval,
            "num_steps": self.optimizer.num_steps,
        }

    def check_compatible(self, saved: dict | None) -> None:
        """Raise ``ValueError`` when a checkpoint's optimizer meta cannot be loaded here."""
        if not saved or saved.get("sketch", UNTAGGED_SKETCH) != self.sketch:
            raise ValueError(
                "the checkpoint holds another optimizer's state than --loggra-sketch backward "
                "(dense Adam, or --loggra-sketch gradient): resume with the optimizer it was "
                "saved with, or load the weights only with --no-load-optim"
            )
        mine = self._meta()
        flags = {
            "tensor_model_parallel_size": "--tensor-model-parallel-size",
            "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
            "seed": "--loggra-seed",
            "rank": "--loggra-rank",
            "targets": "--loggra-targets",
            "row_optimizer": "--loggra-row-optimizer",
            "sketch_matrix": "--loggra-sketch-matrix",
            "refresh_interval": "--loggra-refresh-interval",
        }
        saved = {**LEGACY_META, **saved}
        for name, flag in flags.items():
            if saved.get(name) != mine[name]:
                raise ValueError(
                    f"{flag}: the checkpoint's backward-sketch optimizer state has {name}="
                    f"{saved.get(name)!r}, this run {mine[name]!r}; resume with the same "
                    f"{flag} (any data-parallel size works), or load the weights only with "
                    "--no-load-optim"
                )

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        """``{"loggra": meta, "param_state": {name: {fp32_param, exp_avg_sq?}}}``: flat
        tensors with global offsets (rows), so a checkpoint loads at any DP size. The
        projection is not saved: it is drawn again from (seed, draw, name)."""
        tp = parallel_state.get_tensor_model_parallel_rank()
        # rows sharded over DP: every rank writes its own; replicated: DP rank 0 writes
        main_replica = self.sites[0].segments > 1 or self.dp_group.rank() == 0
        param_state = {}
        for main, (_, site, lo, _) in self.rows_of.items():
            key = f"optimizer.loggra_sketch.tp{tp}.{site.name}"
            master = checkpoint_master(self.optimizer, main, is_loading)
            entry = {
                "fp32_param": flat_sharded(
                    f"{key}.fp32_param",
                    master,
                    site.rows * site.cols,
                    lo * site.cols,
                    main_replica,
                    is_loading,
                )
            }
            state = self.optimizer.init_state_of(main)
            if "exp_avg_sq" in state:
                entry["exp_avg_sq"] = flat_sharded(
                    f"{key}.exp_avg_sq",
                    state["exp_avg_sq"],
                    site.rows,
                    lo,
                    main_replica,
                    is_loading,
                )
            param_state[site.name] = entry
        return {"loggra": self._meta(), "param_state": param_state}

    def state_dict(self):
        return self.sharded_state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict) -> None:
        self.check_compatible(state_dict["loggra"])
        num_steps = state_dict["loggra"]["num_steps"]
        self.optimizer.num_steps = num_steps
        for main, (_, site, _, _) in self.rows_of.items():
            saved = state_dict["param_state"][site.name]
            self.optimizer.set_master(main, saved["fp32_param"].view(main.shape))
            if "exp_avg_sq" in saved:
                self.optimizer.init_state_of(main)["exp_avg_sq"].copy_(saved["exp_avg_sq"])
        for chunk_sites in self.sites:
            chunk_sites.updates = num_steps
        self._copy_main_params_to_model_params()
        self.sync_weights()


def sketch_sites_of(optimizer) -> list[SketchSites]:
    """The ``SketchSites`` of ``optimizer``'s backward-sketch leaves (empty: none), as the
    builder was given them."""
    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    return [s for leaf in leaves if isinstance(leaf, BackwardSketchOptimizer) for s in leaf.sites]

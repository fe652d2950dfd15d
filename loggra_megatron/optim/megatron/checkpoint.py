"""``dist_checkpointing`` of LoGRA state inside Megatron-Core optimizers.

Megatron's own optimizer formats assume Adam's state has the shape of the param; LoGRA's
sketches do not, so the ``LoGRA*`` leaf optimizers (``optim.megatron.leaves``)
override ``sharded_state_dict`` / ``load_state_dict`` with ``LoGRACheckpointMixin``.
Every state tensor is a flat, DP-independent global tensor (``torch_dist``), each DP rank
writing its slice or the sketch rows it owns, so a checkpoint loads at any DP size; a
different TP or PP size is refused by ``LoGRACheckpointMixin.check_compatible`` before
any tensor is read, and loaded tensors reach the live state only after the whole load
succeeded.

Memory (``checkpoint_master``). Megatron's ``torch_dist`` writer copies every tensor of
a save to the host before it writes any, so an fp32 master kept as bf16 weight + int16
remainder (``--loggra-param-remainders``) is rebuilt straight into its host copy,
``COPY_BUCKET_NUMEL`` elements at a time (``param_remainders.join_master_into``): beyond the
live state a save allocates on the params' device at most one bucket's int32 bits,
``param_remainders.copy_transient_bytes()`` = 4 · 2²⁴ B = 64 MiB, never an fp32 copy of all
masters; the host holds the masters' fp32 (4 B per master element of the rank), what the
writer would have staged there from the device. The bytes written are those of the master
itself. A load reads every LoGRA state tensor into fresh host buffers, copied into the live
state (weight and remainder split on the host) one tensor at a time.

Format (keys, which rank writes what): docs/optimizer.md#checkpoints.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer

from loggra_megatron.optim.param_remainders import COPY_BUCKET_NUMEL, join_master_into
from loggra_megatron.optim.registry import SKETCH_MODES, UNTAGGED_SKETCH

FORMAT_VERSION = 1


def checkpoint_master(inner, main, is_loading: bool) -> torch.Tensor:
    """The flat fp32 master of ``main`` (a param of ``inner``, a LoGRA inner optimizer) as
    the ``fp32_param`` entry holds it: the master itself, or, kept as a remainder, a host
    copy rebuilt bucket by bucket (a save) or only its shape and dtype on the ``meta``
    device (a load: ``flat_sharded`` allocates the host buffer)."""
    remainder = inner.param_remainders.get(main)
    if remainder is None:
        return inner.master_of(main).view(-1)
    if is_loading:
        return torch.empty(main.numel(), dtype=torch.float32, device="meta")
    host = torch.empty(main.numel(), dtype=torch.float32, device="cpu")
    return join_master_into(main.detach(), remainder, host, COPY_BUCKET_NUMEL)


def flat_sharded(key, data, global_numel, offset, main_replica, fresh):
    """A flat ``ShardedTensor``: ``data`` (1-D) at ``offset`` of a ``global_numel`` tensor;
    with ``fresh``, a new host buffer of its shape and dtype to load into."""
    if fresh:
        data = torch.empty(data.shape, dtype=data.dtype, device="cpu")
    return ShardedTensor(
        key=key,
        data=data,
        dtype=data.dtype,
        local_shape=(data.numel(),),
        global_shape=(global_numel,),
        global_offset=(offset,),
        axis_fragmentations=None,  # uneven DP slices; validated by torch DCP
        replica_id=0 if main_replica else 1,
    )


class LoGRACheckpointMixin(MegatronOptimizer):
    """Checkpointing of a Megatron leaf optimizer whose inner optimizer is LoGRA's.

    It derives from ``MegatronOptimizer`` and adds no slots so that the ``LoGRA*`` classes
    have the instance layout of the Megatron leaf they re-class."""

    __slots__ = ()

    def _loggra_meta(self) -> dict:
        inner = self.optimizer
        return {
            "format": FORMAT_VERSION,
            "sketch": SKETCH_MODES[self.loggra.loggra_sketch].checkpoint_tag,
            "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "projection": inner.param_groups[0]["projection"],
            "num_steps": inner.num_steps,
        }

    def check_compatible(self, saved_meta: dict) -> None:
        """Raise ``ValueError`` if a checkpoint with ``saved_meta`` cannot be loaded here."""
        if not saved_meta:
            raise ValueError(
                "the checkpoint holds Megatron's dense Adam state, not LoGRA's: resume with "
                "--optimizer adam, or load the weights only with --no-load-optim"
            )
        mine = self._loggra_meta()
        saved = saved_meta.get("sketch", UNTAGGED_SKETCH)
        if saved != mine["sketch"]:
            raise ValueError(
                f"--loggra-sketch: the checkpoint was saved with --loggra-sketch "
                f"{saved}, this run has {mine['sketch']}; "
                "resume with the same mode, or load the weights only with --no-load-optim"
            )
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "projection"):
            if saved_meta.get(name) != mine[name]:
                raise ValueError(
                    f"LoGRA optimizer checkpoint has {name}={saved_meta.get(name)!r} but this "
                    f"run has {mine[name]!r}. LoGRA sketch state is kept per TP shard and "
                    "pipeline stage: resume with the same --tensor-model-parallel-size, "
                    "--pipeline-model-parallel-size and --loggra-projection (any data-parallel "
                    "size works), or load the model weights only (--no-load-optim)."
                )

    def _prefix(self) -> str:
        pp = parallel_state.get_pipeline_model_parallel_rank()
        tp = parallel_state.get_tensor_model_parallel_rank()
        return f"optimizer.loggra.pp{pp}.tp{tp}"

    def _dp_rank(self) -> int:
        """This rank's index among the DP ranks that shard the optimizer (0 if replicated)."""
        return self.data_parallel_group.rank() if isinstance(self, DistributedOptimizer) else 0

    def _main_replica(self, layout) -> bool:
        """Whether this rank writes the DP-replicated tensors (fp32 params when replicated
        over DP, bases) of a weight: the lowest DP rank that holds a slice of it."""
        if not isinstance(self, DistributedOptimizer):
            return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
        if layout is None:
            return True  # DP slices are disjoint
        return self._dp_rank() == min(r for r, (s, e) in enumerate(layout.dp_ranges) if e > s)

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        """``{"loggra": meta, "grad_scaler"?: ..., "param_state": {key: {name: ShardedTensor}}}``.

        With ``is_loading`` the tensors are fresh buffers for ``dist_checkpointing.load``.
        """
        inner = self.optimizer
        state_dict = {"loggra": self._loggra_meta()}
        grad_scaler = getattr(self, "grad_scaler", None)  # FP32Optimizer has none
        if grad_scaler is not None:
            state_dict["grad_scaler"] = grad_scaler.state_dict()
        prefix, param_state = self._prefix(), {}
        for key, model_param, main, (start, _) in self.loggra_params:
            layout = inner.layout_of(main)
            state = inner.state[main] if main in inner.state else inner.init_state_of(main)
            replica = self._main_replica(layout)
            dp_replica = replica if layout is None else True
            numel = model_param.numel()
            entry = {
                "fp32_param": flat_sharded(
                    f"{prefix}.{key}.fp32_param",
                    checkpoint_master(inner, main, is_loading),
                    numel,
                    start,
                    dp_replica,
                    is_loading,
                )
            }
            if layout is None:
                for name in ("exp_avg", "exp_avg_sq"):
                    entry[name] = flat_sharded(
                        f"{prefix}.{key}.{name}",
                        state[name].view(-1),
                        numel,
                        start,
                        dp_replica,
                        is_loading,
                    )
            else:
                entry.update(self._sketch_entries(f"{prefix}.{key}", layout, state, is_loading))
            param_state[key] = entry
        state_dict["param_state"] = param_state
        return state_dict

    def _sketch_entries(self, key, layout, state, is_loading) -> dict:
        dp_rank = self._dp_rank()
        (m, n), r = layout.shape, layout.rank
        t_lo, t_hi = layout.touched_rows(dp_rank)
        lo, hi = (t_lo, t_hi) if is_loading else layout.owned_rows(dp_rank)
        entries = {}
        if hi > lo:
            for name in ("exp_avg", "exp_avg_sq"):
                rows = state[name][lo - t_lo : hi - t_lo].reshape(-1)
                entries[name] = flat_sharded(f"{key}.{name}", rows, m * r, lo * r, True, is_loading)
        entries["basis"] = flat_sharded(
            f"{key}.basis",
            state["basis"].view(-1),
            n * r,
            0,
            self._main_replica(layout),
            is_loading,
        )
        return entries

    @torch.no_grad()
    def load_state_dict(self, state_dict) -> None:
        """Load what ``dist_checkpointing.load`` returned for ``sharded_state_dict``."""
        self.check_compatible(state_dict["loggra"])
        inner = self.optimizer
        grad_scaler = getattr(self, "grad_scaler", None)
        if grad_scaler is not None and "grad_scaler" in state_dict:
            grad_scaler.load_state_dict(state_dict["grad_scaler"])
        inner.num_steps = state_dict["loggra"]["num_steps"]  # (older: also a skip count)
        for key, _, main, _ in self.loggra_params:
            saved = state_dict["param_state"][key]
            state = inner.state[main] if main in inner.state else inner.init_state_of(main)
            inner.set_master(main, saved["fp32_param"])
            for name in ("exp_avg", "exp_avg_sq", "basis"):
                if name in saved:
                    state[name].view(-1).copy_(saved[name])
            state["step"].fill_(inner.num_steps)
        # fp32 model params alias their main params; 16-bit model params come from the
        # model checkpoint, so nothing is copied back to the model here, except with
        # remainders: each DP rank has just written its shard of the bf16 weights (the
        # masters rounded half away from zero, which a checkpoint saved with fp32 masters
        # may have rounded to even), so the weights are all-gathered to agree again.
        if inner.param_remainders:
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)

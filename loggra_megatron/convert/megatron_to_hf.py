# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Megatron-Core GPT model / dist checkpoint -> Hugging Face safetensors.

Each rank loads its model chunk from the dist checkpoint; the TP shards of every parameter
are gathered (as raw bytes, so any dtype is exact over gloo) onto TP rank 0 one
parameter at a time, split into HF tensors (QKV de-interleaved, [gate; up] split, vocab
padding removed) and streamed into safetensors files by one writer per pipeline stage.
Global rank 0 then names the files, writes the index and ``config.json``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from loggra_megatron.checkpointing.layout import select_model_checkpoint
from loggra_megatron.convert.checkpoint import (
    load_megatron_checkpoint,
    read_hf_config,
    read_model_args,
)
from loggra_megatron.convert.hf_config import hf_config_from_gpt_args
from loggra_megatron.convert.hf_io import HFShardWriter, finalize_hf_checkpoint
from loggra_megatron.convert.hf_to_megatron import layer_offset
from loggra_megatron.convert.mapping import (
    hf_expected_shapes,
    hf_tensors_from_megatron,
    param_mapping,
)
from loggra_megatron.convert.masters import load_masters
from loggra_megatron.model.args import GPTModelArgs
from loggra_megatron.model.build import build_gpt_model

__all__ = ["convert_megatron_to_hf", "export_megatron_to_hf", "iter_hf_tensors"]


def _gather_exact(t: torch.Tensor, group, world: int, rank: int) -> list[torch.Tensor] | None:
    """Gather equally shaped tensors onto rank 0 of ``group``, bit-exactly (as bytes: gloo
    lacks some dtypes). Returns the list on that rank, ``None`` elsewhere."""
    t = t.detach().contiguous()
    raw = t.view(-1).view(torch.uint8)
    out = [torch.empty_like(raw) for _ in range(world)] if rank == 0 else None
    dst = torch.distributed.get_global_rank(group, 0)
    torch.distributed.gather(raw, out, dst=dst, group=group)
    return None if out is None else [o.view(t.dtype).view(t.shape) for o in out]


def iter_hf_tensors(
    model: torch.nn.Module, args: GPTModelArgs, select: Callable[[str, Any], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for this model chunk, on TP rank 0 only; with ``select``,
    of the parameters ``select(name, param)`` keeps only (the same on every TP rank).

    Collective over the TP group: every TP rank must exhaust the iterator. With tied
    embeddings the output layer (a copy on the last PP stage) is skipped.
    """
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None
    offset = layer_offset(model)
    for name, param in model.named_parameters():
        if args.tie_embeddings and name == "output_layer.weight":
            continue
        if select is not None and not select(name, param):
            continue
        mapping = param_mapping(name, args, offset)
        if mapping.kind == "replicated" or tp_size == 1:
            shards = [param.detach()]
        else:
            shards = _gather_exact(param, group, tp_size, tp_rank)
        if tp_rank == 0:
            yield from hf_tensors_from_megatron(mapping, shards, args).items()


def export_megatron_to_hf(
    model: torch.nn.Module,
    args: GPTModelArgs,
    save_dir: str | os.PathLike,
    *,
    hf_config: dict[str, Any] | None = None,
    max_shard_bytes: int = 5 * 2**30,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """Write ``model`` (all ranks' chunks together) as a HF checkpoint into ``save_dir``.

    Collective over all ranks. ``hf_config`` is the base of ``config.json`` (see
    ``hf_config_from_gpt_args``). Returns the safetensors file names (on every rank).
    """
    from megatron.core import parallel_state

    save_dir = os.fspath(save_dir)
    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
    torch.distributed.barrier()
    writes = (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    writer = HFShardWriter(save_dir, f"pp{pp_rank:04d}", max_shard_bytes) if writes else None
    count = 0
    for name, tensor in iter_hf_tensors(model, args):
        if writer is not None:  # DP replicas > 0 take part in the TP gathers only
            writer.add(name, tensor.to(args.torch_dtype))
            count += 1
    shards = writer.close() if writer is not None else []
    if log is not None and writer is not None:
        log(f"  PP stage {pp_rank}: {count} tensors in {len(shards)} file(s)")
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, shards)
    all_shards = sorted((s for ss in gathered for s in ss), key=lambda s: s.filename)
    names = {n for s in all_shards for n in s.names}
    expected = set(hf_expected_shapes(args))
    if names != expected:
        diff = sorted(names ^ expected)
        raise RuntimeError(f"export produced the wrong tensor set; first difference: {diff[0]!r}")
    files: list[Any] = [None]
    if rank == 0:
        files = [
            finalize_hf_checkpoint(save_dir, all_shards, hf_config_from_gpt_args(args, hf_config))
        ]
    torch.distributed.broadcast_object_list(files, src=0)
    return files[0]


def convert_megatron_to_hf(
    load_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 2**30,
    use_te: bool = False,
    log: Callable[[str], None] | None = None,
    iteration: int | None = None,
    masters: bool = False,
) -> GPTModelArgs:
    """Convert the Megatron checkpoint ``load_dir`` (written by
    ``convert_hf_to_megatron`` or by training)
    into a HF checkpoint in ``save_dir``. Collective; any TP/PP the architecture allows.
    The iteration is chosen and verified as ``pretrain_rl.py --load`` does (``iteration``:
    as ``--ckpt-step``; a corrupted or incomplete one falls back to an older complete one,
    with a warning in ``log``; a non-finite weight is refused). ``masters``: write the
    optimizer's fp32 master weights, in float32 (``convert/masters.py``)."""
    args = read_model_args(load_dir)
    model = build_gpt_model(
        args, use_te=use_te, use_cpu_initialization=True, perform_initialization=False
    ).to(args.torch_dtype)  # norms too, as Megatron's Float16Module does
    ref = select_model_checkpoint(load_dir, iteration)
    if log is not None:
        log(f"loading Megatron dist checkpoint {ref.path}")
    ref = load_megatron_checkpoint(model, ref)
    if log is not None:
        for warning in ref.warnings:
            log(f"warning: {warning}")
    if masters:
        args = dataclasses.replace(args, params_dtype="float32")
        replaced, kept = load_masters(model.float(), ref.path)
        if log is not None:
            log(f"fp32 masters of {replaced} weights; {kept} without one (never trained) as saved")
    if log is not None:
        log(f"writing HF checkpoint to {os.fspath(save_dir)}")
    export_megatron_to_hf(
        model,
        args,
        save_dir,
        hf_config=read_hf_config(load_dir),
        max_shard_bytes=max_shard_bytes,
        log=log,
    )
    return args

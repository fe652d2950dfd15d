# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The optimizer's fp32 master weights of a training checkpoint, for an exact export.

With bf16 weights (``--bf16``) the model's weights are the fp32 masters rounded to bf16.
The rollouts read the bf16 weights (as every peer's inference engine does), and at a small
learning rate an update moves a weight far less than one bf16 step (2⁻⁸ of its size), so
the bf16 weights move only where a master has crossed a rounding boundary. The masters hold
the whole update: ``tools/convert_checkpoint.py --export-masters`` writes them, in float32.

LoGRA's checkpoints keep every trained weight's master under its own name, as this TP
rank's shard, flattened (``optim/megatron/checkpoint.py``, ``backward_optimizer.py``):

* ``optimizer.loggra.pp{p}.tp{t}.chunk{c}.<param name>.fp32_param``: the weights a dense
  optimizer trains (all of them with the gradient sketch; embeddings, output layer and
  norms with the backward sketch);
* ``optimizer.loggra_sketch.tp{t}.layer{n}.<target>.fp32_param``: the backward sketch's
  targets (``n``: the global layer number), joined with their remainders where
  ``--loggra-param-remainders`` kept them as bf16 weight + int16 remainder.

A weight with no master (frozen: ``--freeze-non-targets``) never changed, so its checkpoint
value is exact. Megatron's own distributed optimizer (dense Adam) saves its masters in flat
communication buckets that only a rebuilt optimizer can map back to weights: such a
checkpoint is refused, with the alternative named.
"""

from __future__ import annotations

import os
import re

import torch

MASTER = "fp32_param"
DENSE_BUCKETS = "optimizer.distributed."


def master_keys(model: torch.nn.Module, keys: set[str], tp: int, pp: int) -> dict[str, str]:
    """``{param name: checkpoint key}`` for the weights of ``model`` (one chunk, this TP rank)
    whose master ``keys`` holds."""
    dense = f"optimizer.loggra.pp{pp}.tp{tp}.chunk0."
    by_name = {}
    for key in keys:
        if key.startswith(dense) and key.endswith(f".{MASTER}"):
            name = key[len(dense) : -len(MASTER) - 1]
            while name.startswith("module."):
                name = name[len("module.") :]
            by_name[name] = key
    for layer_name, layer in model.named_modules():
        number = getattr(layer, "layer_number", None)
        if number is None or not hasattr(layer, "mlp"):
            continue  # not a TransformerLayer
        for path, module in layer.named_modules():
            target = path.rpartition(".")[2]
            key = f"optimizer.loggra_sketch.tp{tp}.layer{number}.{target}.{MASTER}"
            if key in keys and isinstance(getattr(module, "weight", None), torch.nn.Parameter):
                by_name[f"{layer_name}.{path}.weight"] = key
    return by_name


def check_masters(ckpt_dir: str | os.PathLike, tp_size: int, pp_size: int) -> set[str]:
    """Refuse an export of masters that ``ckpt_dir`` cannot give at TP ``tp_size`` and PP
    ``pp_size`` (reads the checkpoint's metadata only); returns its keys."""
    from loggra_megatron.checkpointing.pickles import read_metadata

    ckpt_dir = os.fspath(ckpt_dir)
    keys = set(read_metadata(ckpt_dir).state_dict_metadata)  # through the allowlist
    if any(k.startswith(DENSE_BUCKETS) for k in keys):
        raise ValueError(
            f"--export-masters: {ckpt_dir} holds Megatron's distributed optimizer state (dense "
            "Adam), whose masters are flat communication buckets; train with fp32 weights "
            "(without --bf16: the weights are then their own masters) or export the weights"
        )
    if not any(k.endswith(f".{MASTER}") for k in keys):
        raise ValueError(
            f"--export-masters: {ckpt_dir} has no optimizer state (saved with --no-save-optim, "
            "or not written by training); export the weights without --export-masters"
        )
    found = [re.match(r"optimizer\.loggra(?:_sketch)?\.(?:pp(\d+)\.)?tp(\d+)\.", k) for k in keys]
    pps = {int(m[1]) for m in found if m and m[1] is not None} or {0}
    tps = {int(m[2]) for m in found if m}
    saved = (max(tps) + 1, max(pps) + 1)
    if saved != (tp_size, pp_size):
        raise ValueError(
            f"--export-masters: the checkpoint's optimizer state was saved at TP={saved[0]}, "
            f"PP={saved[1]}, this export runs at TP={tp_size}, PP={pp_size}; run it with "
            f"--tensor-model-parallel-size {saved[0]} --pipeline-model-parallel-size "
            f"{saved[1]} (the masters are kept per TP shard and pipeline stage)"
        )
    return keys


def load_masters(model: torch.nn.Module, ckpt_dir: str | os.PathLike) -> tuple[int, int]:
    """Replace ``model``'s weights (float32) by their masters from ``ckpt_dir``; returns
    ``(weights replaced, weights without a master)``. Collective over all ranks."""
    import torch.distributed.checkpoint as dcp
    from megatron.core import parallel_state

    keys = check_masters(
        ckpt_dir,
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    params = dict(model.named_parameters())
    names = {n: k for n, k in master_keys(model, keys, tp, pp).items() if n in params}
    state = {key: torch.empty(params[name].numel()) for name, key in names.items()}
    dcp.load(
        state, checkpoint_id=os.fspath(ckpt_dir), no_dist=not torch.distributed.is_initialized()
    )
    with torch.no_grad():
        for name, key in names.items():
            params[name].copy_(state[key].view(params[name].shape))
    return len(names), len(params) - len(names)

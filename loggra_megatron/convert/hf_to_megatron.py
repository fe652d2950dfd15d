# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Hugging Face (Llama / Qwen2 / Qwen3) safetensors -> Megatron-Core GPT model.

Every rank builds only its own model chunk (its PP stage, its TP shard) and fills each
parameter from the HF tensor slices it needs, read lazily from the safetensors shards:
peak memory is one model shard plus one layer's tensors, and the HF model is never loaded
as a whole. The filled chunk is then saved with Megatron-Core ``dist_checkpointing``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from typing import Any

import torch

from loggra_megatron.convert.checkpoint import save_megatron_checkpoint
from loggra_megatron.convert.hf_config import gpt_args_from_hf
from loggra_megatron.convert.hf_io import HFCheckpointReader
from loggra_megatron.convert.mapping import (
    HF_IGNORED_SUFFIXES,
    TensorSource,
    hf_expected_shapes,
    megatron_local_from_hf,
    param_mapping,
)
from loggra_megatron.model.args import GPTModelArgs
from loggra_megatron.model.build import build_gpt_model

__all__ = [
    "convert_hf_to_megatron",
    "layer_offset",
    "load_hf_into_megatron",
    "validate_hf_checkpoint",
]

_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def validate_hf_checkpoint(reader: HFCheckpointReader, args: GPTModelArgs) -> None:
    """Check that ``reader`` holds exactly the tensors of ``args`` with the right shapes.

    Raises ``ValueError`` naming the first missing, unexpected or mis-shaped tensor.
    Reads metadata only.
    """
    expected = hf_expected_shapes(args)
    present = {k for k in reader.tensor_names() if not k.endswith(HF_IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(
            f"HF checkpoint {reader.hf_dir} lacks {len(missing)} tensor(s) the config implies, "
            f"first: {missing[0]!r}"
        )
    extra = sorted(present - set(expected))
    if extra:
        raise ValueError(
            f"HF checkpoint {reader.hf_dir} has {len(extra)} tensor(s) the converter does not "
            f"know, first: {extra[0]!r} (unsupported architecture variant?)"
        )
    for name, shape in expected.items():
        got = reader.shape(name)
        if got != shape:
            raise ValueError(
                f"HF tensor {name!r} has shape {list(got)}, config implies {list(shape)}"
            )


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of the first transformer layer of this model chunk."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def load_hf_into_megatron(
    model: torch.nn.Module,
    src: TensorSource,
    args: GPTModelArgs,
    *,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    log: Callable[[str], None] | None = None,
    available: Collection[str] | None = None,
) -> None:
    """Copy this rank's shard of every parameter of ``model`` from the HF tensors in ``src``
    (with ``available``, the names ``src`` holds: only the parameters whose HF tensors are
    all among them; the others keep their values).

    TP rank/size default to ``megatron.core.parallel_state``. Raises ``ValueError`` naming
    both tensors if a converted shard does not match the Megatron parameter's shape.
    """
    if tp_rank is None or tp_size is None:
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
    offset = layer_offset(model)
    params = list(model.named_parameters())
    last_layer = None
    for i, (name, param) in enumerate(params):
        mapping = param_mapping(name, args, offset)
        if available is not None and not all(n in available for n in mapping.hf_names):
            continue
        local = megatron_local_from_hf(mapping, src, args, tp_rank, tp_size)
        if tuple(local.shape) != tuple(param.shape):
            raise ValueError(
                f"{name} <- {', '.join(mapping.hf_names)}: converted TP shard has shape "
                f"{list(local.shape)}, the Megatron parameter has {list(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(local)
        layer = mapping.hf_names[0].split(".")[2] if ".layers." in mapping.hf_names[0] else None
        if log is not None and layer != last_layer and layer is not None:
            log(f"  layer {layer} ({i + 1}/{len(params)} parameters)")
        last_layer = layer


def convert_hf_to_megatron(
    hf_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    *,
    use_te: bool = False,
    log: Callable[[str], None] | None = None,
    **arg_overrides: Any,
) -> GPTModelArgs:
    """Convert the HF checkpoint ``hf_dir`` into a Megatron dist checkpoint in ``save_dir``.

    Collective: run on every rank, with ``megatron.core.parallel_state`` initialised at the
    TP/PP sizes to convert with (the result loads at any TP/PP). ``arg_overrides`` replace
    fields of the ``GPTModelArgs`` read from ``config.json`` (e.g. ``params_dtype``,
    ``make_vocab_size_divisible_by``). Returns the arguments saved with the checkpoint.
    """
    hf_dir = os.fspath(hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    args = gpt_args_from_hf(hf_config, **arg_overrides)
    with HFCheckpointReader(hf_dir) as reader:
        validate_hf_checkpoint(reader, args)
        src_dtypes = {
            _SAFETENSORS_DTYPES.get(reader.dtype(k), reader.dtype(k)) for k in reader.tensor_names()
        }
        if log is not None:
            log(
                f"HF checkpoint {hf_dir}: {len(reader.tensor_names())} tensors, dtype(s) {sorted(src_dtypes)}"
            )
            if src_dtypes != {args.params_dtype}:
                log(f"  note: tensors are cast to params_dtype={args.params_dtype}")
        model = build_gpt_model(
            args, use_te=use_te, use_cpu_initialization=True, perform_initialization=False
        ).to(args.torch_dtype)  # norms too, as Megatron's Float16Module does
        load_hf_into_megatron(model, reader, args, log=log)
    if log is not None:
        log(f"saving Megatron dist checkpoint to {os.fspath(save_dir)}")
    save_megatron_checkpoint(model, save_dir, args, hf_config=hf_config)
    return args

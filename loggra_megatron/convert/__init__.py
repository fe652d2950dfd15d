# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Hugging Face <-> Megatron-Core checkpoint conversion for Llama / Qwen2 / Qwen3.

* ``convert.mapping`` -- pure-torch name and layout mapping (QKV
  interleaving, gate/up fusion, TP split, vocab padding).
* ``convert.hf_io`` -- lazy safetensors reader, sharded writer.
* ``convert.hf_to_megatron`` / ``convert.megatron_to_hf``
  -- per-rank model filling / exporting, and the end-to-end conversions.
* ``convert.checkpoint`` -- the dist-checkpoint layout on disk.

The command-line entry point is ``tools/convert_checkpoint.py``.
"""

from loggra_megatron.convert.checkpoint import (
    load_megatron_checkpoint,
    read_model_args,
    save_megatron_checkpoint,
)
from loggra_megatron.convert.hf_to_megatron import convert_hf_to_megatron, load_hf_into_megatron
from loggra_megatron.convert.megatron_to_hf import convert_megatron_to_hf, export_megatron_to_hf

__all__ = [
    "convert_hf_to_megatron",
    "convert_megatron_to_hf",
    "export_megatron_to_hf",
    "load_hf_into_megatron",
    "load_megatron_checkpoint",
    "read_model_args",
    "save_megatron_checkpoint",
]

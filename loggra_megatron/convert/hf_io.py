# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Streaming I/O of Hugging Face safetensors checkpoints.

``HFCheckpointReader`` opens the shards of a checkpoint lazily with
``safetensors.safe_open`` and reads single tensors or slices of them (a TP rank reads only
its rows/columns), so the HF model is never materialised as a whole.

``HFShardWriter`` buffers tensors up to a byte budget and flushes them as safetensors
files; ``finalize_hf_checkpoint`` gives the files written by all writers (one per
pipeline stage) their final ``model-0000i-of-0000n.safetensors`` names, writes the
``model.safetensors.index.json`` and ``config.json``. A checkpoint that fits in one file is
written as ``model.safetensors`` without an index, as ``transformers`` does.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = ["HFCheckpointReader", "HFShardWriter", "ShardInfo", "finalize_hf_checkpoint"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFCheckpointReader:
    """Lazy, slice-capable reader of a HF safetensors checkpoint directory.

    Use as a context manager (or call ``close``) to release the file handles.
    """

    def __init__(self, hf_dir: str | os.PathLike):
        self.hf_dir = os.fspath(hf_dir)
        index = os.path.join(self.hf_dir, INDEX_FILE)
        self._weight_map: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        if os.path.isfile(index):
            with open(index) as f:
                self._weight_map = dict(json.load(f)["weight_map"])
        else:
            files = sorted(glob.glob(os.path.join(self.hf_dir, "*.safetensors")))
            for path in files:
                fname = os.path.basename(path)
                for key in self._handle(fname).keys():  # noqa: SIM118 (safe_open has no __iter__)
                    self._weight_map[key] = fname
        if not self._weight_map:
            bins = glob.glob(os.path.join(self.hf_dir, "*.bin")) + glob.glob(
                os.path.join(self.hf_dir, "*.pt")
            )
            hint = (
                " (found PyTorch .bin/.pt files: re-save with safe_serialization=True)"
                if bins
                else ""
            )
            raise FileNotFoundError(f"no safetensors weights in {self.hf_dir}{hint}")

    def _handle(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            path = os.path.join(self.hf_dir, fname)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{INDEX_FILE} names {fname}, which does not exist in {self.hf_dir}"
                )
            try:
                h = safe_open(path, framework="pt", device="cpu")
            except (OSError, SafetensorError) as e:  # truncated or not safetensors at all
                raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
            self._handles[fname] = h
        return h

    def _slice(self, name: str):
        if name not in self._weight_map:
            raise KeyError(f"tensor {name!r} is not in the HF checkpoint {self.hf_dir}")
        return self._handle(self._weight_map[name]).get_slice(name)

    def tensor_names(self) -> list[str]:
        """All tensor names of the checkpoint."""
        return list(self._weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` (reads no data)."""
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors dtype string of ``name`` (e.g. ``"BF16"``)."""
        return self._slice(name).get_dtype()

    def read(
        self, name: str, dim: int | None = None, start: int | None = None, stop: int | None = None
    ) -> torch.Tensor:
        """Tensor ``name``, or only indices ``[start, stop)`` along ``dim`` (0 or 1)."""
        sl = self._slice(name)  # raises a KeyError naming the tensor if it is missing
        if dim is None:
            return self._handle(self._weight_map[name]).get_tensor(name)
        if dim == 0:
            return sl[start:stop]
        if dim == 1:
            return sl[:, start:stop]
        raise ValueError(f"read({name!r}): dim must be None, 0 or 1, got {dim}")

    def close(self) -> None:
        """Drop the open file handles."""
        self._handles.clear()

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ShardInfo:
    """One safetensors file written by an ``HFShardWriter``."""

    filename: str
    names: list[str] = field(default_factory=list)
    nbytes: int = 0


class HFShardWriter:
    """Writes tensors into safetensors files of at most ``max_shard_bytes`` each.

    Files are named ``{tag}-{k:05d}.tmp.safetensors`` until ``finalize_hf_checkpoint``
    renames them; ``tag`` must be unique per writer (e.g. the pipeline stage).
    """

    def __init__(self, save_dir: str | os.PathLike, tag: str, max_shard_bytes: int = 5 * 2**30):
        self.save_dir = os.fspath(save_dir)
        self.tag = tag
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[ShardInfo] = []
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` under ``name``; flushes first if it would overflow the shard."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self._buffer[name] = tensor.detach().contiguous()
        self._buffer_bytes += nbytes

    def flush(self) -> None:
        """Write the queued tensors to a new file."""
        if not self._buffer:
            return
        fname = f"{self.tag}-{len(self.shards):05d}.tmp.safetensors"
        save_file(self._buffer, os.path.join(self.save_dir, fname), metadata={"format": "pt"})
        self.shards.append(ShardInfo(fname, list(self._buffer), self._buffer_bytes))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> list[ShardInfo]:
        """Flush and return the files written."""
        self.flush()
        return self.shards


def finalize_hf_checkpoint(
    save_dir: str | os.PathLike, shards: list[ShardInfo], config: dict | None = None
) -> list[str]:
    """Rename the temporary files of all writers (in the given order) to HF names, write
    the index (if more than one file) and ``config.json``. Returns the final file names."""
    save_dir = os.fspath(save_dir)
    shards = [s for s in shards if s.names]
    seen: dict[str, str] = {}
    for s in shards:
        for n in s.names:
            if n in seen:
                raise ValueError(f"tensor {n!r} written twice ({seen[n]} and {s.filename})")
            seen[n] = s.filename
    final = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for s, fname in zip(shards, final, strict=True):
        os.replace(os.path.join(save_dir, s.filename), os.path.join(save_dir, fname))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in shards)},
            "weight_map": {n: f for s, f in zip(shards, final, strict=True) for n in s.names},
        }
        with open(os.path.join(save_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
    if config is not None:
        with open(os.path.join(save_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
    return final

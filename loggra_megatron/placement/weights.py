"""The full weight sync: the trainer's weights, resharded from its TP layout to the
generation ranks' TP layout, bit for bit.

The trainer's TP ranks of data-parallel replica 0 gather each parameter's shards as bytes
and its TP rank 0 turns them into the Hugging Face tensors of the model
(``convert.megatron_to_hf.iter_hf_tensors``: QKV de-interleaved, ``[gate; up]`` split,
vocabulary padding removed). They travel in byte buckets of at most
``--weight-sync-bucket-mb`` (every dtype exact over gloo), and each generation rank cuts its
own TP shard out of them (``convert.hf_to_megatron.load_hf_into_megatron``: its own padding,
its own QKV interleaving), so any training TP maps to any generation TP. No arithmetic
touches a value: the generation ranks' weights are the trainer's model weights (the bf16
weights of a ``--bf16`` run, which the rollout samples with when colocated) exactly.

The checksum (every ``--weight-sync-check-interval`` syncs) is a BLAKE2 digest of every
tensor's bytes, in the Hugging Face layout: the trainer's from what it sends, the generation
side's read back from its model the same way, so it checks the copy end to end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["TensorDict", "digest", "pack_buckets", "unpack_buckets"]

Spec = tuple[str, tuple[int, ...], torch.dtype]


class TensorDict:
    """Hugging Face tensors by name, as ``convert.mapping.TensorSource`` reads them."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name, dim=None, start=None, stop=None) -> torch.Tensor:
        t = self.tensors[name]
        return t if dim is None else t.narrow(dim, start, stop - start)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A BLAKE2 digest of the names and bytes of ``tensors`` (in the order given)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in tensors:
        h.update(name.encode())
        h.update(_bytes(t).cpu().numpy().tobytes())
    return h.hexdigest()


def pack_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[Spec], torch.Tensor]]:
    """``(specs, bytes)`` buckets of at most ``bucket_bytes`` (a larger tensor alone)."""
    specs, parts, size = [], [], 0
    for name, t in tensors:
        raw = _bytes(t).cpu()
        if parts and size + raw.numel() > bucket_bytes:
            yield specs, torch.cat(parts)
            specs, parts, size = [], [], 0
        specs.append((name, tuple(t.shape), t.dtype))
        parts.append(raw)
        size += raw.numel()
    if parts:
        yield specs, torch.cat(parts)


def unpack_buckets(specs: list[Spec], raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of one bucket (views of ``raw``)."""
    out, offset = {}, 0
    for name, shape, dtype in specs:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out[name] = raw[offset : offset + nbytes].view(dtype).view(shape)
        offset += nbytes
    return out

"""The pickles of a checkpoint, read through an allowlist before the storage layer reads them.

Unpickling imports and calls whatever the file names, so a crafted checkpoint file would run
code on ``--load`` (the manifest's CRC-32 catches damage, not a file written to match it). A
``torch_dist`` directory holds pickles in three places:

* ``.metadata``: torch.distributed.checkpoint's ``Metadata``, a plain pickle that the storage
  layer reads with ``pickle.load``;
* ``common.pt`` (and any other ``*.pt``): ``torch.save`` archives, which Megatron reads with
  ``weights_only``;
* every item of the ``.distcp`` files: one ``torch.save`` archive each, a tensor (read with
  ``weights_only``) or a sharded object (read by torch.distributed.checkpoint without it).

``check_pickles`` unpickles all of them first with ``RestrictedUnpickler``, whose
``find_class`` imports only what these formats hold (``ALLOWED``: found by unpickling the
checkpoints that training and conversion write): ``.metadata`` into its objects (data
classes), the archives inertly (every name they use is checked, nothing is called). Any other
name refuses the checkpoint with ``UnsafeCheckpointError``, one line naming the file and the
class, before the storage layer has read any of it. Which files are data and which could be
code: docs/checkpointing.md#what-a-checkpoint-may-run.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from contextlib import contextmanager

import torch

from loggra_megatron.checkpointing.layout import CheckpointError, list_files

METADATA = ".metadata"

ALLOWED: dict[str, frozenset[str]] = {
    "collections": frozenset({"OrderedDict"}),
    "pathlib": frozenset({"PosixPath"}),  # StorageMeta.checkpoint_id of a torch save
    "torch": frozenset({"Size"}),
    "torch._utils": frozenset({"_rebuild_tensor_v2"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.planner": frozenset(
        {"BytesIOWriteData", "SavePlan", "TensorWriteData", "WriteItem", "WriteItemType"}
    ),
}
"""``{module: names}`` a checkpoint's pickles may import, besides ``TORCH_TYPES``."""

TORCH_TYPES = frozenset(
    name
    for name, value in vars(torch).items()
    if isinstance(value, torch.dtype) or (name.endswith("Storage") and isinstance(value, type))
)
"""``torch.<name>`` dtypes and storage classes (``torch.bfloat16``, ``torch.FloatStorage``)."""


class UnsafeCheckpointError(CheckpointError, ValueError):
    """A checkpoint file whose pickle names a class outside ``ALLOWED``, or is not readable."""


class _Forbidden(Exception):
    """A name outside the allowlist (the message: ``module.name``)."""


class Inert:
    """What every allowed name stands for in a pickle that is only checked: called, built or
    filled, it does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass


class RestrictedUnpickler(pickle.Unpickler):
    """Imports only the names of ``ALLOWED`` and ``TORCH_TYPES``. ``inert``: each of them
    stands for ``Inert`` and a persistent id (a ``torch.save`` storage) for None, so that the
    pickle is checked without anything being built."""

    def __init__(self, file, inert: bool = False):
        super().__init__(file)
        self.inert = inert

    def find_class(self, module, name):
        if name not in ALLOWED.get(module, ()) and not (module == "torch" and name in TORCH_TYPES):
            raise _Forbidden(f"{module}.{name}")
        return Inert if self.inert else super().find_class(module, name)

    def persistent_load(self, pid):
        if not self.inert:
            raise pickle.UnpicklingError("a persistent id outside a torch.save archive")
        return None


@contextmanager
def refusing(where: str):
    """Any failure inside, as ``UnsafeCheckpointError`` naming ``where``."""
    try:
        yield
    except UnsafeCheckpointError:
        raise
    except _Forbidden as e:
        raise UnsafeCheckpointError(
            f"refusing to load {where}: its pickle names {e}, which checkpoints do not hold "
            "(the file was crafted, or written by another program); nothing of it was run"
        ) from None
    except Exception as e:  # what unpickling arbitrary bytes raises is anything
        first = str(e).splitlines()[0] if str(e) else ""
        raise UnsafeCheckpointError(
            f"refusing to load {where}: not a readable checkpoint file ({type(e).__name__}: "
            f"{first})"
        ) from None


class _Slice(io.RawIOBase):
    """``length`` bytes of the open file ``f`` from ``start``, as a seekable file."""

    def __init__(self, f, start: int, length: int):
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def check_archive(f) -> None:
    """Every pickle of the ``torch.save`` archive ``f``, unpickled inertly."""
    with zipfile.ZipFile(f) as archive:
        pickles = [info for info in archive.infolist() if info.filename.endswith(".pkl")]
        if not pickles:
            raise ValueError("a zip archive without a pickle, not a torch.save archive")
        for info in pickles:
            with archive.open(info) as member:
                RestrictedUnpickler(member, inert=True).load()


def read_metadata(path: str):
    """The ``Metadata`` of the dist checkpoint directory ``path`` (its ``.metadata``),
    unpickled through the allowlist. Raises ``UnsafeCheckpointError``."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = os.path.join(path, METADATA)
    with refusing(file):
        with open(file, "rb") as f:
            metadata = RestrictedUnpickler(f).load()
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise ValueError(f"holds a {type(metadata).__name__}, not a checkpoint's Metadata")
    return metadata


def _items_by_file(metadata) -> dict[str, list]:
    """``{data file: [(key, storage info)]}`` of every item ``metadata`` locates."""
    out: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        rel = os.path.normpath(info.relative_path)
        if os.path.isabs(rel) or rel.startswith(os.pardir):
            raise ValueError(f"item {index.fqn!r} lies outside the checkpoint ({rel})")
        out.setdefault(rel, []).append((index.fqn, info))
    return out


def check_pickles(path: str) -> None:
    """Refuse the dist checkpoint directory ``path`` (``UnsafeCheckpointError``) unless each
    of its pickles names only allowed classes: ``.metadata``, every ``*.pt`` file and every
    item of its data files. Reads the pickles only (a few kilobytes per item). Without a
    ``.metadata`` there are no items (nor can the storage layer read any)."""
    metadata = read_metadata(path) if os.path.exists(os.path.join(path, METADATA)) else None
    for rel in list_files(path):
        if rel.endswith(".pt"):
            full = os.path.join(path, rel)
            with refusing(full), open(full, "rb") as f:
                check_archive(f)
    if metadata is None:
        return
    with refusing(os.path.join(path, METADATA)):
        by_file = _items_by_file(metadata)
    for rel, items in sorted(by_file.items()):
        full = os.path.join(path, rel)
        with refusing(full), open(full, "rb") as f:
            for key, info in items:
                with refusing(f"{full} (item {key})"):
                    check_archive(_Slice(f, info.offset, info.length))

"""Transformer Engine's FP8 extra state, read through an allowlist before TE unpickles it.

A TE module (``Linear``, ``LayerNormLinear``; Megatron's TE wrappers) saves its FP8 state
(the recipe, and under delayed scaling its scales and amax history) as ``_extra_state``: a
``uint8`` tensor holding ``pickle.dumps`` of a dict (TE 2.x), or, in TE 1.x, an
``io.BytesIO`` of a ``torch.save``. The checkpoint's own pickles are checked before the storage
layer reads them (``pickles.check_pickles``), and a byte tensor passes that check as the data
it is. But ``set_extra_state`` then runs ``pickle.loads`` on those bytes, with no allowlist:
a crafted checkpoint would run code at ``model.load_state_dict``, after every other check.

``check_extra_states`` unpickles every ``*._extra_state`` of a loaded state dict inertly first:
only the names TE's state holds may appear (``EXTRA_STATE_ALLOWED``: the recipe classes of
``transformer_engine.common.recipe``, CPU tensors, ``OrderedDict``), and a tensor's storage,
pickled as a nested ``torch.save`` archive (``torch.storage._load_from_bytes``, which torch
reads without ``weights_only``; torch's legacy format there), has each of its pickles checked
the same way. Megatron-Core 0.19 replaces that function at import by
``megatron.core.safe_globals.safe_load_from_bytes`` (the same archive read with
``weights_only``), so a storage pickled where it is imported names that one: it is the same
nested archive, checked the same way. Anything else refuses
the checkpoint with ``UnsafeCheckpointError`` naming the key and the class, before TE reads
it. Megatron's local layers save ``None`` there (nothing to check).
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator, Mapping

import torch

from loggra_megatron.checkpointing.pickles import (
    ALLOWED,
    Inert,
    RestrictedUnpickler,
    check_archive,
    refusing,
)

EXTRA_STATE_SUFFIX = "_extra_state"

TE_RECIPES = "transformer_engine.common.recipe"

EXTRA_STATE_ALLOWED: dict[str, frozenset[str]] = {
    **ALLOWED,
    TE_RECIPES: frozenset(
        {
            "Format",
            "_FormatHelper",
            "MMParams",
            "QParams",
            "DelayedScaling",
            "Float8CurrentScaling",
            "MXFP8BlockScaling",
            "Float8BlockScaling",
            "NVFP4BlockScaling",
        }
    ),
}
"""``{module: names}`` TE's FP8 extra state may import (TE 1.x-2.x), besides the checkpoint
allowlist's; a storage's loader (``NESTED_ARCHIVES``) is checked apart (a nested archive)."""

NESTED_ARCHIVES = frozenset(
    {
        ("torch.storage", "_load_from_bytes"),
        ("megatron.core.safe_globals", "safe_load_from_bytes"),  # 0.19+: replaces torch's
    }
)
"""The functions a pickled tensor storage names to load its ``torch.save`` archive."""


LEGACY_PICKLES = 5
"""The pickles that open torch's legacy (non-zip) ``torch.save`` format, before the raw
storage bytes: magic number, protocol version, system info, the object, the storage keys."""


def _check_nested_archive(data: bytes) -> None:
    """A tensor storage inside the state (``torch.storage._load_from_bytes``): a
    ``torch.save`` archive, zip or legacy, each of its pickles checked inertly."""
    f = io.BytesIO(data)
    if zipfile.is_zipfile(f):
        f.seek(0)
        check_archive(f)
        return
    f.seek(0)
    for _ in range(LEGACY_PICKLES):
        RestrictedUnpickler(f, inert=True).load()


class ExtraStateUnpickler(RestrictedUnpickler):
    """``RestrictedUnpickler`` over ``EXTRA_STATE_ALLOWED``, always inert: a nested storage
    archive is checked in place of being loaded."""

    def __init__(self, file):
        super().__init__(file, inert=True)

    def find_class(self, module, name):
        if (module, name) in NESTED_ARCHIVES:
            return _check_nested_archive
        if name in EXTRA_STATE_ALLOWED.get(module, ()):
            return Inert
        return super().find_class(module, name)


def check_extra_state(state, where: str) -> None:
    """Refuse ``state`` (one module's ``_extra_state``) with ``UnsafeCheckpointError`` naming
    ``where`` unless it names only allowed classes. None and an empty tensor (no FP8) pass."""
    if state is None:
        return
    with refusing(where):
        if isinstance(state, torch.Tensor):
            if state.numel():
                data = state.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                ExtraStateUnpickler(io.BytesIO(data)).load()
        elif isinstance(state, io.BytesIO):
            state.seek(0)
            check_archive(state)
            state.seek(0)
        else:
            raise TypeError(f"an extra state of type {type(state).__name__}")


def _extra_states(tree, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _extra_states(value, f"{name}.")
        elif str(key).endswith(EXTRA_STATE_SUFFIX):
            yield name, value


def check_extra_states(loaded: Mapping, path: str) -> None:
    """``check_extra_state`` for every ``*._extra_state`` of the state dict ``loaded`` (read
    from the checkpoint ``path``), before any module loads it."""
    for name, state in _extra_states(loaded):
        check_extra_state(state, f"{path} ({name})")

"""Transformer Engine's FP8 extra state (a pickle inside a ``uint8`` tensor, which TE's
``set_extra_state`` unpickles with no allowlist) is checked before any module reads it: TE's
own state passes, a crafted one is refused in one line naming the key and the class, and
nothing of it runs."""

import dataclasses
import enum
import io
import pickle
import sys
import types
from typing import NamedTuple

import pytest
import torch
from crafted_pickles import OPEN, Opens

from loggra_megatron.checkpointing.extra_state import (
    NESTED_ARCHIVES,
    TE_RECIPES,
    check_extra_state,
    check_extra_states,
)
from loggra_megatron.checkpointing.pickles import UnsafeCheckpointError


@pytest.fixture
def te_recipes(monkeypatch):
    """A module named as TE's recipes, with classes shaped as TE 2.x's: what a real
    state's pickle names (TE itself has no CPU build)."""
    module = types.ModuleType(TE_RECIPES)

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(448, 448)
        HYBRID = _FormatHelper(448, 57344)

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"

    for cls in (_FormatHelper, Format, DelayedScaling):
        cls.__module__ = TE_RECIPES
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, cls)
    for parent in ("transformer_engine", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, TE_RECIPES, module)
    return module


def _te_state(state: dict) -> torch.Tensor:
    """TE 2.x's ``get_extra_state``: the pickled dict as a byte tensor."""
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def test_te_state_passes(te_recipes):
    state = {
        "recipe": te_recipes.DelayedScaling(),
        "scale_fwd": torch.ones(3),
        "amax_history_fwd": torch.zeros(16, 3),
        "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True},
    }
    check_extra_state(_te_state(state), "k")
    check_extra_state(torch.empty(0, dtype=torch.uint8), "k")  # no FP8
    check_extra_state(None, "k")  # Megatron's local layers


def test_a_crafted_state_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    crafted = _te_state({"recipe": Opens(marker)})
    loaded = {"model0": {"decoder.layers.0.mlp.linear_fc1._extra_state": crafted}}
    with pytest.raises(UnsafeCheckpointError) as e:
        check_extra_states(loaded, "ckpt")
    message = str(e.value)
    assert "\n" not in message and f"its pickle names {OPEN}" in message
    assert "ckpt (model0.decoder.layers.0.mlp.linear_fc1._extra_state)" in message
    assert not marker.exists()
    pickle.loads(crafted.numpy().tobytes())  # what TE's set_extra_state does with it
    assert marker.exists()


def _storage_loader(monkeypatch, module: str, name: str):
    """A function that pickles as ``module.name``, the loader a tensor storage names."""

    def load(data: bytes):
        return torch.load(io.BytesIO(data), weights_only=True)

    load.__module__, load.__qualname__ = module, name
    if module not in sys.modules:  # megatron-core before 0.19 has no safe_globals
        monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
    monkeypatch.setattr(sys.modules[module], name, load, raising=False)
    return load


class _Storage:
    def __init__(self, loader, data: bytes):
        self.loader, self.data = loader, data

    def __reduce__(self):
        return (self.loader, (self.data,))


@pytest.mark.parametrize("loader", sorted(NESTED_ARCHIVES), ids=lambda m_n: m_n[0])
@pytest.mark.parametrize("zipped", [False, True], ids=["legacy", "zip"])
def test_a_tensor_storage_inside_the_state_is_checked_as_an_archive(
    tmp_path, monkeypatch, zipped, loader
):
    """A tensor in the state pickles its storage as a nested torch.save archive (torch's
    legacy format), loaded by ``torch.storage._load_from_bytes`` without weights_only, or,
    once megatron-core 0.19 is imported (it replaces that function), by its
    ``safe_load_from_bytes``: a real storage passes, a crafted archive is refused as a
    checkpoint's is."""
    load = _storage_loader(monkeypatch, *loader)
    marker = tmp_path / "ran"
    good, bad = io.BytesIO(), io.BytesIO()
    torch.save(torch.ones(3), good, _use_new_zipfile_serialization=zipped)
    torch.save(Opens(marker), bad, _use_new_zipfile_serialization=zipped)
    check_extra_state(_te_state({"scale_fwd": _Storage(load, good.getvalue())}), "k")
    with pytest.raises(UnsafeCheckpointError, match=f"its pickle names {OPEN}"):
        check_extra_state(_te_state({"scale_fwd": _Storage(load, bad.getvalue())}), "k")
    assert not marker.exists()


def test_te_1x_bytesio_state_is_checked_as_an_archive(tmp_path):
    marker = tmp_path / "ran"
    good, bad = io.BytesIO(), io.BytesIO()
    torch.save({"scale_fwd": torch.ones(2)}, good)
    torch.save({"evil": Opens(marker)}, bad)
    check_extra_state(good, "k")
    assert good.tell() == 0  # rewound for TE
    with pytest.raises(UnsafeCheckpointError, match=OPEN):
        check_extra_state(bad, "k")
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match="an extra state of type str"):
        check_extra_state("x", "k")

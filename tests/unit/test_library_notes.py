"""Known-benign library warnings are filtered, each by its own message, and every other
warning stays visible."""

from __future__ import annotations

import re
import warnings

import pytest

from loggra_megatron import library_notes
from loggra_megatron.library_notes import BENIGN, missing_extras_note, quiet_benign_warnings

SEEN = [  # as the libraries word them (megatron-core 0.16.1 / 0.19.2, torch 2.13 / 2.14)
    (
        UserWarning,
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    ),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    (
        FutureWarning,
        "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
        "`torch.distributed.reduce_scatter_single` instead.",
    ),
    (
        FutureWarning,
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
        "`torch.distributed.all_gather_single` instead.",
    ),
    (
        FutureWarning,
        "`load_state_dict` is deprecated and will be removed in future versions. Please use "
        "`load` instead.",
    ),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
]


def _shown(category, message) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_benign_warnings()
        warnings.warn(message, category, stacklevel=1)
    return bool(caught)


@pytest.mark.parametrize(("category", "message"), SEEN)
def test_each_known_benign_warning_is_filtered(category, message):
    assert not _shown(category, message)


@pytest.mark.parametrize(
    ("category", "message"),
    [
        (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor is accessed"),
        (FutureWarning, "`torch.distributed.broadcast_object_list` is deprecated"),
        (DeprecationWarning, "Transformer Engine and Apex are not installed"),  # other category
        (UserWarning, "full scope is deprecated. Use empty cuda_graph_scope"),  # ours: fixed
    ],
)
def test_other_warnings_stay_visible(category, message):
    assert _shown(category, message)


def test_every_filter_matches_a_warning_seen():
    for category, pattern in BENIGN:
        assert any(c is category and re.match(pattern, m) for c, m in SEEN), pattern


def test_the_missing_extras_are_said_once_when_both_are_missing(monkeypatch):
    present = set()
    monkeypatch.setattr(
        library_notes.importlib.util,
        "find_spec",
        lambda name: object() if name in present else None,
    )
    assert "Transformer Engine and Apex are not installed" in missing_extras_note()
    present.add("apex")
    assert missing_extras_note() is None

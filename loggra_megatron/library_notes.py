"""Known-benign conditions of the libraries under the trainer, reported once.

Megatron-Core warns when it is imported, from four modules and on every rank, that
Transformer Engine and Apex are missing (it then runs its torch fallbacks: optimizers, norms,
multi-tensor ops), and torch warns about names it deprecates that Megatron-Core still calls
(``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``ShardedTensor``, the checkpoint
strategy's ``load_state_dict``). None of these asks anything of a user of this project; about
30 such lines buried the quickstart's own output. ``quiet_benign_warnings`` filters exactly
these messages (call it before Megatron-Core is imported); ``missing_extras_note`` is the one
start-up line that says what the first of them said. Every other warning stays visible.
"""

from __future__ import annotations

import importlib.util
import warnings

BENIGN = (
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm"),
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is"),
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)
"""``(category, message pattern)`` of each known-benign library warning."""


def quiet_benign_warnings() -> None:
    """Ignore the warnings of ``BENIGN`` in this process."""
    for category, message in BENIGN:
        warnings.filterwarnings("ignore", message=message, category=category)


def missing_extras_note() -> str | None:
    """One line when neither Transformer Engine nor Apex is installed, else ``None``."""
    if any(importlib.util.find_spec(name) for name in ("transformer_engine", "apex")):
        return None
    return (
        "note: Transformer Engine and Apex are not installed: Megatron-Core runs its torch "
        "fallbacks (optimizers, norms, multi-tensor ops)"
    )

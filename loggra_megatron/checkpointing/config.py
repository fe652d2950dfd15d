"""Settings of checkpoints: where to save, what to load, how to verify."""

from __future__ import annotations

from dataclasses import dataclass

from loggra_megatron.config import applies, at_least, check_fields, positive


@dataclass
class CheckpointConfig:
    """``--save`` / ``--load`` and their options (``docs/checkpointing.md``)."""

    save: str | None = None
    """Directory for checkpoints (and, by default, metrics.jsonl)."""
    load: str | None = None
    """Checkpoint to start from: a run's --save directory (resume) or a converted model."""
    save_interval: int | None = applies(None, "with --save", lambda s: s["save"] is not None)
    """Save every N RL steps (and always at the end and on SIGTERM)."""
    no_load_optim: bool = applies(False, "with --load", lambda s: s["load"] is not None)
    """Load the policy's weights only (any TP/PP); optimizer, reference model, schedule and
    data position start fresh."""
    ckpt_step: int | None = applies(None, "with --load", lambda s: s["load"] is not None)
    """Load this iteration of --load instead of the latest (e.g. after a corrupted save)."""
    checkpoint_checksums: bool = applies(
        True, "with --save or --load", lambda s: s["save"] is not None or s["load"] is not None
    )
    """CRC-32 of every checkpoint file, written on save and verified on load (~2 GB/s per
    rank); --no-checkpoint-checksums records and checks file sizes only."""

    def __post_init__(self):
        check_fields(
            self, [("save_interval", positive, ">= 1"), ("ckpt_step", at_least(0), ">= 0")]
        )

"""Settings of checkpoints: where to save, what to load, how to verify."""

from __future__ import annotations

from dataclasses import dataclass

from loggra_megatron.config import at_least, check_fields, positive, reject


@dataclass
class CheckpointConfig:
    """``--save`` / ``--load`` and their options (``docs/checkpointing.md``)."""

    save: str | None = None
    """Directory for checkpoints (and, by default, metrics.jsonl)."""
    load: str | None = None
    """Checkpoint to start from: a run's --save directory (resume) or a converted model."""
    save_interval: int | None = None
    """Save every N RL steps (and always at the end and on SIGTERM)."""
    no_load_optim: bool = False
    """Load the policy's weights only (any TP/PP); optimizer, reference model, schedule and
    data position start fresh."""
    ckpt_step: int | None = None
    """Load this iteration of --load instead of the latest (e.g. after a corrupted save)."""
    checkpoint_checksums: bool = True
    """CRC-32 of every checkpoint file, written on save and verified on load (~2 GB/s per
    rank); --no-checkpoint-checksums records and checks file sizes only."""

    def __post_init__(self):
        check_fields(self, [("save_interval", positive, ">= 1"), ("ckpt_step", at_least(0), ">= 0")])
        if self.save_interval is not None and self.save is None:
            reject("save_interval", self.save_interval, "needs --save")

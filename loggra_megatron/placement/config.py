"""Settings of where generation runs: on the training ranks (colocated) or on ranks of its
own (``placement/``)."""

from __future__ import annotations

from dataclasses import dataclass

from loggra_megatron.config import applies, at_least, check_fields, one_of, positive


def _disaggregated(settings: dict) -> bool:
    return settings["generation_ranks"] > 0


@dataclass
class PlacementConfig:
    """Which ranks generate, and how the trainer's weights reach them."""

    generation_ranks: int = 0
    """The last N ranks of the torchrun world generate and never train; the others train and
    never hold a KV cache. 0: every rank trains and generates (the colocated loop)."""
    generation_tensor_model_parallel_size: int | None = applies(
        None, "with --generation-ranks > 0", _disaggregated
    )
    """Tensor-parallel size of the generation ranks' policy (default: the training
    --tensor-model-parallel-size); it must divide --generation-ranks."""
    max_policy_lag: int = applies(0, "with --generation-ranks > 0", _disaggregated)
    """The generation ranks may generate up to this many RL steps ahead of training, with the
    weights of up to this many steps ago (0: lock-step). The loss corrects for the lag with
    --tis-cap's importance weights against the generating policy (docs/losses.md)."""
    weight_sync: str = applies("full", "with --generation-ranks > 0", _disaggregated)
    """full: every weight after each update (bucketed, resharded to the generation TP) |
    lowrank (the backward sketch): the sketched weights as their row updates ``D`` and the
    projection's draw, which the generation ranks apply to a copy of the masters; the other
    trained weights in full (docs/placement.md)."""
    weight_sync_check_interval: int = applies(10, "with --generation-ranks > 0", _disaggregated)
    """Every this many weight syncs, the generation ranks compare a checksum of their weights
    with the trainer's and the run stops on a mismatch (``sync/checksum_ok``)."""
    weight_sync_on_mismatch: str = applies("stop", "with --generation-ranks > 0", _disaggregated)
    """What a checksum mismatch does: stop (the run ends with a message) | resync (the
    generation ranks generate nothing with those weights; the trainer sends a full sync and
    the request again, and the step logs ``sync/checksum_ok`` 0)."""
    weight_sync_bucket_mb: int = applies(256, "with --generation-ranks > 0", _disaggregated)
    """The full weight sync sends the weights in buckets of at most this many MiB."""
    generation_timeout_minutes: float = applies(10.0, "with --generation-ranks > 0", _disaggregated)
    """The longest either leader waits for the other (a rollout, a weight sync): past it the
    run ends on every rank with a message naming the silent side."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("generation_ranks", at_least(0), ">= 0 (0: generation on the training ranks)"),
                ("generation_tensor_model_parallel_size", positive, ">= 1"),
                ("max_policy_lag", at_least(0), ">= 0 (0: lock-step)"),
                ("weight_sync", one_of("full", "lowrank"), "one of full, lowrank"),
                ("weight_sync_on_mismatch", one_of("stop", "resync"), "one of stop, resync"),
                ("weight_sync_check_interval", positive, ">= 1"),
                ("weight_sync_bucket_mb", positive, ">= 1"),
                ("generation_timeout_minutes", lambda v: v > 0, "> 0"),
            ],
        )

    @property
    def disaggregated(self) -> bool:
        return self.generation_ranks > 0

    def generation_tp(self, training_tp: int) -> int:
        """The generation ranks' tensor-parallel size."""
        return self.generation_tensor_model_parallel_size or training_tp

"""Settings of rollout generation (sampling from the policy)."""

from __future__ import annotations

from dataclasses import dataclass

from loggra_megatron.config import at_least, check_fields, positive


@dataclass
class RolloutConfig:
    """How completions are sampled."""

    max_new_tokens: int = 32
    """Maximum response tokens."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling."""

    def __post_init__(self):
        check_fields(self, [
            ("max_new_tokens", positive, ">= 1"), ("temperature", at_least(0), ">= 0 (0: greedy)"),
            ("top_p", lambda p: 0 < p <= 1, "in (0, 1]"),
        ])  # fmt: skip

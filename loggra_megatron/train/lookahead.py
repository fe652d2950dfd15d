"""Prompts drawn ahead of training (``--max-policy-lag K`` with ``--generation-ranks``): the
next ``K`` RL steps' prompts go to the generation ranks while the trainer updates on the
current step's rollouts (``placement.remote.RemoteEngine.submit``).

The data position a checkpoint saves is the one of the last step trained, not of the last
prompts drawn: ``state_dict`` takes the steps in flight back out, so that a resume draws
them again (and generates them with the resumed weights: their lag starts again at 0).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

__all__ = ["PromptLookahead"]


class PromptLookahead:
    """This DP rank's prompts of the RL steps ahead, in order (``draw``: the next step's)."""

    def __init__(self, dataset, draw: Callable[[], list[dict]], global_prompts_per_step: int):
        self.dataset, self.draw, self.per_step = dataset, draw, global_prompts_per_step
        self.queue: deque[list[dict]] = deque()

    def take(self) -> list[dict]:
        """The prompts of the step about to be trained."""
        return self.queue.popleft() if self.queue else self.draw()

    def extend_to(self, steps: int) -> list[list[dict]]:
        """Draws until ``steps`` steps are ahead; returns the new ones, in step order."""
        new = []
        while len(self.queue) < steps:
            self.queue.append(self.draw())
            new.append(self.queue[-1])
        return new

    def state_dict(self) -> dict:
        """The dataset's state (``data.prompts.PromptDataset``) with the steps ahead taken
        back out."""
        state = self.dataset.state_dict()
        consumed = state["consumed_samples"] - len(self.queue) * self.per_step
        return {**state, "consumed_samples": consumed}

    def load_state_dict(self, state: dict) -> None:
        self.queue.clear()
        self.dataset.load_state_dict(state)

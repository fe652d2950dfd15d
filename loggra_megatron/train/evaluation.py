"""Held-out evaluation (``--eval-data-path``, ``--eval-interval``): greedy completions of the
held-out prompts, scored by the task, no training on them.

Each DP rank takes every DP-th prompt (all TP/PP ranks of a replica take the same ones and
generate together), in chunks of the rank's rollout batch; the sums of reward and of correct
answers are all-reduced over DP, so ``eval/reward`` and ``eval/accuracy`` are means over all
evaluated prompts (a prompt whose reward failed, ``tasks.scoring``, is left out of both).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from loggra_megatron.data.config import DataConfig
from loggra_megatron.data.prompts import PromptDataset
from loggra_megatron.rl.experience import ExperienceMaker


class Evaluator:
    """``--eval-*`` of ``data`` over ``dataset``, generating ``rollout_batch_size`` prompts at
    a time over the DP group (a DP rank takes its share of them)."""

    def __init__(
        self,
        experience: ExperienceMaker,
        dataset: PromptDataset,
        data: DataConfig,
        rollout_batch_size: int,
        dp_group: dist.ProcessGroup,
    ):
        self.experience, self.dp_group = experience, dp_group
        samples = data.eval_samples or len(dataset)
        dp, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.examples = [{**dataset[i], "index": i} for i in range(min(samples, len(dataset)))]
        self.mine = self.examples[rank::dp]
        self.chunk = max(1, rollout_batch_size // dp)
        self.interval = data.eval_interval

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    @torch.no_grad()
    def run(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        totals = torch.zeros(3, dtype=torch.float64)  # reward, correct, scored count (host)
        for i in range(0, len(self.mine), self.chunk):
            group = self.mine[i : i + self.chunk]
            rollout = self.experience.generate(group, step, temperature=0.0)
            scores = self.experience.score(rollout, group, f" in the eval at step {step}")
            totals += torch.tensor(scores.totals(), dtype=torch.float64)
        if dist.get_world_size(self.dp_group) > 1:  # on the device: NCCL takes no host tensors
            totals = totals.to(self.experience.device)
            dist.all_reduce(totals, group=self.dp_group)
            totals = totals.cpu()
        count = max(float(totals[2]), 1.0)
        return {
            "eval/reward": float(totals[0]) / count,
            "eval/accuracy": float(totals[1]) / count,
            "time/eval_s": time.perf_counter() - t0,
        }

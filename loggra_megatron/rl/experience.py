"""Experience: one RL step's prompts → rollouts → rewards → advantages → reference log-probs.

``ExperienceMaker`` runs the phases on one DP rank (every TP/PP rank of a model replica
takes part in the generation and the log-prob forwards with the same tokens):

1. the rank's prompts are rendered (``PromptRenderer``:
   the chat template or the task's plain template) and each is sampled ``num_generations``
   times by the policy's KV-cached generator (``
   generate_rollout``; it stops at any of the tokenizer's stop ids and never samples a padded
   vocabulary row; the sampling log-probs are the PPO "old" log-probs);
2. completions are decoded and scored: the task's reward and verdict, or ``--reward-fn``
   (``Scoring.score``); a sample whose reward failed (``tasks.scoring``) is counted
   (``reward/errors``), left out of the reward metrics, and takes advantage 0 and, for the
   advantage estimator, the mean reward of its group's scored samples (their mean is kept);
3. advantages, by ``--advantage-estimator`` (``rl.advantages``): group-relative (each
   prompt's group lives on one rank) or against a running baseline of the global batch's
   mean reward (all-reduced over DP);
4. the frozen reference model's log-probs, when there is one (``--kl-coef`` > 0).

The result is an ``Experience``, the batch ``Actor``
trains on.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loggra_megatron.data.prompts import PromptRenderer, prompt_text
from loggra_megatron.data.tokenizer import Tokenizer
from loggra_megatron.model.batching import PaddingStats, needed_lengths
from loggra_megatron.rl.advantages import ADVANTAGE_ESTIMATORS
from loggra_megatron.rl.config import GRPOConfig
from loggra_megatron.rollout.config import RolloutConfig
from loggra_megatron.rollout.protocol import EngineTarget, RolloutRequest
from loggra_megatron.rollout.registry import select_engine
from loggra_megatron.tasks.scoring import RewardFunctionError, Scores, Scoring

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

MemoryPhase = Callable[[str], AbstractContextManager]
"""``memory_phase(name)``: a context measuring the peak memory of the phase it encloses (the
trainer passes ``train.memory_phases``'s); ``nullcontext``: none."""


@dataclass
class Experience:
    """The scored rollouts of one RL step on this DP rank (shifted causal-LM convention:
    position ``t`` of the ``[B, L - 1]`` tensors describes ``tokens[:, t + 1]``)."""

    tokens: torch.Tensor
    """``[B, L]`` prompt + response token ids, right-padded."""
    response_mask: torch.Tensor
    """``[B, L - 1]`` which targets are response tokens."""
    old_log_probs: torch.Tensor | None
    """``[B, L - 1]`` π_old of the PPO ratio (None: the training forward's own, detached; the
    sources: ``rollout.protocol.OLD_LOG_PROB_SOURCES``)."""
    rollout_log_probs: torch.Tensor | None
    """``[B, L - 1]`` the log-probs the rollout engine sampled with (None: an engine that does
    not sample its own); with ``--tis-cap`` the weights' denominator."""
    advantages: torch.Tensor
    """``[B]`` advantages (``--advantage-estimator``)."""
    ref_log_probs: torch.Tensor | None
    """``[B, L - 1]`` reference log-probs (last pipeline stage; None without a reference)."""
    num_tokens: torch.Tensor
    """Prompt + response tokens of this rank's batch (0-d)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``reward/mean``, ``reward/std``, ``reward/accuracy`` (over the scored samples),
    ``reward/errors``, ``response/length_mean`` and the advantage estimator's
    (``reward/baseline``)."""

    def training_batch(self, device) -> dict[str, torch.Tensor]:
        """The tensors the GRPO loss reads, on ``device``."""
        batch = {
            "tokens": self.tokens.to(device),
            "mask": self.response_mask.to(device),
            "adv": self.advantages.to(device),
        }
        if self.old_log_probs is not None:
            batch["old"] = self.old_log_probs.to(device)
        if self.rollout_log_probs is not None:
            batch["rollout"] = self.rollout_log_probs.to(device)
        if self.ref_log_probs is not None:
            batch["ref"] = self.ref_log_probs.to(device)
        return batch


class ExperienceMaker:
    """Makes ``Experience`` from prompts with the policy, the reward and the reference."""

    def __init__(
        self,
        *,
        policy: MegatronModule,
        reference: MegatronModule | None,
        tokenizer: Tokenizer,
        renderer: PromptRenderer,
        scoring: Scoring,
        rollout: RolloutConfig,
        grpo: GRPOConfig,
        seed: int,
        log_prob_micro_batch_size: int,
        length_grouping: bool = True,
        tis: bool = False,
        on_policy: bool = False,
        dp_group=None,
    ):
        from megatron.core.utils import get_model_config

        from loggra_megatron.model.forward import fp8_alignment

        self.policy, self.reference = policy, reference
        self.tokenizer, self.renderer, self.scoring = tokenizer, renderer, scoring
        self.rollout, self.grpo = rollout, grpo
        self.seed = seed
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        """Sequences per micro-batch of the reference and log-prob forwards."""
        self.length_grouping = length_grouping
        """Rows of similar length share a micro-batch of the log-prob forwards."""
        self.device = next(policy.parameters()).device
        self.engine, self.engine_note = select_engine(
            rollout.rollout_engine, EngineTarget.of_model(policy)
        )
        """The ``--rollout-engine`` (``auto`` chosen here) and a note on the choice."""
        self.kv_budget = rollout.inference_max_tokens
        """The KV cache's bound in tokens: ``--inference-max-tokens``, or where it is unset
        the trainer's sizing from the memory model on a GPU (``memory.kv_budget``)."""
        config = get_model_config(policy)
        apart = tis or rollout.decodes_apart(config.fp8 or None)
        self.old_log_probs = self.engine.old_log_probs(apart, on_policy)
        """Where π_old comes from (``rollout.protocol.OLD_LOG_PROB_SOURCES``): ``--tis-cap``
        (``tis``) or a bf16 rollout of an FP8 policy or neither, one optimizer update per RL
        step (``on_policy``) or several."""
        self.row_multiple = fp8_alignment(config) if rollout.rollout_fp8 else 1
        self.advantages = ADVANTAGE_ESTIMATORS[grpo.advantage_estimator](
            grpo, dp_group, self.device
        )
        """``--advantage-estimator`` over the DP group ``dp_group`` (None: this rank alone);
        a checkpointed component where it keeps state (the running baseline)."""
        self.last_stats: dict[str, float] = {}
        """``time/rollout_s``, ``memory/kv_cache_bytes`` and the generated tokens of the
        last ``generate``."""

    def make(
        self, examples: list[dict], step: int, memory_phase: MemoryPhase = nullcontext
    ) -> Experience:
        """Experience of RL step ``step + 1`` from this rank's ``examples``; the rollout
        (generation, rewards) and the reference log-probs run in ``memory_phase("rollout")``
        and ``memory_phase("log_probs")``, as does π_old's recompute (``old_log_probs``)."""
        group = self.group(examples)
        with memory_phase("rollout"):
            rollout = self.generate(group, step, self.rollout.temperature)
            generated = self.last_stats
            scores = self.score(rollout, group, f" at RL step {step + 1}")
        failed = torch.tensor(scores.failed)
        rewards = _imputed(scores, failed, self.grpo.num_generations)
        advantages = self.advantages(rewards)  # collective over DP (the running baseline)
        advantages[failed] = 0.0  # a failed reward is no signal
        scored = rewards[~failed]
        sampled = None if self.engine.recomputes_log_probs else rollout.log_probs
        old = None  # "training": the training forward's own
        if self.old_log_probs == "rollout" or (self.old_log_probs, sampled) == ("recompute", None):
            old = rollout.log_probs  # sampled, or the engine's own recompute
        elif self.old_log_probs == "recompute":  # the trainer's, beside the engine's
            with memory_phase("log_probs"):
                old = self.log_probs(self.policy, rollout)
        ref, padding = None, {}
        if self.reference is not None:
            stats = PaddingStats()
            with memory_phase("log_probs"):
                ref = self.log_probs(self.reference, rollout, stats)
            padding["throughput/padded_token_fraction/reference"] = stats.fraction
        return Experience(
            tokens=rollout.tokens,
            response_mask=rollout.response_mask,
            old_log_probs=old,
            rollout_log_probs=sampled,
            advantages=advantages,
            ref_log_probs=ref,
            num_tokens=rollout.token_mask.sum(),
            metrics={
                "reward/mean": scored.mean().item(),
                "reward/std": scored.std().item() if len(scored) > 1 else 0.0,
                "reward/accuracy": sum(scores.correct) / len(scored),
                "reward/errors": float(len(scores.errors)),
                "response/length_mean": rollout.response_lengths.float().mean().item(),
                **self.advantages.metrics(),
                **generated,
                **padding,
            },
        )

    def log_probs(self, model, rollout, padding: PaddingStats | None = None):
        """``model``'s log-probs ``[B, L − 1]`` of the rollout's tokens (None off the last
        pipeline stage), in forwards of ``--log-prob-micro-batch-size`` rows."""
        from loggra_megatron.model.log_probs import compute_log_probs

        return compute_log_probs(
            model,
            rollout.tokens,
            micro_batch_size=self.log_prob_micro_batch_size,
            lengths=needed_lengths(rollout.response_mask),
            group=self.length_grouping,
            padding=padding,
        )

    def generate(self, examples: list[dict], step: int, temperature: float):
        """One completion of each example (a ``Rollout``) from
        the ``--rollout-engine``, its KV cache bounded by ``--inference-max-tokens``."""
        self.engine.sync_weights(self.policy)
        request = self.request(step, temperature)
        rollout, self.last_stats = self.engine.generate(
            self.policy, self.prompt_ids(examples), request
        )
        return rollout

    def group(self, examples: list[dict]) -> list[dict]:
        """Each of an RL step's examples ``--num-generations`` times (its GRPO group)."""
        return [e for e in examples for _ in range(self.grpo.num_generations)]

    def prompt_ids(self, examples: list[dict]) -> list[list[int]]:
        """The rendered prompt of each example, as token ids."""
        return [self.renderer.ids(e["prompt"]) for e in examples]

    def request(self, step: int, temperature: float) -> RolloutRequest:
        """The rollout request of RL step ``step + 1`` at ``temperature``."""
        tok, r = self.tokenizer, self.rollout
        return RolloutRequest(
            max_new_tokens=r.max_new_tokens,
            temperature=temperature,
            top_p=r.top_p,
            stop_ids=tok.stop_ids,
            pad_id=tok.pad,
            vocab_size=tok.vocab_size,
            seed=self.seed,
            step=step,
            max_tokens=self.kv_budget,
            log_prob_micro_batch_size=self.log_prob_micro_batch_size,
            length_grouping=self.length_grouping,
            row_multiple=self.row_multiple,
            fp8=r.rollout_fp8,
            log_probs=self.old_log_probs != "training",
            cuda_graphs=r.rollout_cuda_graphs,
            decode_graph_sizes=r.inference_dynamic_batching_num_cuda_graphs,
        )

    def score(self, rollout, group: list[dict], where: str) -> Scores:
        """The ``Scores`` of the rollout's completions of ``group``'s examples. A reward error
        names ``where`` and the example's dataset index: raised when too many samples failed
        (``--reward-max-error-fraction``), else the first one printed."""
        tok = self.tokenizer
        completions = [
            tok.detokenize(row[int(p) : int(p) + int(n)].tolist())
            for row, p, n in zip(
                rollout.tokens, rollout.prompt_lengths, rollout.response_lengths, strict=True
            )
        ]

        def located(e: RewardFunctionError) -> RewardFunctionError:
            return e.at(f"{where} (dataset prompt index {group[e.index]['index']})")

        try:
            scores = self.scoring.score(
                [prompt_text(e["prompt"]) for e in group],
                completions,
                [e["answer"] for e in group],
                [e["metadata"] for e in group],
            )
        except RewardFunctionError as e:
            raise located(e) from None
        if scores.errors:
            print(
                f" warning: {len(scores.errors)} of {len(group)} rewards failed (reward/errors; "
                f"not trained on), the first: {located(scores.errors[0]).headline}",
                flush=True,
            )
        return scores


def _imputed(scores: Scores, failed: torch.Tensor, group_size: int) -> torch.Tensor:
    """The rewards ``[B]``, each ``failed`` sample's the mean of its group's scored samples
    (of the batch's where none of its group was scored): the group's mean is theirs."""
    rewards = torch.tensor(scores.rewards)
    if not failed.any():
        return rewards
    batch = rewards[~failed].mean()
    for g in range(0, len(rewards), group_size):
        ok = ~failed[g : g + group_size]
        fill = rewards[g : g + group_size][ok].mean() if ok.any() else batch
        rewards[g : g + group_size][~ok] = fill
    return rewards

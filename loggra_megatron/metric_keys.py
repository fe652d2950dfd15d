"""The keys of ``metrics.jsonl``, each declared once (``METRICS``): what it means, and how
the values measured on each micro-batch, optimizer update and rank become the one number an
RL step reports (``Reduction``).

A value passes through up to three reductions, in this order: over the micro-batches of a
mini-batch (``combine_micro_batches``: ``sum`` for a term's share of the loss, ``mean``
for token means), over the optimizer updates of the RL step (``combine_updates``) and over
the ranks (``reduce_metrics``). It skips those its
declaration leaves out (``None``); a key that reaches a reduction it does not declare is
refused.

``docs/metrics.md``'s table is generated from ``METRICS`` (``python -m
loggra_megatron.metric_keys docs/metrics.md``; ``tests/unit/test_metrics.py`` fails when it
drifts). The reductions in full: docs/metrics.md#keys; adding a metric:
docs/architecture.md#recipes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

MEAN, SUM, MAX, MIN, FIRST = "mean", "sum", "max", "min", "first"


@dataclass(frozen=True)
class Reduction:
    """How a key's values combine at each stage (``mean`` | ``sum``, over updates also
    ``first``, over ranks also ``max`` | ``min``; None: not this stage)."""

    micro_batches: str | None = None
    """Over the micro-batches of a mini-batch (metrics of the loss terms)."""
    updates: str | None = None
    """Over the optimizer updates of the RL step."""
    ranks: str | None = None
    """Over the DP ranks (each the mean over the pipeline stages that report the key;
    ``max`` and ``min`` take the pipeline stages' largest and smallest too)."""

    def describe(self) -> str:
        stages = (
            (self.micro_batches, "micro-batches"),
            (self.updates, "updates"),
            (self.ranks, "PP and DP ranks" if self.ranks in (MAX, MIN) else "DP ranks"),
        )
        return ", ".join(f"{how} over {what}" for how, what in stages if how) or "as measured"


LOSS_SHARE = Reduction(micro_batches=SUM, updates=MEAN, ranks=SUM)
"""A loss term's share of the global mini-batch loss: the shares add up to the loss."""
TOKEN_MEAN = Reduction(micro_batches=MEAN, updates=MEAN, ranks=MEAN)
"""A token mean over each micro-batch."""
PER_UPDATE = Reduction(updates=MEAN, ranks=MEAN)
"""Measured once per optimizer update (the same on every rank)."""
TOTAL_PER_UPDATE = Reduction(updates=SUM, ranks=MEAN)
"""A count or a time per optimizer update, added up over the step's updates."""
FIRST_UPDATE_TOKEN_MEAN = Reduction(micro_batches=MEAN, updates=FIRST, ranks=MEAN)
"""A token mean over each micro-batch of the step's first update, where the policy is still
the one that generated the rollout."""
PER_RANK = Reduction(ranks=MEAN)
"""One value per rank and step."""
SUMMED_OVER_RANKS = Reduction(ranks=SUM)
"""One value per rank and step, added up over the DP ranks."""
PEAK_OVER_RANKS = Reduction(ranks=MAX)
"""One value per rank and step, the largest of any rank's (a memory peak)."""
LEAST_OVER_RANKS = Reduction(ranks=MIN)
"""One value per rank and step, the smallest of any rank's (free memory)."""
AS_MEASURED = Reduction()
"""One value per step, reported as measured: rank 0's, or the same on every rank."""


@dataclass(frozen=True)
class Metric:
    key: str
    doc: str
    """What it is, in the docs table."""
    reduction: Reduction = AS_MEASURED


def _declare(*metrics: Metric) -> dict[str, Metric]:
    return {m.key: m for m in metrics}


METRICS: dict[str, Metric] = _declare(
    Metric(
        "step",
        "RL step, 1-based (rollout + its optimizer updates; = the checkpoint iteration); "
        "first JSONL key",
    ),
    Metric("loss/total", "policy loss + β·KL-to-reference loss (back-propagated)", LOSS_SHARE),
    Metric("loss/policy", "PPO-clip / GRPO surrogate loss, aggregated as configured", LOSS_SHARE),
    Metric("loss/kl_ref", "β times the aggregated KL(π_θ ‖ π_ref) estimate (k1/k2/k3)", LOSS_SHARE),
    Metric("reward/mean", "mean reward over the rollout batch's scored samples", PER_RANK),
    Metric("reward/std", "standard deviation of the reward over the same samples", PER_RANK),
    Metric(
        "reward/errors",
        "samples whose reward failed (docs/data.md#reward-errors-and-time-limits): counted, "
        "not trained on, left out of the other reward/ keys",
        SUMMED_OVER_RANKS,
    ),
    Metric(
        "reward/baseline",
        "b, the running baseline this step's advantages r − b subtracted (--advantage-estimator "
        "reinforce-baseline): the mean rewards of the earlier steps, decayed by "
        "--baseline-decay (0 on the first step); the same on every rank",
        PER_RANK,
    ),
    Metric(
        "reward/accuracy",
        "share of the scored responses judged correct by the task (with --reward-fn: the "
        "function's verdict, or reward ≥ --accuracy-threshold)",
        PER_RANK,
    ),
    Metric("kl/ref", "token-mean KL(π_θ ‖ π_ref) estimate to the frozen reference", TOKEN_MEAN),
    Metric(
        "kl/target",
        "the per-update KL target of predicted-KL control at this RL step: --kl-target, or its "
        "cosine schedule to --kl-target-final over --kl-target-decay-iters",
        PER_UPDATE,
    ),
    Metric(
        "kl/predicted",
        "predicted KL(π_θ ‖ π_θ+Δθ) of the full candidate update on the probe (on an update "
        "that skipped the probe, kl/probe_skipped: the quadratic model's extrapolation; "
        "compare it with kl/realized on probed updates only)",
        PER_UPDATE,
    ),
    Metric(
        "kl/predicted_committed",
        "predicted KL of the committed update η·Δθ (after backtracking)",
        PER_UPDATE,
    ),
    Metric(
        "kl/realized",
        "KL(π_θ ‖ π_θ') measured on held-out sequences at the committed weights θ' (every "
        "kl_realized_interval steps; with LoGRA read off the last trial's forward, whose "
        "weights are bitwise the committed ones)",
        PER_UPDATE,
    ),
    Metric(
        "kl/step_scale",
        "η, the scale applied to the update (1 = full step, 0 = skipped; above 1, up to "
        "--kl-max-step-scale, a grown step)",
        PER_UPDATE,
    ),
    Metric("kl/backtracks", "number of times η was halved by the backtracking check", PER_UPDATE),
    Metric(
        "kl/probe_skipped",
        "number of this step's optimizer updates committed without a probe trial (η = "
        "kl_max_step_scale, 1 by default: the last measured KL, carried to this update's norm "
        "and scaled by kl_max_step_scale², was below kl_probe_skip_below × the target; their "
        "kl/predicted is the full step's extrapolation)",
        TOTAL_PER_UPDATE,
    ),
    Metric("kl/coef", "β, the (adaptive) coefficient of the KL-to-reference loss"),
    Metric(
        "clip/fraction", "share of tokens whose PPO ratio was clipped (zero gradient)", TOKEN_MEAN
    ),
    Metric("ratio/mean", "token mean of the ratio π_θ / π_old", TOKEN_MEAN),
    Metric(
        "rollout/logprob_mismatch",
        "token mean of |log π_rollout − log π_θ| over the response tokens of the step's first "
        "optimizer update, where θ is still the rollout's policy: how far the rollout "
        "engine's log-probs are from the trainer's forward on the same weights (logged where "
        "the engine samples its own log-probs: the static engine)",
        FIRST_UPDATE_TOKEN_MEAN,
    ),
    Metric(
        "tis/weight_mean",
        "token mean of the truncated importance weight min(π_old / π_rollout, --tis-cap) that "
        "multiplies each token's policy loss (with --tis-cap)",
        TOKEN_MEAN,
    ),
    Metric(
        "kl/old_new",
        "token-mean k3 estimate of KL(π_old ‖ π_θ), the sampling policy to the policy being "
        "trained (grows over PPO epochs / mini-batches)",
        TOKEN_MEAN,
    ),
    Metric("grad/norm", "global gradient L2 norm before clipping", PER_UPDATE),
    Metric(
        "grad/clipped",
        "fraction of the step's optimizer updates whose gradient norm was clipped "
        "(--clip-grad; the backward sketch counts its targets by ‖S‖, an estimate of the "
        "dense gradient's norm)",
        PER_UPDATE,
    ),
    Metric(
        "optimizer/skipped_steps",
        "number of this step's optimizer updates that were skipped (non-finite gradient norm "
        "or predicted KL; weights, state and LR schedule unchanged)",
        TOTAL_PER_UPDATE,
    ),
    Metric("optimizer/skipped_steps_total", "skipped optimizer updates since the start of the run"),
    Metric(
        "memory/optimizer_state_bytes",
        "optimizer state bytes of rank 0 (exact, optim.state_bytes)",
    ),
    Metric(
        "memory/grad_buffer_bytes",
        "bytes of rank 0's DDP grad buffers (the backward sketch's targets have none)",
    ),
    Metric(
        "memory/sketch_buffer_bytes",
        "bytes of rank 0's backward-sketch buffer S (fp32 [Σ m, r]; 0 in other modes)",
    ),
    Metric(
        "loggra/sketch_norm",
        "global norm ‖S‖ of the backward sketches before clipping, the targets' part of "
        "grad/norm: an unbiased estimate of their dense gradient's norm, E‖S‖² = ‖G‖² "
        "(--loggra-sketch backward; until this version the Gram-form norm ‖S·A‖)",
        PER_UPDATE,
    ),
    Metric(
        "loggra/step_size",
        "the rate of the backward sketch's update, ρ·‖W‖/‖D·A‖ over all targets rounded to "
        "bf16, before predicted-KL control's η (with --loggra-update-ratio)",
        PER_UPDATE,
    ),
    Metric(
        "memory/peak_bytes",
        "this RL step's peak memory: the max of its `memory/peak_bytes/<phase>` (CUDA: max "
        "allocated; CPU: peak RSS); until this version rank 0's peak since the start of the "
        "run (docs/metrics.md#memory)",
        PEAK_OVER_RANKS,
    ),
    Metric(
        "memory/peak_bytes/rollout",
        "peak memory of the step's rollout: generation (its KV cache; the dynamic engine's "
        "old log-prob recompute too) and rewards",
        PEAK_OVER_RANKS,
    ),
    Metric(
        "memory/peak_bytes/log_probs",
        "peak memory of the step's reference log-prob forwards (with --kl-coef > 0)",
        PEAK_OVER_RANKS,
    ),
    Metric(
        "memory/peak_bytes/train",
        "peak memory of the actor's mini-batches: forward/backward and the optimizer step "
        "(without predicted-KL control's part)",
        PEAK_OVER_RANKS,
    ),
    Metric(
        "memory/peak_bytes/kl_control",
        "peak memory of the optimizer steps under predicted-KL control (--kl-target): "
        "gradient preparation, probe trials, commit",
        PEAK_OVER_RANKS,
    ),
    Metric(
        "memory/reserved_bytes",
        "CUDA only: the caching allocator's peak reserved bytes over the step's phases "
        "(allocated + cached free blocks)",
        PEAK_OVER_RANKS,
    ),
    Metric(
        "memory/free_bytes",
        "CUDA only: free device memory at the end of the step (`torch.cuda.mem_get_info`: "
        "what PyTorch's reserved blocks, NCCL, the CUDA context and other processes leave)",
        LEAST_OVER_RANKS,
    ),
    Metric(
        "memory/kl_control_bytes",
        "extra memory of predicted-KL control (stored reference + candidate peak)",
        PER_UPDATE,
    ),
    Metric("time/step_s", "wall time of the whole step (rollout + train + control), seconds"),
    Metric(
        "loggra/captured_energy/qkv/mean",
        "share of the attention QKV weights' gradient energy the LoGRA sketch keeps, ‖G·Q‖²/‖G‖² of "
        "the whole matrix (all TP/DP shards), mean over layers of each layer's mean over the "
        "step's committed updates (identity projection: 1)",
    ),
    Metric(
        "loggra/captured_energy/qkv/min",
        "as `loggra/captured_energy/qkv/mean`, the lowest layer's",
    ),
    Metric(
        "loggra/captured_energy/proj/mean",
        "share of the attention output projection weights' gradient energy the LoGRA sketch keeps, ‖G·Q‖²/‖G‖² of "
        "the whole matrix (all TP/DP shards), mean over layers of each layer's mean over the "
        "step's committed updates (identity projection: 1)",
    ),
    Metric(
        "loggra/captured_energy/proj/min",
        "as `loggra/captured_energy/proj/mean`, the lowest layer's",
    ),
    Metric(
        "loggra/captured_energy/fc1/mean",
        "share of the MLP FC1 weights' gradient energy the LoGRA sketch keeps, ‖G·Q‖²/‖G‖² of "
        "the whole matrix (all TP/DP shards), mean over layers of each layer's mean over the "
        "step's committed updates (identity projection: 1)",
    ),
    Metric(
        "loggra/captured_energy/fc1/min",
        "as `loggra/captured_energy/fc1/mean`, the lowest layer's",
    ),
    Metric(
        "loggra/captured_energy/fc2/mean",
        "share of the MLP FC2 weights' gradient energy the LoGRA sketch keeps, ‖G·Q‖²/‖G‖² of "
        "the whole matrix (all TP/DP shards), mean over layers of each layer's mean over the "
        "step's committed updates (identity projection: 1)",
    ),
    Metric(
        "loggra/captured_energy/fc2/min",
        "as `loggra/captured_energy/fc2/mean`, the lowest layer's",
    ),
    Metric(
        "memory/kv_cache_bytes",
        "rollout KV cache of this rank, measured on the engine's buffers: the static decoder's "
        "cache (sized to the largest chunk under `--inference-max-tokens`), or the dynamic "
        "engine's paged buffer (its dummy block included)",
        PER_RANK,
    ),
    Metric(
        "time/experience_s",
        "wall time of the experience: rollout generation, rewards and reference log-probs, seconds",
    ),
    Metric(
        "time/training_idle_s",
        "with --generation-ranks (docs/placement.md): the trainer's wait for the rollouts, s",
        PER_RANK,
    ),
    Metric("time/generation_idle_s", "the generation ranks' wait between rollouts, s", PER_RANK),
    Metric(
        "time/generation_hidden_fraction",
        "the share of the generation time the trainer did not wait for (0: lock-step)",
        PER_RANK,
    ),
    Metric(
        "rollout/policy_lag",
        "RL steps between the weights that generated this step's rollouts (one version for "
        "all: their mean and max) and the step that trains on them (<= --max-policy-lag)",
        PEAK_OVER_RANKS,
    ),
    Metric("sync/bytes", "bytes of the weight sync before this rollout", PEAK_OVER_RANKS),
    Metric("sync/seconds", "wall time of that weight sync, seconds", PEAK_OVER_RANKS),
    Metric(
        "sync/checksum_ok",
        "1: the generation ranks' weights, read back at the last checked sync (every "
        "--weight-sync-check-interval), equal the trainer's (a mismatch ends the run)",
        LEAST_OVER_RANKS,
    ),
    Metric(
        "time/rollout_s",
        "wall time of rollout generation (sampling) alone, seconds (until this version it "
        "also held the rewards and reference log-probs, now `time/experience_s`)",
        PER_RANK,
    ),
    Metric(
        "rollout/host_syncs_per_token",
        "reads of device values on the host per decode step of the static engine's rollout "
        '(counted; the prompt lengths are known on the host and "every row done" is read '
        "once every 16 steps; not logged by the dynamic engine)",
        PER_RANK,
    ),
    Metric(
        "rollout/prefill_tokens",
        "prompt tokens the static engine's prefill ran, once per distinct prompt (a GRPO "
        "group's rows share their prompt's), summed over chunks; not logged by the dynamic "
        "engine",
        SUMMED_OVER_RANKS,
    ),
    Metric(
        "rollout/prompt_tokens",
        "prompt tokens of the rollout's rows (the sum over rows), beside "
        "`rollout/prefill_tokens`; logged with it",
        SUMMED_OVER_RANKS,
    ),
    Metric(
        "rollout/evicted_requests",
        "requests the dynamic engine evicted from its KV cache and prefilled again (0: the "
        "requests in flight are as many as the KV blocks hold at full length); not logged by "
        "the static engine, which never evicts",
        SUMMED_OVER_RANKS,
    ),
    Metric(
        "throughput/rollout_tokens_per_s",
        "generated tokens per second of generation, of all DP ranks (they generate side by side)",
        SUMMED_OVER_RANKS,
    ),
    Metric("time/train_s", "wall time of forward/backward and the optimizer step, seconds"),
    Metric(
        "time/kl_control_s",
        "wall time of predicted-KL control (reference, trials, realized check; not the "
        "gradient preparation, projection and commit that a plain step also does), seconds",
        TOTAL_PER_UPDATE,
    ),
    Metric(
        "throughput/tokens_per_s",
        "prompt + response tokens of the batch (all ranks) per second of step time",
    ),
    Metric(
        "throughput/padded_token_fraction",
        "share of the token slots fed to the training forwards (PPO epochs × mini-batches × "
        "micro-batches) that are padding: past a row's last response target, or the "
        "schedule's rounding to the sequence multiple (--length-grouping cuts it; with "
        "--sequence-packing only the rounding is left)",
        PER_RANK,
    ),
    Metric(
        "throughput/padded_token_fraction/reference",
        "the same share for the reference model's log-prob forwards (with --kl-coef > 0)",
        PER_RANK,
    ),
    Metric(
        "lr",
        "learning rate the step's optimizer updates used (before the η scaling, and before "
        "the schedule advanced for the next step)",
        PER_UPDATE,
    ),
    Metric("response/length_mean", "mean response length in tokens", PER_RANK),
    Metric(
        "data/dropped_prompts",
        "prompts removed from the dataset at start-up because they leave no room for "
        "--max-new-tokens within --seq-length",
    ),
    Metric(
        "eval/reward",
        "mean reward of greedy completions of the held-out prompts (--eval-data-path; every "
        "--eval-interval steps)",
    ),
    Metric(
        "eval/accuracy", "share of the held-out prompts answered correctly (the task's verdict)"
    ),
    Metric("time/eval_s", "wall time of the held-out evaluation, seconds"),
)


def declared(key: str, stage: str) -> str:
    """How ``key`` combines at ``stage`` (a ``Reduction`` field); raises ``KeyError``
    for a key that is not declared, or not declared to pass through ``stage``."""
    metric = METRICS.get(key)
    how = getattr(metric.reduction, stage) if metric is not None else None
    if how is None:
        raise KeyError(
            f"metric {key!r} is not declared with a reduction over {stage.replace('_', '-')} "
            "(declare it in loggra_megatron/metric_keys.py)"
        )
    return how


def combine_micro_batches(outs: Iterable[dict]) -> dict[str, float]:
    """The metrics of a mini-batch's micro-batches (the loss terms', on the last pipeline
    stage; none elsewhere) as one value per key."""
    values: dict[str, list[float]] = {}
    for out in outs:
        for key, value in out.items():
            values.setdefault(key, []).append(float(value))
    return {
        key: sum(v) if declared(key, "micro_batches") == SUM else sum(v) / len(v)
        for key, v in values.items()
    }


def add_update(sums: dict[str, float], metrics: dict[str, float]) -> None:
    """Add one optimizer update's ``metrics`` to ``sums`` (a ``first`` key keeps the value of
    the first update that reported it)."""
    for key, value in metrics.items():
        if declared(key, "updates") == FIRST:
            sums.setdefault(key, value)
        else:
            sums[key] = sums.get(key, 0.0) + value


def combine_updates(sums: dict[str, float], num_updates: int) -> dict[str, float]:
    """The RL step's value of each key from ``sums`` (``add_update``) over its
    ``num_updates`` updates (``mean``: the sum divided by ``num_updates``; an update that did
    not report the key, e.g. a skipped one, counts as 0)."""
    return {
        key: total if declared(key, "updates") in (SUM, FIRST) else total / num_updates
        for key, total in sums.items()
    }


def markdown_table() -> str:
    """The key table of ``docs/metrics.md``."""
    lines = ["| key | meaning | reduction |", "|---|---|---|"]
    lines += [f"| `{m.key}` | {m.doc} | {m.reduction.describe()} |" for m in METRICS.values()]
    return "\n".join(lines) + "\n"


TABLE_START = "<!-- generated from loggra_megatron/metric_keys.py -->\n"
TABLE_END = "<!-- end of the generated table -->\n"


def with_table(text: str) -> str:
    """``text`` (``docs/metrics.md``) with the part between the markers regenerated."""
    head, rest = text.split(TABLE_START, 1)
    return head + TABLE_START + markdown_table() + TABLE_END + rest.split(TABLE_END, 1)[1]


if __name__ == "__main__":  # python -m loggra_megatron.metric_keys docs/metrics.md
    path = sys.argv[1]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(with_table(text))

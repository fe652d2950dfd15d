# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""What fits a node (``tools/estimate_memory.py --fit``): the settings a ``pretrain_rl.py`` run
could choose on its GPUs (``candidates``: TP within a node, PP, sequence parallelism,
recompute, micro-batch size, bf16 grads, LoGRA's remainders), each modelled with dense Adam
and with LoGRA, with the largest KV budget (``--inference-max-tokens``) that still fits
(``search``). A setting the command line gives is fixed, not searched. With
``--generation-ranks N`` the layouts are searched on the other GPUs, which hold no KV
cache; a configuration fits when a training GPU and a generation GPU both do, and its KV
budget is a generation GPU's.

Which settings ``pretrain_rl.py`` accepts is not decided here: the caller parses and
validates each candidate's command line exactly as the estimator parses its own, and passes
the modelled step (or the refusal) back (``evaluate``). The table: ``.fit_report``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.memory.model import (
    estimate_generation_memory,
    estimate_rl_step_memory,
    max_rollout_batch_size,
    rollout_gpu_memory,
)
from loggra_megatron.memory.shape import GiB, TransformerShape
from loggra_megatron.train.run_config import RunConfig
from loggra_megatron.train.step_plan import StepPlan

MICRO_BATCH_SIZES = (1, 2, 4)
"""The micro-batch sizes searched (without ``--micro-batch-size``)."""
FULL_RECOMPUTE = (
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
)
"""Full recompute as the search sets it (every layer a checkpoint; selective recompute is
no recompute in this model: flash attention stores nothing quadratic)."""
RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers")
OPTIMIZER_NAMES = {"loggra": "LoGRA", "adam": "dense Adam"}

Modelled = tuple[TransformerShape, StepPlan]
Evaluate = Callable[[list[str]], "Modelled | str"]


@dataclass(frozen=True)
class Candidate:
    """One point of the search: its settings and the flags it adds to the command line."""

    tp: int
    pp: int
    sequence_parallel: bool
    recompute: str
    """``none``, ``full`` or the command line's own (``given``)."""
    micro_batch_size: int
    bf16_grads: bool
    remainders: bool
    flags: tuple[str, ...]
    """What it adds to the command line, for either optimizer."""
    loggra_flags: tuple[str, ...]
    """What it adds for LoGRA (``--optimizer loggra``, ``--loggra-param-remainders``)."""


@dataclass(frozen=True)
class Outcome:
    """A candidate with one optimizer, at the KV budget chosen for it."""

    candidate: Candidate
    optimizer: str
    data_parallel_size: int
    total_bytes: int
    fits: bool
    peak_phase: str
    rows: int | None
    """Rollout rows of ``--seq-length`` tokens at once that fit (the estimator's ``max
    rollout rows at once``; None: not even the step without rollout)."""
    kv_rows: int
    """Rows at once of the launch (the KV budget over the sequence length, at most the
    rollout batch per replica)."""
    flags: tuple[str, ...]
    """The flags to add to the command line to run it (``--inference-max-tokens`` too)."""
    rollout_replicas: int = 1
    """Replicas that generate: the data-parallel ones, or the generation ranks' replicas."""
    generation_bytes: int | None = None
    """A generation GPU's total (``--generation-ranks``; None: the training GPUs generate)."""

    def rank_key(self) -> tuple:
        """Best first: most rollout rows at once over the job, then no PP, no recompute,
        larger micro-batch, fp32 grads, fp32 masters, smaller TP."""
        c = self.candidate
        job_rows = (self.rows or 0) * self.rollout_replicas
        return (
            -job_rows,
            c.pp,
            c.recompute == "full",
            -c.micro_batch_size,
            c.bf16_grads,
            c.remainders,
            c.tp,
        )


@dataclass
class FitResult:
    """All outcomes per optimizer, the refusals, and the searched values per setting."""

    outcomes: dict[str, list[Outcome]]
    refused: list[tuple[Candidate, str]]
    space: dict[str, list]
    world: int
    kv_given: bool
    gpu_bytes: int
    """The GPU's memory (--gpu-memory-gb)."""
    budget_bytes: int
    """What a configuration may use: the GPU's memory less --fit-headroom-gb."""
    loggra_sketch: str = "gradient"
    """LoGRA's ``--loggra-sketch`` (the command line's; not searched)."""
    generation_ranks: int = 0
    """The command line's ``--generation-ranks`` (of ``world``; not searched)."""

    def fitting(self, optimizer: str) -> list[Outcome]:
        return sorted((o for o in self.outcomes[optimizer] if o.fits), key=Outcome.rank_key)

    def best(self, optimizer: str) -> list[Outcome]:
        """``fitting``, only the best of each TP × PP layout and recompute."""
        seen, out = set(), []
        for o in self.fitting(optimizer):
            c = o.candidate
            if (c.tp, c.pp, c.recompute) not in seen:
                seen.add((c.tp, c.pp, c.recompute))
                out.append(o)
        return out

    def closest(self, optimizer: str) -> Outcome | None:
        return min(self.outcomes[optimizer], key=lambda o: o.total_bytes, default=None)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_space(
    cfg: RunConfig, given: set[str], world: int, gpus_per_node: int
) -> dict[str, list]:
    """The values searched per setting (``tp``: TP sizes within a node that divide the
    world, less the generation ranks; PP: every divisor of that / TP, ``candidates``). A
    setting in ``given`` (the command line's) keeps ``cfg``'s value; 16-bit options need
    ``--bf16``."""
    m, p, opt = cfg.model, cfg.parallel, cfg.optimizer
    bf16 = [False, True] if m.bf16 else [False]
    training = world - cfg.placement.generation_ranks
    space = {
        "tp": [d for d in _divisors(gpus_per_node) if training % d == 0],
        "recompute": ["none", "full"],
        "micro_batch_size": list(MICRO_BATCH_SIZES),
        "bf16_grads": bf16,
        "remainders": bf16,
    }
    fixed = {
        "tp": ("tensor_model_parallel_size", p.tensor_model_parallel_size),
        "micro_batch_size": ("micro_batch_size", cfg.training.micro_batch_size),
        "bf16_grads": ("grad_reduce_in_bf16", opt.grad_reduce_in_bf16),
        "remainders": ("loggra_param_remainders", cfg.loggra.loggra_param_remainders),
    }
    for key, (name, value) in fixed.items():
        if name in given:
            space[key] = [value]
    if given & set(RECOMPUTE_FIELDS):
        space["recompute"] = ["given"]
    return space


def candidates(
    cfg: RunConfig, given: set[str], world: int, space: dict[str, list]
) -> list[Candidate]:
    """Every combination of ``space`` (PP: the divisors of the training GPUs / TP, or the
    command line's ``--pipeline-model-parallel-size``; sequence parallelism with TP > 1
    unless given)."""
    out = []
    rest = [space[k] for k in ("recompute", "micro_batch_size", "bf16_grads", "remainders")]
    for tp in space["tp"]:
        pps = _divisors((world - cfg.placement.generation_ranks) // tp)
        if "pipeline_model_parallel_size" in given:
            pps = [cfg.parallel.pipeline_model_parallel_size]
        sp = cfg.model.sequence_parallel if "sequence_parallel" in given else tp > 1
        for pp, rec, mbs, grads, rem in itertools.product(pps, *rest):
            c = Candidate(tp, pp, sp, rec, mbs, grads, rem, (), ())
            out.append(_with_flags(c, cfg, given))
    return out


def _with_flags(c: Candidate, cfg: RunConfig, given: set[str]) -> Candidate:
    """``c`` with the flags that set what the command line does not."""
    flags: list[str] = []
    if "tensor_model_parallel_size" not in given:
        flags += ["--tensor-model-parallel-size", str(c.tp)]
    if "pipeline_model_parallel_size" not in given:
        flags += ["--pipeline-model-parallel-size", str(c.pp)]
    if c.sequence_parallel and "sequence_parallel" not in given:
        flags.append("--sequence-parallel")
    if c.recompute == "full":
        flags += FULL_RECOMPUTE
    if "micro_batch_size" not in given:
        flags += ["--micro-batch-size", str(c.micro_batch_size)]
    if c.bf16_grads and "grad_reduce_in_bf16" not in given:
        flags.append("--grad-reduce-in-bf16")
    loggra = [] if cfg.optimizer.optimizer == "loggra" else ["--optimizer", "loggra"]
    if c.remainders and "loggra_param_remainders" not in given:
        loggra.append("--loggra-param-remainders")
    return dataclasses.replace(c, flags=tuple(flags), loggra_flags=tuple(loggra))


def search(cfg: RunConfig, given: set[str], est: EstimateConfig, evaluate: Evaluate) -> FitResult:
    """Each candidate's command line evaluated once (``evaluate(flags)``: the modelled step
    with LoGRA, or why ``pretrain_rl.py`` refuses it); dense Adam is the same step with
    ``optimizer="adam"`` (as the estimator's dense column), for the candidates without
    LoGRA's remainders (or with the command line's)."""
    world = est.world(1, 1)
    space = search_space(cfg, given, world, est.gpus_per_node)
    gpu_bytes = int(est.gpu_memory_gb * GiB)
    budget = int((est.gpu_memory_gb - est.fit_headroom_gb) * GiB)
    kv_given = "inference_max_tokens" in given
    result = FitResult({"loggra": [], "adam": []}, [], space, world, kv_given, gpu_bytes, budget)
    result.loggra_sketch = cfg.loggra.loggra_sketch
    result.generation_ranks = cfg.placement.generation_ranks
    for c in candidates(cfg, given, world, space):
        got = evaluate([*c.flags, *c.loggra_flags])
        if isinstance(got, str):
            result.refused.append((c, got))
            continue
        model, plan = got
        runs = {"loggra": (plan, c.flags + c.loggra_flags)}
        if not c.remainders or "loggra_param_remainders" in given:
            runs["adam"] = (dataclasses.replace(plan, optimizer="adam"), c.flags)
        for name, (p, flags) in runs.items():
            result.outcomes[name].append(assess(c, model, p, est, budget, kv_given, flags))
    return result


def assess(
    c: Candidate,
    model: TransformerShape,
    plan: StepPlan,
    est: EstimateConfig,
    budget_bytes: int,
    kv_given: bool,
    flags: tuple[str, ...],
) -> Outcome:
    """``c`` with ``plan``'s optimizer at the largest KV budget within ``budget_bytes`` (the
    command line's if given): whole rows of ``--seq-length`` tokens, at most the rollout
    batch per replica that generates (then no bound is needed), at least one row (to say by
    how much it is over). With generation ranks both kinds of GPU must fit."""
    rows = max_rollout_batch_size(model, plan, est, budget_bytes)
    if plan.generation_ranks and not estimate_rl_step_memory(model, plan, est).fits(budget_bytes):
        rows = None  # the training GPUs do not fit (they hold no rollout)
    kv_rows, chosen = plan.generating_rows, plan
    if kv_given and plan.inference_max_tokens is not None:
        kv_rows = min(kv_rows, max(1, plan.inference_max_tokens // plan.seq_length))
    elif not kv_given:
        kv_rows = _kv_rows(model, plan, est, budget_bytes, rows)
        chosen = _at_kv_rows(plan, kv_rows)
        if chosen.inference_max_tokens is not None:
            flags = (*flags, "--inference-max-tokens", str(chosen.inference_max_tokens))
    b = estimate_rl_step_memory(model, chosen, est)
    gen = estimate_generation_memory(model, chosen, est) if plan.generation_ranks else None
    split = plan.generation_plan() if gen is not None else plan
    return Outcome(
        c,
        plan.optimizer,
        plan.data_parallel_size,
        b.total_bytes,
        b.fits(budget_bytes) and (gen is None or gen.fits(budget_bytes)),
        b.peak_phase,
        rows,
        kv_rows,
        flags,
        split.data_parallel_size,
        None if gen is None else gen.total_bytes,
    )


def _at_kv_rows(plan: StepPlan, rows: int) -> StepPlan:
    """``plan`` with a KV budget of ``rows`` full-length rows (none: the whole batch)."""
    whole = rows >= plan.generating_rows
    return dataclasses.replace(plan, inference_max_tokens=None if whole else rows * plan.seq_length)


def _kv_rows(model, plan, est, budget_bytes: int, rows: int | None) -> int:
    """The most rows (≤ the rollout batch per replica, ≥ 1) whose KV budget fits with the
    run's own rollout batch and engine (its prefill and logits too) on the GPUs that
    generate, bisected from ``rows``, the capacity at a rollout batch of that many; 1 if
    none fits."""

    def fits(r: int) -> bool:
        p = _at_kv_rows(plan, r)
        return rollout_gpu_memory(model, p, est).fits(budget_bytes)

    hi = max(1, min(rows or 1, plan.generating_rows))
    if fits(hi):
        return hi
    if hi == 1 or not fits(1):
        return 1
    lo = 1  # fits(lo) and not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo

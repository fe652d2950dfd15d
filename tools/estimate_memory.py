# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Per-GPU memory of one RL step with dense Adam and with LoGRA, side by side.

The command line is ``pretrain_rl.py``'s (every flag, same defaults and checks; flags that
change no memory, e.g. ``--tokenizer-model`` or ``--lr``, are read and ignored) plus the
"estimate" group: the architecture (``--hf-config``, or the model flags and
``--vocab-size``), ``--world-size``, ``--gpu-memory-gb``, the launch environment
(``--expandable-segments``, ``--no-nccl-nvls``), dense Adam's moment dtypes, and ``--fit``
(with ``--num-nodes``: the configurations that fit, each with the flags that launch it,
``memory.fit``)::

    python tools/estimate_memory.py --hf-config tools/configs/llama-style-27b.json \
        --world-size 8 --gpu-memory-gb 79.1 --expandable-segments --no-nccl-nvls \
        --tensor-model-parallel-size 8 --sequence-parallel --bf16 --seq-length 16384 \
        --max-new-tokens 15360 --prompts-per-step 8 --num-generations 8 --kl-coef 0.001 ...

The run modelled is the one ``pretrain_rl.py`` would start on GPUs with these flags
(``loggra_megatron.memory.run_step.modelled_step``); what it would refuse on such a GPU
exits with status 2 naming the flag. LoGRA's column is the run's sketch: ``--loggra-sketch
backward`` (LoGRA as published: no grad buffer for the ``--loggra-targets``, masters and
``--loggra-row-optimizer`` state of a rank's own rows, the fp32 sketch buffer S;
``memory.backward_sketch``, the default) or the gradient sketch, with
``--fit`` too. Sizes are GiB (2^30 B); ``--gpu-memory-gb 79.1`` is what
PyTorch can allocate of an 80 GB A100/H100. The model and every assumption: docs/memory.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from loggra_megatron.arguments import (
    build_parser as run_parser,
)
from loggra_megatron.arguments import (
    fill_derived_defaults,
    read_sections,
    validate_settings,
)
from loggra_megatron.config import ConfigError, flag, settings_that_do_not_apply
from loggra_megatron.memory.backward_sketch import applies as backward_sketch
from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.memory.fit import search
from loggra_megatron.memory.fit_report import fit_json, fit_report
from loggra_megatron.memory.model import (
    GiB,
    MemoryConfigError,
    estimate_generation_memory,
    estimate_rl_step_memory,
    max_rollout_batch_size,
    weight_sync_bytes,
)
from loggra_megatron.memory.report import generation_report, report
from loggra_megatron.memory.run_step import adopt_architecture, modelled_step
from loggra_megatron.train.run_config import SECTIONS, RunConfig

ESTIMATE = {**SECTIONS, "estimate": EstimateConfig}
"""``pretrain_rl.py``'s settings sections and the estimator's own: one flag per field."""


def build_parser() -> argparse.ArgumentParser:
    return run_parser(
        ESTIMATE,
        prog="estimate_memory.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def parse(
    argv: list[str] | None = None,
) -> tuple[argparse.ArgumentParser, RunConfig, EstimateConfig]:
    """The run's settings as ``pretrain_rl.py`` reads them (no file is read but
    ``--hf-config``) and the estimator's; exits with status 2 naming the flag."""
    parser = build_parser()
    try:
        cfg, est, _ = settings(parser, argv)
    except ConfigError as e:
        parser.error(str(e))
    return parser, cfg, est


def settings(
    parser: argparse.ArgumentParser, argv: list[str] | None, validate: bool = True
) -> tuple[RunConfig, EstimateConfig, set[str]]:
    """``parse`` with ``parser``, raising ``ConfigError`` for a setting
    ``pretrain_rl.py`` refuses (a section's own checks call ``parser.error``); also the
    fields given. ``validate``: also the rules across sections (``--fit`` reads its base
    command without them: the layout it would check is not chosen yet)."""
    sections, given = read_sections(parser, argv, ESTIMATE, host_files=False)
    est = sections.pop("estimate")
    p = sections["parallel"]
    generation = sections["placement"].generation_ranks
    world = est.world(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, generation)
    cfg = RunConfig(**sections, world_size=world)
    settings = {**cfg.flags(), **vars(est)}
    for problem in settings_that_do_not_apply(ESTIMATE.values(), settings, given):
        raise ConfigError(problem)
    adopt_architecture(cfg.model, est, given)
    fill_derived_defaults(cfg)
    problem = validate_settings(cfg) if validate else None
    if problem:
        raise ConfigError(problem)
    return cfg, est, given


def _raise(message: str):
    raise ConfigError(message)


def fit(argv: list[str], cfg: RunConfig, est: EstimateConfig, given: set[str]) -> int:
    """``--fit``: every candidate's command line (``argv`` and the flags it adds) read and
    checked as ``parse`` reads the estimator's own, then modelled; the refusals are
    results, not errors. ``cfg``, ``est``, ``given``: ``argv`` read (not validated)."""
    quiet = build_parser()
    quiet.error = _raise  # a candidate pretrain_rl.py refuses: its message, no exit

    def evaluate(flags: list[str]):
        try:
            c, e, _ = settings(quiet, [*argv, *flags])
            return modelled_step(c, e)
        except ConfigError as err:
            return str(err)
        except MemoryConfigError as err:
            return f"{flag(err.field)}: {err.message}"

    result = search(cfg, given, est, evaluate)
    if est.json:
        print(json.dumps(fit_json(result, est), indent=2))
    else:
        print(fit_report(result, est.hf_config or "flags", est, cfg.model.seq_length))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        cfg, est, given = settings(parser, argv, validate=False)
        problem = None if est.fit else validate_settings(cfg)
    except ConfigError as e:
        parser.error(str(e))
    if problem:
        parser.error(problem)
    if est.fit:  # the layout is what it searches: checked per candidate
        return fit(argv, cfg, est, given)
    try:
        model, plan = modelled_step(cfg, est)
        names = dict.fromkeys(("adam", "loggra", plan.optimizer))  # and the run's own
        plans = {opt: dataclasses.replace(plan, optimizer=opt) for opt in names}
        results = {opt: estimate_rl_step_memory(model, p, est) for opt, p in plans.items()}
    except ConfigError as e:
        parser.error(str(e))
    except MemoryConfigError as e:
        parser.error(f"{'--hf-config' if est.hf_config else flag(e.field)}: {e.message}")
    gpu_bytes = int(est.gpu_memory_gb * GiB)
    if est.json:
        out = {
            opt: {
                **{k: v / GiB for k, v in b.terms().items()},
                "total": b.total_bytes / GiB,
                "peak_phase": b.peak_phase,
                "phases": {k: v / GiB for k, v in b.phases().items()},
                "fits": b.fits(gpu_bytes),
                "stage": b.stage,
            }
            for opt, b in results.items()
        }
        if plan.generation_ranks:
            gen = estimate_generation_memory(model, plan, est)
            out["generation"] = {
                **{k: v / GiB for k, v in gen.terms().items()},
                "total": gen.total_bytes / GiB,
                "fits": gen.fits(gpu_bytes),
                "max_rollout_rows": max_rollout_batch_size(model, plan, est, gpu_bytes),
            }
        print(json.dumps({"unit": "GiB", **out}, indent=2))
        return 0
    source = est.hf_config or "flags"
    print(report(model, plans, results, est, source, plan.optimizer))
    if plan.generation_ranks:
        sync = weight_sync_bytes(model, plan, plan.loggra_rank) if backward_sketch(plan) else None
        gen = estimate_generation_memory(model, plan, est)
        rows = max_rollout_batch_size(model, plan, est, gpu_bytes)
        print(generation_report(plan, gen, rows, sync))
    if cfg.model.sequence_packing:
        print(PACKING_NOTE)
    return 0


PACKING_NOTE = (
    "note: --sequence-packing changes no term above: a packed micro-batch holds at most "
    "--micro-batch-size x --seq-length tokens, the padded bound every phase is estimated at; "
    "packing lowers the average memory and time of a step, not its peak"
)


if __name__ == "__main__":
    sys.exit(main())

"""The command line of ``pretrain_rl.py``: Megatron-LM-style flags generated from the
settings dataclass each component owns (the sections of
``RunConfig``).

Each section checks its own fields; a field that applies only under a condition on other
settings declares it, and one given while its condition fails is refused
(``settings_that_do_not_apply``); ``validate`` keeps only
the rules that span sections. ``--config FILE.yaml`` supplies defaults whose keys are the flag names, and flags
given on the command line override them. Everything runs before any process group, file or
device is touched: an invalid setting exits with status 2 and a message naming the flag.

The memory estimator (``tools/estimate_memory.py``) reads the same command line
(``build_parser`` and ``read_sections`` with its own section added) and the same
cross-section rules, less the ones about this machine (``validate_settings``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os

import torch

from loggra_megatron.checkpointing.resume import adopt_saved_settings, check_resume, plan_start
from loggra_megatron.config import (
    ConfigError,
    add_flags,
    read_config_file,
    settings_that_do_not_apply,
)
from loggra_megatron.optim.registry import OPTIMIZERS, backward_sketch
from loggra_megatron.rl.advantages import ADVANTAGE_ESTIMATORS
from loggra_megatron.rollout.protocol import EngineTarget
from loggra_megatron.rollout.registry import (
    AUTO,
    ROLLOUT_ENGINES,
    is_fallback,
    passed_over,
    select_engine,
)
from loggra_megatron.train.run_config import SECTIONS, RunConfig


def build_parser(sections: dict[str, type] = SECTIONS, **kwargs) -> argparse.ArgumentParser:
    """``--config`` and one flag per field of ``sections`` (``kwargs``: of the
    ``ArgumentParser``, e.g. the memory estimator's program name)."""
    kwargs = {
        "prog": "pretrain_rl.py",
        "description": "GRPO/PPO training of a Megatron-Core policy with LoGRA and "
        "predicted-KL step control. Run with torchrun.",
        # no prefix matching: a script's --save-int must not bind to a flag added later
        "allow_abbrev": False,
        **kwargs,
    }
    parser = argparse.ArgumentParser(**kwargs)
    parser.add_argument("--config", default=None, help="YAML file of flag defaults")
    for old, new in RENAMED_FLAGS.items():  # say where a renamed flag went
        parser.add_argument(old, action=_Renamed, nargs="?", help=argparse.SUPPRESS, new=new)
    add_flags(parser, sections)
    return parser


RENAMED_FLAGS = {"--kl-coef-target": "--kl-ref-target"}
"""Flags that were renamed: given, they exit 2 naming the new name."""


class _Renamed(argparse.Action):
    def __init__(self, *args, new: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed {self.new}")


def read_sections(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    sections: dict[str, type] = SECTIONS,
    host_files: bool = True,
) -> tuple[dict, set[str]]:
    """``({section: settings}, the fields given)``: each section built from its flags, else
    the ``--config`` file's values, else its defaults, and checked by itself (exit 2 naming
    the flag). ``host_files``: also check the files the settings name exist on this host
    (a section's ``check_files``: the tokenizer and prompt files); the memory estimator,
    which reads none of them, does not."""
    ns = parser.parse_args(argv)
    defaults = read_config_file(ns.config, parser, sections, RENAMED_FLAGS) if ns.config else {}
    explicit = set(defaults) | {k for k, v in vars(ns).items() if v is not None}
    built = {}
    for section, cls in sections.items():
        kwargs = {}
        for f in dataclasses.fields(cls):
            value = getattr(ns, f.name)
            kwargs[f.name] = defaults.get(f.name, f.default) if value is None else value
        try:
            built[section] = cls(**kwargs)
            if host_files and hasattr(built[section], "check_files"):
                built[section].check_files()
        except (TypeError, ValueError) as e:
            parser.error(str(e))
    return built, explicit


def fill_derived_defaults(cfg: RunConfig) -> None:
    """The defaults that follow from other settings, once the architecture is known:
    ``--loggra-rank`` (hidden / 8) and ``--loggra-seed`` (``--seed``)."""
    cfg.loggra.loggra_rank = cfg.loggra.rank_for(cfg.model.hidden_size)
    if cfg.loggra.loggra_seed is None:
        cfg.loggra.loggra_seed = cfg.training.seed


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> RunConfig:
    """Parse and validate; exits with status 2 and a message naming the flag on bad input.

    As Megatron-LM's ``--use-checkpoint-args``, the architecture of the model in ``--load``
    is adopted for the model flags that were not given (``plan_start``); the decision
    how the run starts is kept in ``cfg.start``."""
    parser = build_parser()
    sections, explicit = read_sections(parser, argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = RunConfig(**sections, world_size=world_size)
    adopted = _adopt_saved_settings(cfg, sections, explicit)
    for problem in settings_that_do_not_apply(SECTIONS.values(), cfg.flags(), explicit):
        parser.error(problem)
    try:
        cfg.start = plan_start(cfg.checkpoint, cfg.logging, cfg.model, explicit)
        cfg.start.notes += adopted
        fill_derived_defaults(cfg)
        check_resume(cfg.flags(), cfg.start)
    except ConfigError as e:
        parser.error(str(e))
    problem = validate(cfg)
    if problem:
        parser.error(problem)
    group_relative = ADVANTAGE_ESTIMATORS[cfg.grpo.advantage_estimator].min_generations > 1
    if cfg.rollout.temperature == 0 and group_relative:  # a group's completions alike: A = 0
        cfg.start.notes.append(
            f"warning: --temperature 0 samples the {cfg.grpo.num_generations} completions of "
            "a prompt greedily, so they are identical, every GRPO advantage is 0 and the "
            "policy gradient vanishes; use --temperature > 0 for training"
        )
    return cfg


def _adopt_saved_settings(cfg: RunConfig, sections: dict, explicit: set[str]) -> list[str]:
    """A resume's settings that follow its checkpoint unless given (``ADOPTED_ON_RESUME``),
    taken before the settings are checked; the notes saying so. A ``--load`` that cannot be
    planned is refused later, in its turn (``plan_start``)."""
    if cfg.checkpoint.load is None:
        return []
    try:
        plan = plan_start(cfg.checkpoint, cfg.logging, cfg.model, explicit)
        return adopt_saved_settings(sections, plan, explicit)
    except ConfigError:
        return []


def validate(cfg: RunConfig) -> str | None:
    """The first cross-section inconsistency of ``cfg`` as ``--flag: message``, or None (each
    section checked its own fields when it was built), on this machine: the rules of
    ``validate_settings``, and those about this process's machine (a CUDA device
    visible, Transformer Engine installed, the GPU's compute capability, the rollout
    engine's kernels)."""
    return next(_cross_section_problems(cfg, here=True), None)


def validate_settings(cfg: RunConfig) -> str | None:
    """``validate`` by the settings alone, for a GPU that has what they ask for (CUDA
    unless ``--device cpu``, Transformer Engine, the engines' kernels; the compute capability
    unknown): what ``pretrain_rl.py`` would refuse on any such machine. The memory estimator
    runs these."""
    return next(_cross_section_problems(cfg, here=False), None)


def _cross_section_problems(cfg: RunConfig, here: bool):
    """Yields ``--flag: message`` lazily, in order, so a check may rely on the ones before.
    ``here``: also the rules about this machine (``_this_machine_problems``, the compute
    capability, the engine's kernels)."""
    m, p, lg, opt = cfg.model, cfg.parallel, cfg.loggra, cfg.optimizer
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    placement = next(_placement_problems(cfg, tp), None)
    if placement:
        yield placement
        return
    if cfg.training_world_size % (tp * pp):
        yield (
            f"--tensor-model-parallel-size: TP×PP = {tp * pp} must divide the "
            f"{cfg.training_world_size} training ranks (torchrun --nproc-per-node"
            + (" less --generation-ranks)" if cfg.placement.disaggregated else ")")
        )
        return
    yield from _model_split_problems(cfg, tp, pp)
    no_cuda = here and not torch.cuda.is_available()
    if m.fp8_format is not None and (p.device == "cpu" or no_cuda):
        yield "--fp8-format: FP8 needs a Hopper GPU with Transformer Engine; drop it on CPU"
    if here:
        yield from _this_machine_problems(cfg)
    if opt.min_lr > opt.lr:
        yield f"--min-lr: {opt.min_lr} is above --lr {opt.lr}"
    yield from _remainder_problems(cfg)
    yield from _batch_problems(cfg)
    yield from _optimizer_problems(cfg)
    if OPTIMIZERS[opt.optimizer].sketched and lg.loggra_rank > m.hidden_size // tp:
        yield (
            f"--loggra-rank: {lg.loggra_rank} exceeds the smallest sketched weight side "
            f"(--hidden-size / TP = {m.hidden_size // tp}); use at most that (hidden/8 is "
            "typical)"
        )
    if cfg.rollout.max_new_tokens >= m.seq_length:
        yield f"--max-new-tokens: must be below --seq-length {m.seq_length} (prompt + response)"
    if cfg.kl_control.enabled and not m.bf16:
        yield (
            "--kl-target: predicted-KL control needs --bf16 (the candidate is tried on the "
            "16-bit weights while the fp32 master weights keep the current ones)"
        )
    yield from _gpu_only_problems(cfg, tp, here)
    yield from _rollout_engine_problems(cfg, here)


def _placement_problems(cfg: RunConfig, tp: int):
    """``--generation-ranks`` leaves training ranks, and the generation TP size splits the
    generation ranks and the model."""
    pl = cfg.placement
    if not pl.disaggregated:
        return
    if pl.generation_ranks >= cfg.world_size:
        yield (
            f"--generation-ranks: {pl.generation_ranks} of a world of {cfg.world_size} ranks "
            "leaves none to train; use fewer, or launch more ranks (torchrun --nproc-per-node)"
        )
        return
    gen_tp = pl.generation_tp(tp)
    if pl.generation_ranks % gen_tp:
        yield (
            f"--generation-tensor-model-parallel-size: {gen_tp} must divide --generation-ranks "
            f"{pl.generation_ranks}"
        )
    backward = backward_sketch(cfg.optimizer.optimizer, cfg.loggra.loggra_sketch)
    if pl.weight_sync == "lowrank" and not backward:
        yield (
            "--weight-sync: lowrank sends the backward sketch's row updates; it needs "
            "--optimizer loggra --loggra-sketch backward (or use --weight-sync full)"
        )
    if pl.max_policy_lag and cfg.loss.tis_cap is None:
        yield (
            f"--max-policy-lag: rollouts up to {pl.max_policy_lag} steps old need the "
            "importance weights against the generating policy; add --tis-cap (2 is usual; "
            "docs/losses.md)"
        )
    m = cfg.model
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % gen_tp or m.ffn_size % gen_tp or groups % gen_tp:
        yield (
            f"--generation-tensor-model-parallel-size: {gen_tp} must divide the attention "
            f"heads ({m.num_attention_heads}), query groups ({groups}) and FFN width "
            f"({m.ffn_size})"
        )


def _model_split_problems(cfg: RunConfig, tp: int, pp: int):
    """The model's heads, groups, FFN and layers must split over TP and PP."""
    m = cfg.model
    if m.num_attention_heads % tp:
        yield (
            f"--num-attention-heads: {m.num_attention_heads} heads are not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if m.num_query_groups is not None and m.num_query_groups % tp:
        yield f"--num-query-groups: {m.num_query_groups} must be divisible by TP = {tp}"
    if m.ffn_size % tp:
        yield (
            f"--ffn-hidden-size: {m.ffn_size} (the FFN width) is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if m.num_layers % pp:
        yield (
            f"--num-layers: {m.num_layers} layers cannot be split over "
            f"--pipeline-model-parallel-size {pp}"
        )
    elif m.recompute_num_layers and m.recompute_num_layers > m.num_layers // pp:
        yield (
            f"--recompute-num-layers: {m.recompute_num_layers} is more than the "
            f"{m.num_layers // pp} layers of a pipeline stage (--num-layers / "
            "--pipeline-model-parallel-size); use at most that"
        )


def _remainder_problems(cfg: RunConfig):
    """``--loggra-param-remainders`` needs bf16 weights in the distributed optimizer."""
    m, opt, lg = cfg.model, cfg.optimizer, cfg.loggra
    if lg.loggra_param_remainders:  # (--optimizer loggra: settings_that_do_not_apply)
        if not (m.bf16 and opt.use_distributed_optimizer):
            yield (
                "--loggra-param-remainders: keeps the fp32 masters of bf16 weights in the "
                "distributed optimizer; needs --bf16 and --use-distributed-optimizer"
            )
        elif lg.loggra_fp32_grad_copy:
            yield (
                "--loggra-param-remainders: the masters are bf16 weights + remainders, "
                "which take no fp32 gradient copy; drop --loggra-fp32-grad-copy"
            )


def _batch_problems(cfg: RunConfig):
    """The global batch splits into micro-batches over DP and divides the rollout batch."""
    t, grpo, dp = cfg.training, cfg.grpo, cfg.data_parallel_size
    if t.global_batch_size % (t.micro_batch_size * dp):
        yield (
            f"--global-batch-size: {t.global_batch_size} must be a multiple of "
            f"--micro-batch-size × data-parallel size = {t.micro_batch_size * dp}"
        )
    if grpo.prompts_per_step % dp:
        yield f"--prompts-per-step: must be a multiple of the data-parallel size {dp}"
    rollout = grpo.rollout_batch_size
    if rollout % t.global_batch_size:
        yield (
            f"--global-batch-size: must divide the rollout batch --prompts-per-step × "
            f"--num-generations = {rollout}"
        )


def _this_machine_problems(cfg: RunConfig):
    """What this process's machine lacks: the CUDA device or Transformer Engine asked for."""
    if cfg.parallel.device == "cuda" and not torch.cuda.is_available():
        yield "--device: cuda was asked for but no CUDA device is visible; use --device cpu"
    if (
        cfg.model.transformer_impl == "transformer_engine"
        and importlib.util.find_spec("transformer_engine") is None
    ):
        yield (
            "--transformer-impl: transformer_engine is not installed (pip install "
            "'loggra-megatron[gpu]'); use local or auto"
        )


def _optimizer_problems(cfg):
    """What the ``--optimizer`` registry entry says it cannot do."""
    name, spec = cfg.optimizer.optimizer, OPTIMIZERS[cfg.optimizer.optimizer]
    if cfg.optimizer.use_distributed_optimizer and not spec.distributed:
        yield (
            f"--use-distributed-optimizer: Megatron's distributed optimizer cannot hold "
            f"--optimizer {name} (it takes Adam only); add --no-use-distributed-optimizer"
        )
    if cfg.kl_control.enabled and not spec.candidate:
        able = ", ".join(n for n, o in OPTIMIZERS.items() if o.candidate)
        yield (
            f"--kl-target: --optimizer {name} computes no side-effect-free candidate update, "
            "which predicted-KL control tries before it commits a step; drop --kl-target or "
            f"use an optimizer that does ({able})"
        )


def _on_gpu(cfg: RunConfig, here: bool) -> bool:
    """The run's device is a GPU (``here``: on this machine, else on one with CUDA)."""
    return cfg.parallel.uses_cuda(cuda_visible=not here or torch.cuda.is_available())


def _te_layers(cfg: RunConfig, here: bool) -> bool:
    impl = cfg.model.transformer_impl
    has_te = not here or importlib.util.find_spec("transformer_engine") is not None
    return impl == "transformer_engine" or (impl == "auto" and _on_gpu(cfg, here) and has_te)


def _gpu_only_problems(cfg: RunConfig, tp: int, here: bool):
    """Settings that only Transformer Engine layers or a GPU can run (the GPU's compute
    capability: ``here`` only)."""
    if cfg.model.sequence_parallel and tp == 1:
        yield (
            "--sequence-parallel: splits the sequence over the TP ranks; it needs "
            "--tensor-model-parallel-size > 1"
        )
    elif cfg.model.sequence_parallel and not _te_layers(cfg, here):
        yield (
            "--sequence-parallel: needs Transformer Engine layers (--transformer-impl "
            "transformer_engine on a GPU): Megatron-Core's local layer spec refuses it "
            "('sequence parallel not supported by torch LayerNorm')"
        )
    if cfg.model.sequence_packing and not _te_layers(cfg, here):
        yield (
            "--sequence-packing: needs Transformer Engine layers (--transformer-impl "
            "transformer_engine on a GPU): Megatron-Core's local attention refuses packed "
            "sequences"
        )
    m = cfg.model
    if here and m.fp8_format is not None and _on_gpu(cfg, here):
        capability = torch.cuda.get_device_capability()
        have = f"this GPU has compute capability {capability[0]}.{capability[1]}"
        if capability < (8, 9):
            yield f"--fp8-format: FP8 GEMMs need Ada or Hopper (8.9+), {have}; drop it"
        elif m.fp8_recipe == "mxfp8" and capability < (10, 0):
            yield (
                f"--fp8-recipe: mxfp8 needs Blackwell (10.0+), {have}; use tensorwise "
                "(current scaling, docs/rollouts.md) or delayed"
            )


AUTO_FALLBACK_MAX_PARAMETERS = 3_000_000_000
"""Above this size ``--rollout-engine auto`` does not fall back to an engine it ranks lower
because this machine lacks what the higher one needs (the static engine without flash-attn):
that engine decodes a model this large far slower, so the run names the engine it wants. A
fallback the settings decide (fp32 weights, blockwise FP8) is said at start-up instead."""


def _large_model_fallback(model, engine: str, why: str):
    from loggra_megatron.memory.params import num_parameters
    from loggra_megatron.memory.shape import TransformerShape

    try:
        size = num_parameters(TransformerShape.from_model_args(model.model_args(1)))
    except ValueError:
        return  # an inconsistent architecture is refused in its own words
    if size > AUTO_FALLBACK_MAX_PARAMETERS:
        yield (
            f"--rollout-engine: auto would fall back to the {engine} engine for this "
            f"{size / 1e9:.1f}B-parameter model ({why}), which decodes "
            f"a model this large far slower; install what the engine passed over lacks, or "
            f"name the engine: --rollout-engine {engine}"
        )


def _rollout_engine_problems(cfg, here: bool):
    """A named ``--rollout-engine`` that cannot run here (``auto`` passes it over); not
    ``here``: by the settings alone (``refusal``). Rollout settings that do nothing with the
    engine the run takes (``RolloutConfig.problems_with``), and ``--tis-cap`` with one that
    does not sample its own log-probs."""
    name = cfg.rollout.rollout_engine
    target = EngineTarget.of_settings(cfg.model, cuda=_on_gpu(cfg, here))
    if name != AUTO:
        engine = ROLLOUT_ENGINES[name]
        reason = engine.unavailable(target) if here else engine.refusal(target)
        if reason is not None:
            others = " or ".join([*(n for n in ROLLOUT_ENGINES if n != name), AUTO])
            yield (
                f"--rollout-engine: the {name} engine cannot run here ({reason}; "
                f"docs/rollouts.md); use {others}"
            )
            return
    try:
        engine, _ = select_engine(name, target, planning=not here)
    except RuntimeError:
        return  # no engine at all: the run says so where it starts one
    lacking = here and select_engine(name, target, planning=True)[0] is not engine
    if name == AUTO and target.cuda and is_fallback(engine) and lacking:  # this machine's
        why = "; ".join(passed_over(engine, target))
        yield from _large_model_fallback(cfg.model, engine.name, why)
    yield from cfg.rollout.problems_with(engine.name, target.cuda)
    if cfg.loss.tis_cap is not None and engine.recomputes_log_probs:
        yield (
            f"--tis-cap: the {engine.name} engine does not sample its own log-probs (the "
            "rollout's are the trainer's recompute), so there is no mismatch to correct; "
            "use --rollout-engine static, or drop --tis-cap"
        )

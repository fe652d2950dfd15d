# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The RL step a ``pretrain_rl.py`` run holds on each GPU, from its settings: the run's
sections (a :class:`~loggra_megatron.train.run_config.RunConfig`) and the estimator's own
(:class:`~loggra_megatron.memory.estimate_config.EstimateConfig`) → the
:class:`TransformerShape`, :class:`ParallelConfig` and :class:`RLStepConfig` that
:func:`~loggra_megatron.memory.model.estimate_rl_step_memory` models.

Every number is read where the run reads it: the architecture as ``train/build.model_args``
makes it (a converted model's, or ``ModelConfig.model_args``), the rollout batch from
``GRPOConfig.rollout_batch_size``, the forward-only micro-batch from
``TrainingConfig.forward_micro_batch_size``, the KL trial rows from
``KLControlConfig.probe_split``, the engine from the rollout registry's ``auto`` rule for a
GPU, the optimizer's state from its registry entry, LoGRA's sketch mode, targets and row
update from its settings section (``--loggra-sketch backward``: :mod:`.backward_sketch`).
"""

from __future__ import annotations

from typing import Any

from loggra_megatron.config import ConfigError, flag
from loggra_megatron.memory.config import GiB, ParallelConfig, RLStepConfig, TransformerShape
from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.model.config import ARCHITECTURE
from loggra_megatron.rollout.protocol import EngineTarget
from loggra_megatron.rollout.registry import select_engine

ARCHITECTURE_FLAGS = (*ARCHITECTURE, "vocab_size")
"""What ``--hf-config`` gives: the architecture fields of the model section and the
vocabulary."""
REQUIRED_WITHOUT_HF_CONFIG = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
"""Without ``--hf-config`` the model is made from scratch by the model flags: these must be
given (their defaults are a toy model's)."""


def adopt_architecture(model, est: EstimateConfig, given: set[str]) -> None:
    """Where the architecture comes from: with ``--hf-config`` the converted model's, adopted
    into ``model`` (the ``ModelConfig`` section) as ``pretrain_rl.py`` adopts a converted
    checkpoint's, and no architecture flag may be given; without it the model flags make
    the model from scratch and must be given (``given``: the flags given). Raises
    :class:`ConfigError` naming the flag."""
    if est.hf_config is None:
        missing = [name for name in REQUIRED_WITHOUT_HF_CONFIG if name not in given]
        if missing:
            raise ConfigError(
                f"{flag(missing[0])}: required without --hf-config (the model flags' defaults "
                "are a toy model's); give the architecture or a Hugging Face config.json"
            )
        return
    extra = [name for name in ARCHITECTURE_FLAGS if name in given]
    if extra:
        raise ConfigError(
            f"{flag(extra[0])}: not allowed with --hf-config (the architecture is the config's)"
        )
    args = model_args(model, est)
    for name in ARCHITECTURE:
        setattr(model, name, getattr(args, name))


def model_args(model, est: EstimateConfig):
    """The :class:`~loggra_megatron.model.args.GPTModelArgs` of the model the run trains, as
    ``train/build.model_args`` has it: the converted model's (``--hf-config`` mapped as
    ``tools/convert_checkpoint.py`` maps it), else one made from scratch by the model
    settings ``model`` and ``--vocab-size`` (``ModelConfig.model_args``). Raises
    :class:`ConfigError` naming the flag."""
    if est.hf_config is None:
        try:
            args = model.model_args(est.vocab_size)
        except ValueError as e:  # e.g. an odd head dimension (RoPE)
            raise ConfigError(f"--hidden-size: {e}") from None
    else:
        from loggra_megatron.convert.hf_config import gpt_args_from_hf  # imports torch

        try:
            args = gpt_args_from_hf(est.hf_config)
        except (ValueError, OSError, TypeError) as e:
            raise ConfigError(f"--hf-config: {e}") from None
    if est.make_vocab_size_divisible_by is not None:
        args.make_vocab_size_divisible_by = est.make_vocab_size_divisible_by
    return args


def modelled_step(
    cfg: Any, est: EstimateConfig
) -> tuple[TransformerShape, ParallelConfig, RLStepConfig]:
    """The shape, parallel layout and RL step of a run with the settings ``cfg`` (a
    ``RunConfig``, its architecture adopted (:func:`adopt_architecture`), validated, with its
    derived defaults: ``arguments.fill_derived_defaults``) on the machine ``est`` describes."""
    m, t, grpo, kl = cfg.model, cfg.training, cfg.grpo, cfg.kl_control
    dp = cfg.data_parallel_size
    parallel = ParallelConfig(
        tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
        data_parallel_size=dp,
        sequence_parallel=m.sequence_parallel,
        gpus_per_node=est.gpus_per_node,
    )
    # the engine the run generates with on a GPU with the engines' kernels
    target = EngineTarget.of_settings(m, cuda=cfg.parallel.uses_cuda(cuda_visible=True))
    engine, _ = select_engine(cfg.rollout.rollout_engine, target, planning=True)
    per_replica = t.global_batch_size // dp  # sequences of an optimizer step (Actor.per_rank)
    trial_rows = 0
    if kl.enabled:  # a trial forward: the probe rows, and the held-out ones when kl/realized is due
        probe, held_out = kl.probe_split(per_replica)
        trial_rows = held_out.stop if kl.kl_realized_interval else probe.stop
    step = RLStepConfig(
        micro_batch_size=t.micro_batch_size,
        seq_length=m.seq_length,
        precision="fp8" if m.fp8_format else "bf16" if m.bf16 else "fp32",
        main_grads_dtype="bf16" if cfg.optimizer.grad_reduce_in_bf16 else "fp32",
        optimizer=cfg.optimizer.optimizer,
        loggra_rank=cfg.loggra.rank_for(m.hidden_size),
        loggra_min_dim=cfg.loggra.loggra_min_dim,
        loggra_sketch=cfg.loggra.loggra_sketch,
        loggra_targets=cfg.loggra.targets(),
        loggra_row_optimizer=cfg.loggra.loggra_row_optimizer,
        exp_avg_dtype=est.exp_avg_dtype,
        exp_avg_sq_dtype=est.exp_avg_sq_dtype,
        loggra_fp32_grad_copy=cfg.loggra.loggra_fp32_grad_copy,
        loggra_param_remainders=cfg.loggra.loggra_param_remainders,
        distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        reference_model=grpo.kl_coef > 0,  # as the trainer builds one
        recompute_granularity=m.recompute_granularity or "none",
        recompute_method=m.recompute_method or "uniform",
        recompute_num_layers=m.recompute_num_layers or 1,
        rollout_batch_size=grpo.rollout_batch_size // dp,
        inference_max_tokens=cfg.rollout.inference_max_tokens,
        rollout_engine=engine.name,
        max_new_tokens=cfg.rollout.max_new_tokens,
        log_prob_micro_batch_size=t.forward_micro_batch_size,
        num_microbatches=per_replica // t.micro_batch_size,
        kl_probe_sequences=trial_rows,
        kl_estimator=kl.kl_estimator,
        runtime_overhead_bytes=int(est.runtime_overhead_gb * GiB),
        nccl_nvls=est.nccl_nvls,
        expandable_segments=est.expandable_segments,
    )
    return TransformerShape.from_model_args(model_args(m, est)), parallel, step

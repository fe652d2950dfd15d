# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The RL step a ``pretrain_rl.py`` run holds on each GPU, from its settings: the run's
sections (a ``RunConfig``) and the estimator's own
(``EstimateConfig``) → the
``TransformerShape`` and ``StepPlan``
that ``estimate_rl_step_memory`` models.

Every number is the trainer's: the architecture as ``train/build.model_args`` makes it (a
converted model's, or ``ModelConfig.model_args``), the step as the trainer plans it
(``StepPlan.of``: rows per replica, micro-batches, the reference, the KL trial rows, the
engine ``auto`` takes on a GPU, LoGRA's rank, ...); the optimizer's state is its registry
entry's, LoGRA's sketch mode, targets and row update its settings' (``--loggra-sketch
backward``: ``.backward_sketch``).
"""

from __future__ import annotations

from loggra_megatron.config import ConfigError, flag
from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.memory.shape import TransformerShape
from loggra_megatron.model.config import ARCHITECTURE, ModelConfig
from loggra_megatron.train.run_config import RunConfig
from loggra_megatron.train.step_plan import StepPlan

ARCHITECTURE_FLAGS = (*ARCHITECTURE, "vocab_size")
"""What ``--hf-config`` gives: the architecture fields of the model section and the
vocabulary."""
REQUIRED_WITHOUT_HF_CONFIG = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
"""Without ``--hf-config`` the model is made from scratch by the model flags: these must be
given (their defaults are a toy model's)."""


def adopt_architecture(model: ModelConfig, est: EstimateConfig, given: set[str]) -> None:
    """Where the architecture comes from: with ``--hf-config`` the converted model's, adopted
    into ``model`` (the ``ModelConfig`` section) as ``pretrain_rl.py`` adopts a converted
    checkpoint's, and no architecture flag may be given; without it the model flags make
    the model from scratch and must be given (``given``: the flags given). Raises
    ``ConfigError`` naming the flag."""
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


def model_args(model: ModelConfig, est: EstimateConfig):
    """The ``GPTModelArgs`` of the model the run trains, as
    ``train/build.model_args`` has it: the converted model's (``--hf-config`` mapped as
    ``tools/convert_checkpoint.py`` maps it), else one made from scratch by the model
    settings ``model`` and ``--vocab-size`` (``ModelConfig.model_args``). Raises
    ``ConfigError`` naming the flag."""
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


def modelled_step(cfg: RunConfig, est: EstimateConfig) -> tuple[TransformerShape, StepPlan]:
    """The shape and the RL step of a run with the settings ``cfg`` (its architecture adopted
    (``adopt_architecture``), validated, with its derived defaults:
    ``arguments.fill_derived_defaults``) on a GPU: the step is the plan the trainer derives
    (``StepPlan.of <loggra_megatron.train.step_plan.StepPlan.of>``), the shape the model
    the run builds (``model_args``)."""
    return TransformerShape.from_model_args(model_args(cfg.model, est)), StepPlan.of(cfg, cuda=True)

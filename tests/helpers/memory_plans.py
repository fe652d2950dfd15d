"""Plans of RL steps for the memory tests: ``pretrain_rl.py``'s default settings with
``--bf16`` (the estimator's GPU: ``StepPlan.of(cfg, cuda=True)``) and the static engine (its
sampled old log-probs), the fields a test sets replaced (``plan``), or a plan from a
command line (``plan_of``)."""

from __future__ import annotations

import dataclasses

from loggra_megatron.arguments import (
    build_parser,
    fill_derived_defaults,
    read_sections,
    validate_settings,
)
from loggra_megatron.model.config import ModelConfig
from loggra_megatron.train.run_config import RunConfig
from loggra_megatron.train.step_plan import StepPlan

BASE = dataclasses.replace(
    StepPlan.of(RunConfig(model=ModelConfig(bf16=True)), cuda=True),
    rollout_engine="static",
    old_log_probs="rollout",  # the static engine's: sampled while decoding
)


def plan(**fields) -> StepPlan:
    """``BASE`` with ``fields`` replaced."""
    return dataclasses.replace(BASE, **fields)


def plan_of(argv: list[str], world_size: int = 1) -> tuple[RunConfig, StepPlan]:
    """The settings of the command line ``argv`` of ``pretrain_rl.py`` (read as the
    estimator reads them: no host file, the rules by settings) and their plan on a GPU."""
    sections, _ = read_sections(build_parser(), argv, host_files=False)
    cfg = RunConfig(**sections, world_size=world_size)
    fill_derived_defaults(cfg)
    assert validate_settings(cfg) is None, validate_settings(cfg)
    return cfg, StepPlan.of(cfg, cuda=True)

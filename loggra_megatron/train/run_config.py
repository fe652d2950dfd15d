"""Every setting of a ``pretrain_rl.py`` run, by section (``RunConfig``): ``model``,
``parallel``, ``placement``, ``training``, ``optimizer``, ``loggra``, ``rollout``, ``grpo``, ``loss``,
``kl_control``, ``data``, ``task`` (generated from the tasks' own knob declarations),
``checkpoint`` and ``logging``, each the settings dataclass of the component that owns it.

The command line is generated from the sections (``arguments``); the
builders of a run (``train.build``) read a ``RunConfig`` and give each
component its own section.

Each section's class, module and owner: docs/architecture.md#settings
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from loggra_megatron.checkpointing.config import CheckpointConfig
from loggra_megatron.checkpointing.resume import StartPlan
from loggra_megatron.data.config import DataConfig
from loggra_megatron.metrics import LoggingConfig
from loggra_megatron.model.config import ModelConfig
from loggra_megatron.optim.config import LoGRAConfig, OptimConfig
from loggra_megatron.parallel import ParallelConfig
from loggra_megatron.placement.config import PlacementConfig
from loggra_megatron.rl.config import GRPOConfig, KLControlConfig
from loggra_megatron.rl.policy_loss import PolicyLossConfig
from loggra_megatron.rollout.config import RolloutConfig
from loggra_megatron.tasks import TASKS
from loggra_megatron.tasks.flags import task_flags_section
from loggra_megatron.train.config import TrainingConfig

TaskFlags = task_flags_section(TASKS)
"""The ``task`` section: every registered task's knobs (``tasks/flags.py``)."""

SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "placement": PlacementConfig,
    "training": TrainingConfig,
    "optimizer": OptimConfig,
    "loggra": LoGRAConfig,
    "rollout": RolloutConfig,
    "grpo": GRPOConfig,
    "loss": PolicyLossConfig,
    "kl_control": KLControlConfig,
    "data": DataConfig,
    "task": TaskFlags,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclass
class RunConfig:
    """Every setting of a ``pretrain_rl.py`` run, by section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimConfig = field(default_factory=OptimConfig)
    loggra: LoGRAConfig = field(default_factory=LoGRAConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl_control: KLControlConfig = field(default_factory=KLControlConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: TaskFlags = field(default_factory=TaskFlags)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    world_size: int = 1
    """From torchrun's WORLD_SIZE."""
    start: StartPlan = field(default_factory=StartPlan)
    """How the run starts (fresh, resume, weights, converted): decided by
    ``parse_args`` from --load/--save, not a flag."""

    @property
    def training_world_size(self) -> int:
        """The ranks that train: the world less ``--generation-ranks``."""
        return self.world_size - self.placement.generation_ranks

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        return self.training_world_size // model_parallel

    @property
    def metrics_dir(self) -> str:
        """Where ``metrics.jsonl`` goes (``LoggingConfig.metrics_dir``)."""
        return self.logging.metrics_dir(self.checkpoint.save)

    def flags(self) -> dict:
        """``{field name: value}`` of every flag (``run_config.json``, resume comparisons)."""
        return {k: v for section in SECTIONS for k, v in vars(getattr(self, section)).items()}

    def to_dict(self) -> dict:
        """The settings by section (W&B config), without the start plan."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "start"}

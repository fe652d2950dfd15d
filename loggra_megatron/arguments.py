"""Command-line arguments of ``pretrain_rl.py``: Megatron-LM-style flags over dataclasses.

Each section is a dataclass whose fields become ``--field-name`` flags (help text from the
field's docstring); ``--config FILE.yaml`` supplies defaults whose keys are the flag names
(with dashes or underscores), and flags given on the command line override them. Every
cross-check runs in :func:`parse_args`, before any process group, file or device is
touched: an invalid setting exits with status 2 and a message naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import math
import os
import typing
from dataclasses import dataclass, field

import torch

from loggra_megatron.checkpointing.resume import StartPlan, check_resume, plan_start
from loggra_megatron.config import ConfigError, at_least, check_fields, one_of, positive, reject
from loggra_megatron.data.tasks import KINDS as TASKS
from loggra_megatron.kl_control import KLControlConfig
from loggra_megatron.optim.projection import PROJECTIONS
from loggra_megatron.rl.losses import AGGREGATIONS

FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")  # Megatron's Fp8Recipe, less custom
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
OPTIMIZERS = ("adam", "loggra")


@dataclass
class ModelArguments:
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Hidden size."""
    ffn_hidden_size: int | None = None
    """SwiGLU FFN size (default: 8/3 · hidden, rounded up to a multiple of 64)."""
    num_attention_heads: int = 4
    """Attention heads."""
    num_query_groups: int | None = None
    """KV heads for grouped-query attention (default: one per head)."""
    seq_length: int = 128
    """Maximum tokens per sequence (prompt + response)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer instead of reusing the word embeddings."""
    rotary_base: float = 10000.0
    """RoPE base."""
    init_method_std: float = 0.02
    """Std of the initial weights (models made from scratch)."""
    bf16: bool = False
    """bf16 weights and activations with fp32 master weights."""
    fp8_format: str | None = None
    """FP8 on Hopper via Transformer Engine: hybrid | e4m3."""
    fp8_recipe: str = "delayed"
    """Transformer Engine FP8 recipe: delayed | tensorwise | mxfp8."""
    transformer_impl: str = "auto"
    """local (plain PyTorch) | transformer_engine | auto (TE on GPU when installed)."""

    @property
    def ffn_size(self) -> int:
        """--ffn-hidden-size, or its default 8/3 · hidden rounded up to a multiple of 64."""
        return self.ffn_hidden_size or 64 * math.ceil(8 * self.hidden_size / 3 / 64)

    def __post_init__(self):
        check_fields(self, [
            ("num_layers", positive, ">= 1"), ("hidden_size", positive, ">= 1"),
            ("ffn_hidden_size", positive, ">= 1"), ("num_attention_heads", positive, ">= 1"),
            ("num_query_groups", positive, ">= 1"), ("seq_length", at_least(2), ">= 2"),
            ("rotary_base", positive, "> 0"), ("init_method_std", positive, "> 0"),
            ("fp8_format", one_of(*FP8_FORMATS), f"one of {', '.join(FP8_FORMATS)}"),
            ("fp8_recipe", one_of(*FP8_RECIPES), f"one of {', '.join(FP8_RECIPES)}"),
            ("transformer_impl", one_of(*TRANSFORMER_IMPLS),
             f"one of {', '.join(TRANSFORMER_IMPLS)}"),
        ])  # fmt: skip
        if self.hidden_size % self.num_attention_heads:
            reject("hidden_size", self.hidden_size,
                   f"must be divisible by --num-attention-heads {self.num_attention_heads}")
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            reject("num_query_groups", self.num_query_groups,
                   f"must divide --num-attention-heads {self.num_attention_heads}")
        if self.fp8_format is not None and self.transformer_impl == "local":
            reject("fp8_format", self.fp8_format, "FP8 runs in Transformer Engine layers; use "
                   "--transformer-impl transformer_engine (or auto), not local")
        if self.fp8_format is not None and not self.bf16:
            reject("fp8_format", self.fp8_format, "FP8 training needs --bf16")

@dataclass
class ParallelArguments:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""
    device: str = "auto"
    """cpu (gloo, CPU mode for megatron-core) | cuda (NCCL) | auto."""

    def __post_init__(self):
        check_fields(self, [
            ("tensor_model_parallel_size", positive, ">= 1"),
            ("pipeline_model_parallel_size", positive, ">= 1"),
            ("device", one_of("auto", "cpu", "cuda"), "one of auto, cpu, cuda"),
        ])  # fmt: skip

@dataclass
class TrainingArguments:
    train_iters: int = 10
    """RL steps (each: rollout, rewards, then --ppo-epochs passes of optimizer steps)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks."""
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """Optimizer steps of linear warm-up."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    adam_eps: float = 1e-8
    """Adam ε."""
    clip_grad: float = 1.0
    """Gradient clipping by global norm (0: off)."""
    seed: int = 1234
    """Random seed (weights, sampling, data order)."""
    optimizer: str = "loggra"
    """adam (Megatron's dense Adam) | loggra."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """Overlap the gradient reduce-scatter with the backward pass."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gather with the next forward pass."""
    grad_reduce_in_bf16: bool = False
    """Accumulate and reduce-scatter gradients in bf16 instead of fp32 (needs --bf16). LoGRA
    then reads them without Megatron's fp32 copy (see --loggra-fp32-grad-copy)."""
    max_consecutive_skipped_steps: int = 10
    """Stop the run (exit 1, checkpoints untouched) after this many optimizer steps in a row
    were skipped for a non-finite gradient norm or predicted KL (0: never stop)."""
    sft_iters: int = 0
    """Supervised warm-up steps on the tasks' reference solutions before RL."""
    sft_lr: float | None = None
    """Learning rate of the warm-up (default: --lr)."""

    def __post_init__(self):
        check_fields(self, [
            ("train_iters", at_least(0), ">= 0"), ("micro_batch_size", positive, ">= 1"),
            ("global_batch_size", positive, ">= 1"), ("lr", at_least(0), ">= 0"),
            ("min_lr", at_least(0), ">= 0"), ("lr_warmup_iters", at_least(0), ">= 0"),
            ("lr_decay_style", one_of(*LR_DECAY_STYLES), f"one of {', '.join(LR_DECAY_STYLES)}"),
            ("weight_decay", at_least(0), ">= 0"),
            ("adam_beta1", lambda b: 0 <= b < 1, "in [0, 1)"),
            ("adam_beta2", lambda b: 0 <= b < 1, "in [0, 1)"), ("adam_eps", positive, "> 0"),
            ("clip_grad", at_least(0), ">= 0 (0: no clipping)"), ("seed", at_least(0), ">= 0"),
            ("optimizer", one_of(*OPTIMIZERS), f"one of {', '.join(OPTIMIZERS)}"),
            ("max_consecutive_skipped_steps", at_least(0), ">= 0 (0: never stop)"),
            ("sft_iters", at_least(0), ">= 0"), ("sft_lr", at_least(0), ">= 0"),
        ])  # fmt: skip

@dataclass
class LoGRAArguments:
    loggra_rank: int | None = None
    """Sketch rank per weight matrix (default: --hidden-size / 8)."""
    loggra_update_interval: int = 200
    """Optimizer steps between basis refreshes."""
    loggra_projection: str = "range_finder"
    """range_finder | svd (GaLore baseline) | random | identity."""
    loggra_oversample: int = 8
    """Extra range-finder probe vectors."""
    loggra_power_iters: int = 1
    """Range-finder power iterations."""
    loggra_min_dim: int = 64
    """Matrices with a side shorter than this are updated densely."""
    loggra_fp32_grad_copy: bool = False
    """With --grad-reduce-in-bf16: let Megatron copy every gradient shard to fp32 before the
    step (4 bytes/param) instead of LoGRA converting one weight at a time."""

    def __post_init__(self):
        check_fields(self, [
            ("loggra_rank", positive, ">= 1"), ("loggra_update_interval", positive, ">= 1"),
            ("loggra_projection", one_of(*PROJECTIONS), f"one of {', '.join(PROJECTIONS)}"),
            ("loggra_oversample", at_least(0), ">= 0"), ("loggra_power_iters", at_least(0), ">= 0"),
            ("loggra_min_dim", positive, ">= 1"),
        ])  # fmt: skip

@dataclass
class RLArguments:
    prompts_per_step: int = 4
    """Prompts per RL step, over all data-parallel ranks."""
    num_generations: int = 4
    """Completions sampled per prompt (the GRPO group size)."""
    max_new_tokens: int = 32
    """Maximum response tokens."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling."""
    reward_fn: str = "default"
    """default | exact_match_numeric | format | module:function | file.py:function."""
    accuracy_threshold: float = 1.0
    """A response counts as correct (reward/accuracy) when its reward is at least this, unless
    the reward function returns {"reward": r, "correct": bool}."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    clip_low: float = 0.2
    """PPO clip range below 1."""
    clip_high: float = 0.28
    """PPO clip range above 1 (clip-higher)."""
    loss_aggregation: str = "token_mean"
    """token_mean (DAPO) | seq_mean_token_sum_norm (Dr.GRPO) | seq_mean_token_mean (GRPO)."""
    no_advantage_std_normalization: bool = False
    """Dr.GRPO advantages: subtract the group mean only."""
    kl_coef: float = 0.0
    """β of the KL-to-reference loss (0: no reference model)."""
    kl_ref_estimator: str = "k3"
    """k1 | k2 | k3."""
    kl_coef_target: float | None = None
    """Adaptive β (Ziegler et al. 2019): the KL-to-reference it steers to."""
    kl_coef_horizon: float = 10000.0
    """Adaptive β horizon, in samples."""

    def __post_init__(self):
        check_fields(self, [
            ("prompts_per_step", positive, ">= 1"),
            ("num_generations", at_least(2), ">= 2 (GRPO compares completions of a prompt)"),
            ("max_new_tokens", positive, ">= 1"), ("temperature", at_least(0), ">= 0 (0: greedy)"),
            ("top_p", lambda p: 0 < p <= 1, "in (0, 1]"), ("ppo_epochs", positive, ">= 1"),
            ("clip_low", lambda c: 0 <= c < 1, "in [0, 1)"), ("clip_high", at_least(0), ">= 0"),
            ("loss_aggregation", one_of(*AGGREGATIONS), f"one of {', '.join(AGGREGATIONS)}"),
            ("kl_coef", at_least(0), ">= 0 (0: no reference model)"),
            ("kl_ref_estimator", one_of("k1", "k2", "k3"), "one of k1, k2, k3"),
            ("kl_coef_target", positive, "> 0"), ("kl_coef_horizon", positive, "> 0"),
        ])  # fmt: skip

@dataclass
class DataArguments:
    tokenizer_model: str | None = None
    """sentencepiece model (train one with tools/train_tokenizer.py)."""
    data_path: str | None = None
    """JSONL prompts with prompt, answer and optional metadata (default: built-in tasks)."""
    task: str = "arithmetic"
    """Built-in verifiable tasks: arithmetic | word_problems | mixed."""
    num_tasks: int = 10000
    """Built-in tasks generated."""
    task_digits: int = 2
    """Digits per operand of the built-in arithmetic tasks."""
    task_operators: str = "+-*"
    """Operators of the built-in arithmetic tasks (a subset of +-*)."""

    def __post_init__(self):
        check_fields(self, [
            ("task", one_of(*TASKS), f"one of {', '.join(TASKS)}"),
            ("num_tasks", positive, ">= 1"), ("task_digits", lambda d: 1 <= d <= 18, "in [1, 18]"),
            ("task_operators", lambda o: bool(o) and not set(o) - set("+-*"),
             "a non-empty subset of +-*"),
        ])  # fmt: skip
        if self.tokenizer_model is None:
            reject("tokenizer_model", None, "required (train one with tools/train_tokenizer.py)")
        if not os.path.isfile(self.tokenizer_model):
            reject("tokenizer_model", self.tokenizer_model, "no such file")
        if self.data_path is not None and not os.path.isfile(self.data_path):
            reject("data_path", self.data_path, "no such file")

@dataclass
class CheckpointArguments:
    save: str | None = None
    """Directory for checkpoints (and, by default, metrics.jsonl)."""
    load: str | None = None
    """Checkpoint to start from: a run's --save directory (resume) or a converted model."""
    save_interval: int | None = None
    """Save every N RL steps (and always at the end and on SIGTERM)."""
    no_load_optim: bool = False
    """Load the policy's weights only (any TP/PP); optimizer, reference model, schedule and
    data position start fresh."""
    ckpt_step: int | None = None
    """Load this iteration of --load instead of the latest (e.g. after a corrupted save)."""
    checkpoint_checksums: bool = True
    """CRC-32 of every checkpoint file, written on save and verified on load (~2 GB/s per
    rank); --no-checkpoint-checksums records and checks file sizes only."""

    def __post_init__(self):
        check_fields(self, [("save_interval", positive, ">= 1"), ("ckpt_step", at_least(0), ">= 0")])
        if self.save_interval is not None and self.save is None:
            reject("save_interval", self.save_interval, "needs --save")

@dataclass
class LoggingArguments:
    output_dir: str | None = None
    """Where metrics.jsonl goes (default: --save, else ./outputs/rl)."""
    wandb_project: str | None = None
    """Weights & Biases project (offline when there is no API key)."""
    wandb_run_name: str | None = None
    """Weights & Biases run name."""
    tensorboard_dir: str | None = None
    """TensorBoard event directory."""


SECTIONS = {
    "model": ModelArguments,
    "parallel": ParallelArguments,
    "training": TrainingArguments,
    "loggra": LoGRAArguments,
    "rl": RLArguments,
    "kl_control": KLControlConfig,
    "data": DataArguments,
    "checkpoint": CheckpointArguments,
    "logging": LoggingArguments,
}


@dataclass
class RLConfig:
    """Every setting of a ``pretrain_rl.py`` run, by section."""

    model: ModelArguments = field(default_factory=ModelArguments)
    parallel: ParallelArguments = field(default_factory=ParallelArguments)
    training: TrainingArguments = field(default_factory=TrainingArguments)
    loggra: LoGRAArguments = field(default_factory=LoGRAArguments)
    rl: RLArguments = field(default_factory=RLArguments)
    kl_control: KLControlConfig = field(default_factory=KLControlConfig)
    data: DataArguments = field(default_factory=DataArguments)
    checkpoint: CheckpointArguments = field(default_factory=CheckpointArguments)
    logging: LoggingArguments = field(default_factory=LoggingArguments)
    world_size: int = 1
    """From torchrun's WORLD_SIZE."""
    start: StartPlan = field(default_factory=StartPlan)
    """How the run starts (fresh, resume, weights, converted): decided by :func:`parse_args`
    from --load/--save, not a flag."""

    @property
    def metrics_dir(self) -> str:
        """Where ``metrics.jsonl`` goes: --output-dir, else --save, else ./outputs/rl."""
        return self.logging.output_dir or self.checkpoint.save or os.path.join("outputs", "rl")

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)

    def to_dict(self) -> dict:
        """The settings (W&B config, ``run_config.json``), without the start plan."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "start"}


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body, docs = tree.body[0].body, {}
    for node, nxt in zip(body, body[1:], strict=False):
        is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and is_doc and isinstance(nxt.value.value, str):
            docs[node.target.id] = nxt.value.value
    return docs


def _base_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_rl.py",
        description="GRPO/PPO training of a Megatron-Core policy with LoGRA and "
        "predicted-KL step control. Run with torchrun.",
    )
    parser.add_argument("--config", default=None, help="YAML file of flag defaults")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = _base_type(hints[f.name])
            default = f.default
            if kind is bool:  # --flag (and --no-flag when the default is on)
                action = argparse.BooleanOptionalAction if default else "store_true"
                group.add_argument(
                    flag, dest=f.name, action=action, default=None, help=docs.get(f.name)
                )
            else:
                group.add_argument(
                    flag, dest=f.name, type=kind, default=None,
                    help=f"{docs.get(f.name, '')} (default: {default})",
                )  # fmt: skip
    return parser


def _config_file_defaults(path: str, parser: argparse.ArgumentParser) -> dict:
    import yaml

    if not os.path.isfile(path):
        parser.error(f"--config: no such file {path!r}")
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        parser.error(f"--config: {path!r} must hold a mapping of flag names to values")
    kinds = {
        f.name: _base_type(typing.get_type_hints(cls)[f.name])
        for cls in SECTIONS.values()
        for f in dataclasses.fields(cls)
    }
    out = {}
    for key, value in values.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in kinds:
            parser.error(f"--config: unknown key {key!r} in {path!r}")
        kind = kinds[name]
        if kind is int and isinstance(value, float) and not value.is_integer():
            parser.error(f"--config: {key!r} in {path!r} must be an integer, got {value!r}")
        if value is not None and not isinstance(value, kind):
            try:  # as argparse converts a flag's text (YAML reads 1e-5 as a string)
                value = kind(value) if kind is not bool else _yaml_bool(value)
            except (TypeError, ValueError):
                parser.error(f"--config: {key!r} in {path!r} must be {kind.__name__}, got {value!r}")
        out[name] = value
    return out


def _yaml_bool(value) -> bool:
    text = str(value).lower()
    if text not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(value)
    return text in ("true", "1", "yes")


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> RLConfig:
    """Parse and validate; exits with status 2 and a message naming the flag on bad input.

    As Megatron-LM's ``--use-checkpoint-args``, the architecture of the model in ``--load``
    is adopted for the model flags that were not given (:func:`plan_start`); the decision
    how the run starts is kept in ``cfg.start``."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    defaults = _config_file_defaults(ns.config, parser) if ns.config else {}
    explicit = set(defaults) | {k for k, v in vars(ns).items() if v is not None}
    sections = {}
    for section, cls in SECTIONS.items():
        kwargs = {}
        for f in dataclasses.fields(cls):
            value = getattr(ns, f.name)
            kwargs[f.name] = defaults.get(f.name, f.default) if value is None else value
        try:
            sections[section] = cls(**kwargs)
        except (TypeError, ValueError) as e:
            parser.error(str(e))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = RLConfig(**sections, world_size=world_size)
    try:
        cfg.start = plan_start(cfg, explicit)
        if cfg.loggra.loggra_rank is None:
            cfg.loggra.loggra_rank = max(1, cfg.model.hidden_size // 8)
        check_resume(cfg, cfg.start)
    except ConfigError as e:
        parser.error(str(e))
    problem = validate(cfg)
    if problem:
        parser.error(problem)
    return cfg


def validate(cfg: RLConfig) -> str | None:
    """The first cross-section inconsistency of ``cfg`` as ``--flag: message``, or None (each
    section checked its own fields when it was built)."""
    for problem in _cross_section_problems(cfg):
        return problem
    return None


def _cross_section_problems(cfg: RLConfig):
    """Yields ``--flag: message`` lazily, in order, so a check may rely on the ones before."""
    m, p, t, rl, lg = cfg.model, cfg.parallel, cfg.training, cfg.rl, cfg.loggra
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if cfg.world_size % (tp * pp):
        yield (f"--tensor-model-parallel-size: TP×PP = {tp * pp} must divide the world size "
               f"{cfg.world_size} (torchrun --nproc-per-node)")  # fmt: skip
        return
    dp = cfg.data_parallel_size
    if m.num_attention_heads % tp:
        yield (f"--num-attention-heads: {m.num_attention_heads} heads are not divisible by "
               f"--tensor-model-parallel-size {tp}")  # fmt: skip
    if m.num_query_groups is not None and m.num_query_groups % tp:
        yield f"--num-query-groups: {m.num_query_groups} must be divisible by TP = {tp}"
    if m.ffn_size % tp:
        yield (f"--ffn-hidden-size: {m.ffn_size} (the FFN width) is not divisible by "
               f"--tensor-model-parallel-size {tp}")  # fmt: skip
    if m.num_layers % pp:
        yield (f"--num-layers: {m.num_layers} layers cannot be split over "
               f"--pipeline-model-parallel-size {pp}")  # fmt: skip
    if m.fp8_format is not None and (p.device == "cpu" or not torch.cuda.is_available()):
        yield "--fp8-format: FP8 needs a Hopper GPU with Transformer Engine; drop it on CPU"
    if p.device == "cuda" and not torch.cuda.is_available():
        yield "--device: cuda was asked for but no CUDA device is visible; use --device cpu"
    if m.transformer_impl == "transformer_engine" and importlib.util.find_spec(
        "transformer_engine"
    ) is None:
        yield ("--transformer-impl: transformer_engine is not installed (pip install "
               "'loggra-megatron[gpu]'); use local or auto")
    if t.overlap_param_gather and not t.use_distributed_optimizer:
        yield "--overlap-param-gather: needs the distributed optimizer (--use-distributed-optimizer)"
    if t.min_lr > t.lr:
        yield f"--min-lr: {t.min_lr} is above --lr {t.lr}"
    if t.grad_reduce_in_bf16 and not m.bf16:
        yield "--grad-reduce-in-bf16: bf16 gradients need --bf16 parameters"
    if t.global_batch_size % (t.micro_batch_size * dp):
        yield (f"--global-batch-size: {t.global_batch_size} must be a multiple of "
               f"--micro-batch-size × data-parallel size = {t.micro_batch_size * dp}")  # fmt: skip
    if rl.prompts_per_step % dp:
        yield f"--prompts-per-step: must be a multiple of the data-parallel size {dp}"
    rollout = rl.prompts_per_step * rl.num_generations
    if rollout % t.global_batch_size:
        yield (f"--global-batch-size: must divide the rollout batch --prompts-per-step × "
               f"--num-generations = {rollout}")  # fmt: skip
    if t.optimizer == "loggra" and lg.loggra_rank > m.hidden_size // tp:
        yield (f"--loggra-rank: {lg.loggra_rank} exceeds the smallest sketched weight side "
               f"(--hidden-size / TP = {m.hidden_size // tp}); use at most that (hidden/8 is "
               "typical)")  # fmt: skip
    if rl.max_new_tokens >= m.seq_length:
        yield f"--max-new-tokens: must be below --seq-length {m.seq_length} (prompt + response)"
    if cfg.kl_control.enabled and not m.bf16:
        yield ("--kl-target: predicted-KL control needs --bf16 (the candidate is tried on the "
               "16-bit weights while the fp32 master weights keep the current ones)")

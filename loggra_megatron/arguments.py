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
import inspect
import os
import typing
from dataclasses import dataclass, field

import torch

from loggra_megatron.kl_control import KLControlConfig
from loggra_megatron.optim.projection import PROJECTIONS


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


@dataclass
class ParallelArguments:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""
    device: str = "auto"
    """cpu (gloo, CPU mode for megatron-core) | cuda (NCCL) | auto."""


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


@dataclass
class CheckpointArguments:
    save: str | None = None
    """Directory for checkpoints (and, by default, metrics.jsonl)."""
    load: str | None = None
    """Checkpoint to start from: a run's --save directory (resume) or a converted model."""
    save_interval: int | None = None
    """Save every N RL steps (and always at the end and on SIGTERM)."""
    no_load_optim: bool = False
    """Load weights only (fine-tune a converted or differently parallel checkpoint)."""


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

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
    known = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    out = {}
    for key, value in values.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in known:
            parser.error(f"--config: unknown key {key!r} in {path!r}")
        out[name] = value
    return out


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> RLConfig:
    """Parse and validate; exits with status 2 and a message naming the flag on bad input."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    defaults = _config_file_defaults(ns.config, parser) if ns.config else {}
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
    _adopt_checkpoint_architecture(cfg)
    if cfg.loggra.loggra_rank is None:
        cfg.loggra.loggra_rank = max(1, cfg.model.hidden_size // 8)
    problem = validate(cfg)
    if problem:
        parser.error(problem)
    return cfg


def _adopt_checkpoint_architecture(cfg: RLConfig) -> None:
    """With ``--load`` of a converted model, its architecture replaces the model flags, so
    that the checks below (heads vs TP, layers vs PP, rank vs hidden) see the real model."""
    load = cfg.checkpoint.load
    path = os.path.join(load, "loggra_model_args.json") if load else None
    if not path or not os.path.isfile(path):
        return
    from loggra_megatron.model import GPTModelArgs

    args, m = GPTModelArgs.load_json(path), cfg.model
    m.num_layers, m.hidden_size = args.num_layers, args.hidden_size
    m.ffn_hidden_size, m.num_attention_heads = args.ffn_hidden_size, args.num_attention_heads
    m.num_query_groups, m.rotary_base = args.num_query_groups, args.rotary_base
    m.untie_embeddings_and_output_weights = args.untie_embeddings_and_output_weights


def validate(cfg: RLConfig) -> str | None:
    """The first inconsistency of ``cfg`` as ``--flag: message``, or None."""
    m, p, t, rl = cfg.model, cfg.parallel, cfg.training, cfg.rl
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    checks = [
        (tp < 1, "--tensor-model-parallel-size", "must be >= 1"),
        (pp < 1, "--pipeline-model-parallel-size", "must be >= 1"),
        (cfg.world_size % (tp * pp) != 0, "--tensor-model-parallel-size",
         f"TP×PP = {tp * pp} must divide the world size {cfg.world_size} (torchrun --nproc-per-node)"),
        (m.num_attention_heads % tp != 0, "--num-attention-heads",
         f"{m.num_attention_heads} heads are not divisible by --tensor-model-parallel-size {tp}"),
        (m.hidden_size % m.num_attention_heads != 0, "--hidden-size",
         f"{m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}"),
        (m.num_query_groups is not None and (m.num_attention_heads % m.num_query_groups != 0
         or m.num_query_groups % tp != 0), "--num-query-groups",
         "must divide --num-attention-heads and be divisible by --tensor-model-parallel-size"),
        (m.num_layers % pp != 0, "--num-layers",
         f"{m.num_layers} layers cannot be split over --pipeline-model-parallel-size {pp}"),
        (p.device not in ("auto", "cpu", "cuda"), "--device", "choose auto, cpu or cuda"),
        (m.transformer_impl not in ("auto", "local", "transformer_engine"), "--transformer-impl",
         "choose auto, local or transformer_engine"),
        (m.fp8_format not in (None, "hybrid", "e4m3"), "--fp8-format", "choose hybrid or e4m3"),
        (m.fp8_format is not None and (p.device == "cpu" or not torch.cuda.is_available()),
         "--fp8-format", "FP8 needs a Hopper GPU with Transformer Engine; drop it on CPU"),
        (m.fp8_format is not None and not m.bf16, "--fp8-format", "FP8 training needs --bf16"),
        (t.grad_reduce_in_bf16 and not m.bf16, "--grad-reduce-in-bf16",
         "bf16 gradients need --bf16 parameters"),
        (t.micro_batch_size < 1, "--micro-batch-size", "must be >= 1"),
        (t.global_batch_size % (t.micro_batch_size * max(cfg.data_parallel_size, 1)) != 0,
         "--global-batch-size", f"{t.global_batch_size} must be a multiple of --micro-batch-size × "
         f"data-parallel size = {t.micro_batch_size * max(cfg.data_parallel_size, 1)}"),
        (rl.prompts_per_step % max(cfg.data_parallel_size, 1) != 0, "--prompts-per-step",
         f"must be a multiple of the data-parallel size {cfg.data_parallel_size}"),
        ((rl.prompts_per_step * rl.num_generations) % t.global_batch_size != 0,
         "--global-batch-size", f"must divide the rollout batch --prompts-per-step × "
         f"--num-generations = {rl.prompts_per_step * rl.num_generations}"),
        (rl.num_generations < 2, "--num-generations", "GRPO needs at least 2 completions per prompt"),
        (t.optimizer not in ("adam", "loggra"), "--optimizer", "choose adam or loggra"),
        (t.optimizer == "loggra" and cfg.loggra.loggra_rank < 1, "--loggra-rank", "must be >= 1"),
        (t.optimizer == "loggra" and cfg.loggra.loggra_rank > m.hidden_size // tp, "--loggra-rank",
         f"{cfg.loggra.loggra_rank} exceeds the smallest sketched weight side (--hidden-size / "
         f"TP = {m.hidden_size // tp}); use at most that (hidden/8 is typical)"),
        (cfg.loggra.loggra_projection not in PROJECTIONS, "--loggra-projection",
         f"choose one of {', '.join(PROJECTIONS)}"),
        (cfg.loggra.loggra_update_interval < 1, "--loggra-update-interval", "must be >= 1"),
        (cfg.loggra.loggra_min_dim < 1, "--loggra-min-dim", "must be >= 1"),
        (min(cfg.loggra.loggra_oversample, cfg.loggra.loggra_power_iters) < 0,
         "--loggra-oversample", "--loggra-oversample and --loggra-power-iters must be >= 0"),
        (t.lr < 0, "--lr", "must be >= 0"),
        (t.train_iters < 0, "--train-iters", "must be >= 0"),
        (t.lr_decay_style not in ("constant", "linear", "cosine"), "--lr-decay-style",
         "choose constant, linear or cosine"),
        (rl.max_new_tokens < 1 or rl.max_new_tokens >= m.seq_length, "--max-new-tokens",
         f"must be in [1, --seq-length {m.seq_length})"),
        (rl.temperature < 0, "--temperature", "must be >= 0"),
        (not 0 < rl.top_p <= 1, "--top-p", "must be in (0, 1]"),
        (rl.kl_coef < 0, "--kl-coef", "must be >= 0"),
        (rl.kl_ref_estimator not in ("k1", "k2", "k3"), "--kl-ref-estimator", "choose k1, k2 or k3"),
        (rl.loss_aggregation not in ("token_mean", "seq_mean_token_sum_norm", "seq_mean_token_mean"),
         "--loss-aggregation", "choose token_mean, seq_mean_token_sum_norm or seq_mean_token_mean"),
        (cfg.kl_control.enabled and not m.bf16, "--kl-target",
         "predicted-KL control needs --bf16 (the candidate is tried on the 16-bit weights while "
         "the fp32 master weights keep the current ones)"),
        (cfg.data.tokenizer_model is None, "--tokenizer-model",
         "required (train one with tools/train_tokenizer.py)"),
        (cfg.data.tokenizer_model is not None and not os.path.isfile(cfg.data.tokenizer_model),
         "--tokenizer-model", f"no such file {cfg.data.tokenizer_model!r}"),
        (cfg.data.data_path is not None and not os.path.isfile(cfg.data.data_path), "--data-path",
         f"no such file {cfg.data.data_path!r}"),
        (cfg.data.task not in ("arithmetic", "word_problems", "mixed"), "--task",
         "choose arithmetic, word_problems or mixed"),
        (cfg.data.task_digits < 1, "--task-digits", "must be >= 1"),
        (not cfg.data.task_operators or set(cfg.data.task_operators) - set("+-*"),
         "--task-operators", "use a non-empty subset of +-*"),
        (cfg.checkpoint.load is not None and not os.path.isdir(cfg.checkpoint.load), "--load",
         f"no such directory {cfg.checkpoint.load!r}"),
        (cfg.checkpoint.save_interval is not None and cfg.checkpoint.save_interval < 1,
         "--save-interval", "must be >= 1"),
        (cfg.checkpoint.save_interval is not None and cfg.checkpoint.save is None, "--save-interval",
         "needs --save"),
    ]  # fmt: skip
    for failed, flag, message in checks:
        if failed:
            return f"{flag}: {message}"
    return None

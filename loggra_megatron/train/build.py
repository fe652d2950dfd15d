"""Build functions of a run: each takes the settings (and what it depends on) and returns a
component; none keeps state of its own. Megatron's parallel state must be initialised
(``initialize_megatron``)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from loggra_megatron.data.tokenizer import Tokenizer
from loggra_megatron.model.args import GPTModelArgs
from loggra_megatron.optim.registry import OPTIMIZERS, resolve
from loggra_megatron.rl.kl_control import PredictedKLController
from loggra_megatron.rl.kl_schedule import KLTargetSchedule
from loggra_megatron.rl.losses import AdaptiveKLCoefficient
from loggra_megatron.rl.policy_loss import POLICY_LOSSES, PolicyLoss
from loggra_megatron.train.run_config import RunConfig
from loggra_megatron.train.step_plan import StepPlan

if TYPE_CHECKING:  # Megatron is imported when a builder runs
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import MegatronModule

    from loggra_megatron.optim.megatron.stepper import MegatronStepper


def model_args(cfg: RunConfig, tokenizer: Tokenizer) -> GPTModelArgs:
    """The architecture: the loaded model's (its vocabulary was checked against the
    tokenizer in preflight), else one made from the ``--num-layers`` ... flags."""
    from loggra_megatron.convert.checkpoint import read_model_args

    where = cfg.start.model_args_dir
    if where is None:
        return cfg.model.model_args(tokenizer.vocab_size)
    args = read_model_args(where)
    args.params_dtype = cfg.model.params_dtype
    return args


def use_transformer_engine(cfg: RunConfig, device: torch.device) -> bool:
    impl = cfg.model.transformer_impl
    if impl == "auto":
        return device.type == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    return impl == "transformer_engine"


def gpt_model(
    cfg: RunConfig, args: GPTModelArgs, device: torch.device, load_weights: bool = True
) -> MegatronModule:
    """This stage's frozen model (the reference, or the generation ranks' policy); the
    weights of a converted model are loaded here (``load_weights=False``: they arrive
    otherwise, as the generation ranks' from the first weight sync)."""
    model = _stage_model(cfg, args, device, load_weights, verify=False)
    return model.eval().requires_grad_(False)


def trainable_policy(cfg: RunConfig, args: GPTModelArgs, device: torch.device):
    """This stage's policy, DDP-wrapped, and what the ``--optimizer`` entry's
    ``prepare_model`` returned for it before DDP wrapped it (the backward sketch's sites, or
    None), which ``optimizer`` takes."""
    from loggra_megatron.model.build import wrap_ddp

    model = _stage_model(cfg, args, device, load_weights=True, verify=True)
    opt = cfg.optimizer
    prepare = OPTIMIZERS[opt.optimizer].prepare_model
    # before DDP: frozen weights get no grad buffer
    prepared = None if prepare is None else resolve(prepare)(model, opt, cfg.loggra)
    ddp = wrap_ddp(
        model,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        overlap_grad_reduce=opt.overlap_grad_reduce,
        overlap_param_gather=opt.overlap_param_gather,
        grad_reduce_in_fp32=not opt.grad_reduce_in_bf16,
    )
    return ddp, prepared


def _stage_model(cfg: RunConfig, args: GPTModelArgs, device, load_weights: bool, verify: bool):
    """This stage's GPTModel (in Megatron's ``Float16Module`` with ``--bf16``), a converted
    model's weights loaded (verified once: the policy's)."""
    from megatron.core.transformer.module import Float16Module

    from loggra_megatron.convert.checkpoint import load_megatron_checkpoint
    from loggra_megatron.model.build import build_gpt_model, fused_kernels

    m, use_te = cfg.model, use_transformer_engine(cfg, device)
    overrides = dict(
        use_cpu_initialization=device.type == "cpu",
        **fused_kernels(device.type, use_te),
        **m.transformer_overrides(),
    )
    model = build_gpt_model(
        args,
        use_te=use_te,
        sequence_packing=m.sequence_packing,
        log_prob_chunk_size=m.log_prob_chunk_size,
        **overrides,
    )
    if cfg.start.mode == "converted" and load_weights:
        load_megatron_checkpoint(model, cfg.start.checkpoint, verify=verify)
    return Float16Module(model.config, model) if m.bf16 else model


def optimizer(cfg: RunConfig, policy: DistributedDataParallel, prepared=None) -> MegatronOptimizer:
    """``--optimizer`` from the registry, over the policy (``prepared``: what
    ``trainable_policy`` returned with it)."""
    from loggra_megatron.optim.megatron.factory import build_optimizer

    spec = OPTIMIZERS[cfg.optimizer.optimizer]
    return build_optimizer(spec, cfg.optimizer, cfg.loggra, [policy], [prepared])


def warmup_phase(cfg: RunConfig, args: GPTModelArgs, device: torch.device, dp_group):
    """The supervised warm-up's own policy, ``--sft-optimizer`` over it, its stepper and the
    actor that trains it (``train.warmup.WarmupPhase``)."""
    from loggra_megatron.optim.megatron.stepper import MegatronStepper
    from loggra_megatron.rl.actor import Actor
    from loggra_megatron.train.warmup import WarmupPhase

    sft = copy.copy(cfg)
    sft.optimizer = dataclasses.replace(cfg.optimizer, optimizer=cfg.training.sft_optimizer)
    policy, prepared = trainable_policy(sft, args, device)
    sft_optimizer = optimizer(sft, policy, prepared)
    t = cfg.training
    actor = Actor(
        policy=policy,
        optimizer=sft_optimizer,
        optimizer_step=None,  # the warm-up steps through its stepper (train_on only)
        loss=None,
        dp_group=dp_group,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        length_grouping=t.length_grouping,
    )
    return WarmupPhase(policy, sft_optimizer, MegatronStepper(sft_optimizer), actor)


def policy_loss(cfg: RunConfig, kl_coef: AdaptiveKLCoefficient) -> PolicyLoss:
    """``--policy-loss`` from the registry (β: ``kl_coef``, read at each call;
    ``--max-new-tokens``: the Dr.GRPO constant)."""
    loss = POLICY_LOSSES[cfg.loss.policy_loss]
    return loss(cfg.loss, cfg.rollout.max_new_tokens, kl_coef)


def lr_scheduler(
    cfg: RunConfig, plan: StepPlan, optimizer: MegatronOptimizer
) -> OptimizerParamScheduler:
    """Megatron's ``OptimizerParamScheduler`` over the RL updates (the plan's optimizer steps
    per RL step × ``--train-iters``). On resume the flags win over the checkpoint's values
    (``override_opt_param_scheduler``)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = cfg.optimizer
    # Megatron's scheduler needs warm-up < decay (also for --train-iters 0 warm-up runs)
    decay = max(plan.updates_per_rl_step * cfg.training.train_iters, opt.lr_warmup_iters + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt.lr_warmup_iters else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=opt.lr_warmup_iters,
        lr_decay_steps=decay,
        lr_decay_style=opt.lr_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )


def kl_controller(
    cfg: RunConfig,
    stepper: MegatronStepper,
    policy: DistributedDataParallel,
    rl_step: Callable[[], int] | None = None,
) -> PredictedKLController | None:
    """Predicted-KL step control through the run's ``stepper`` (None without
    ``--kl-target``); ``rl_step()``: the RL steps done (the trainer's checkpointed counter),
    which the target's schedule follows (``--kl-target-final``; unset decay iterations:
    ``--train-iters``)."""
    from loggra_megatron.rl.kl_probe import gpt_probe_forward

    if not cfg.kl_control.enabled:
        return None
    rows = cfg.training.forward_micro_batch_size
    estimator = cfg.kl_control.kl_estimator
    full = estimator == "full"  # logits kept: one micro-batch per call
    forward = gpt_probe_forward(
        policy, rows, log_probs=not full, group=cfg.training.length_grouping
    )
    device = next(policy.parameters()).device
    measure = probe_kl(forward, estimator, device=device, forward_rows=rows if full else None)
    schedule = KLTargetSchedule.of(cfg.kl_control, cfg.training.train_iters)
    return PredictedKLController(cfg.kl_control, stepper, measure, schedule, rl_step)


def probe_kl(forward, estimator: str, *, device=None, forward_rows: int | None = None):
    """``rl.kl_probe.ProbeKL`` of ``forward`` over Megatron's TP, DP and PP groups."""
    from megatron.core import parallel_state as ps

    from loggra_megatron.rl.kl_probe import ProbeKL

    return ProbeKL(
        forward,
        estimator,
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        device=device,
        forward_rows=forward_rows,
    )


def experience_maker(cfg: RunConfig, host, policy, reference, *, tis=False, on_policy=False):
    """The ``ExperienceMaker`` of a run: ``policy`` (and ``reference``, or None), ``host``'s
    tokenizer, renderer and scoring, and its sections of ``cfg``; ``tis``: ``--tis-cap`` is
    set; ``on_policy``: one optimizer update per RL step (π_old is the training forward's).
    The advantages' batch mean (``--advantage-estimator reinforce-baseline``) is over
    Megatron's DP group."""
    from megatron.core import parallel_state as ps

    from loggra_megatron.rl.experience import ExperienceMaker

    t = cfg.training
    return ExperienceMaker(
        policy=policy,
        reference=reference,
        tokenizer=host.tokenizer,
        renderer=host.renderer,
        scoring=host.scoring,
        rollout=cfg.rollout,
        grpo=cfg.grpo,
        seed=t.seed,
        log_prob_micro_batch_size=t.forward_micro_batch_size,
        length_grouping=t.length_grouping,
        tis=tis,
        on_policy=on_policy,
        dp_group=ps.get_data_parallel_group(),
    )

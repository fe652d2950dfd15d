"""The plan of one RL step (``StepPlan``), derived once from a run's settings.

A ``RunConfig`` says what the user asked for; the
plan is what one RL step then is on each GPU, every number derived in one place
(``StepPlan.of``) and read by both the trainer and the memory model
(``memory``), which therefore model the step the trainer runs:

* the layout: TP × PP × DP with ``DP = world / (TP·PP)``;
* the batch per data-parallel replica: ``B = prompts · generations / DP`` rollouts,
  ``G = global batch / DP`` sequences per optimizer step in ``G / micro-batch``
  micro-batches, ``U = (prompts · generations / global batch) · PPO epochs`` optimizer steps
  per RL step (what the LR schedule counts), forward-only passes of
  ``--log-prob-micro-batch-size`` rows, log-probs in chunks of ``--log-prob-chunk-size``
  tokens;
* the reference model (``--kl-coef > 0``, on the host with ``--reference-offload``) and the
  rows of a predicted-KL trial forward: the probe's ``⌈fraction · G⌉`` rows, and as many
  held-out rows after them when ``kl/realized`` is measured (``KLControlConfig.probe_split``);
* the rollout engine ``--rollout-engine`` selects for the run's device, judged by the
  settings (``auto``'s rule, ``rollout.registry.select_engine``), and where the PPO ratio's
  π_old comes from (``RolloutEngine.old_log_probs``): the engine's sampling log-probs, the
  training forward itself when one PPO epoch over one mini-batch makes the step on-policy, or
  a forward after the rollout;
* the layer spec (``--transformer-impl``; ``auto`` as Transformer Engine on CUDA) and
  whether the step runs on CUDA (Megatron's kernel fusions, SDPA's flash kernel);
* precision, recompute and the optimizer's memory-relevant settings, LoGRA's rank resolved
  (``--loggra-rank``, default hidden / 8).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loggra_megatron.rollout.protocol import EngineTarget
from loggra_megatron.rollout.registry import select_engine
from loggra_megatron.train.run_config import RunConfig

__all__ = ["StepPlan"]


@dataclass(frozen=True)
class StepPlan:
    """One RL step of a run on each GPU (all numbers per data-parallel replica)."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    sequence_parallel: bool
    seq_length: int
    """Prompt + response tokens per sequence."""
    max_new_tokens: int
    """Response tokens; prompts are at most ``seq_length − max_new_tokens``."""
    rollout_batch_size: int
    """Sequences generated per replica and RL step."""
    num_generations: int
    """Rows that share a prompt (a GRPO group), side by side in the rollout batch."""
    rows_per_update: int
    """Sequences of one optimizer step on a replica (the actor's mini-batch)."""
    micro_batch_size: int
    num_microbatches: int
    """Micro-batches of one optimizer step."""
    updates_per_rl_step: int
    """Optimizer steps per RL step: mini-batches per rollout × PPO epochs."""
    forward_micro_batch_size: int
    """Sequences per forward-only micro-batch (reference and old log-probs, KL trials)."""
    log_prob_chunk_size: int | None
    """Tokens per chunk of the output layer and its log-softmax."""
    reference_model: bool
    """A frozen reference model is built (``--kl-coef > 0``)."""
    reference_offload: bool
    """Its weights live on the host and are streamed per unit (``--reference-offload``)."""
    kl_trial_rows: int
    """Sequences of each predicted-KL trial forward: the probe, and the held-out rows when
    ``kl/realized`` is measured (0: no KL control)."""
    kl_estimator: str
    kl_backup_offload: bool
    """The weights a trial overwrites are backed up on the host (``--kl-backup-offload``)."""
    rollout_engine: str
    """The entry of ``rollout.registry.ROLLOUT_ENGINES`` that generates (``auto`` resolved)."""
    old_log_probs: str
    """Where the PPO ratio's π_old comes from (``rollout.protocol.OLD_LOG_PROB_SOURCES``)."""
    inference_max_tokens: int | None
    """Bound on the rollout's KV cache in tokens (None: the whole rollout batch)."""
    precision: str
    """``fp32``, ``bf16`` or ``fp8`` (bf16 weights, FP8 GEMMs through Transformer Engine)."""
    transformer_impl: str
    """``transformer_engine`` (Transformer Engine's layer spec) or ``local`` (Megatron-Core's
    local spec); ``--transformer-impl auto`` is planned as Transformer Engine on CUDA (as in
    NGC's container) and local elsewhere."""
    cuda: bool
    """The step runs on CUDA: Megatron's kernel fusions are on (bias-SwiGLU, bias-dropout-add,
    ``model.build.fused_kernels``) and SDPA's flash kernel takes grouped keys and values."""
    main_grads_dtype: str
    """``fp32`` or ``bf16`` (``--grad-reduce-in-bf16``) grad buffers, for 16-bit weights."""
    recompute_granularity: str
    """``none``, ``selective`` or ``full``."""
    recompute_method: str
    """``uniform`` or ``block`` (read with full recompute)."""
    recompute_num_layers: int
    optimizer: str
    distributed_optimizer: bool
    overlap_param_gather: bool
    """``--overlap-param-gather``: a step's parameter all-gathers finish at the next forward."""
    loggra_rank: int
    loggra_min_dim: int
    loggra_sketch: str
    loggra_targets: tuple[str, ...]
    loggra_row_optimizer: str
    loggra_sketch_reduce: str
    loggra_fp32_grad_copy: bool
    loggra_param_remainders: bool
    freeze_non_targets: bool = False
    """Only the backward sketch's targets train (no dense gradient or optimizer state)."""
    generation_ranks: int = 0
    """GPUs that only generate (``--generation-ranks``; not in the TP × PP × DP grid)."""
    generation_tensor_model_parallel_size: int = 1
    """Their TP size (``--generation-tensor-model-parallel-size``)."""
    weight_sync: str = "full"
    """``--weight-sync``: with ``lowrank`` the generation ranks keep the trainer's masters."""

    @classmethod
    def of(cls, cfg: RunConfig, cuda: bool) -> StepPlan:
        """The plan of ``cfg`` (validated, its architecture adopted and its derived defaults
        filled: ``arguments.parse_args`` or the estimator's ``settings``) on a machine with a
        CUDA device or not (``cuda``: where ``--device auto`` runs, and which engine
        ``--rollout-engine auto`` takes)."""
        m, t, g, kl, opt, lg = (
            cfg.model,
            cfg.training,
            cfg.grpo,
            cfg.kl_control,
            cfg.optimizer,
            cfg.loggra,
        )
        dp = cfg.data_parallel_size
        rows = t.global_batch_size // dp
        trial_rows = 0
        if kl.enabled:
            probe, held_out = kl.probe_split(rows)
            trial_rows = held_out.stop if kl.kl_realized_interval else probe.stop
        on_cuda = cfg.parallel.uses_cuda(cuda_visible=cuda)
        target = EngineTarget.of_settings(m, cuda=on_cuda)
        te = m.transformer_impl == "transformer_engine" or (
            m.transformer_impl == "auto" and on_cuda
        )
        engine, _ = select_engine(cfg.rollout.rollout_engine, target, planning=True)
        updates = g.rollout_batch_size // t.global_batch_size * g.ppo_epochs
        return cls(
            tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
            data_parallel_size=dp,
            sequence_parallel=m.sequence_parallel,
            seq_length=m.seq_length,
            max_new_tokens=cfg.rollout.max_new_tokens,
            rollout_batch_size=g.rollout_batch_size // dp,
            num_generations=g.num_generations,
            rows_per_update=rows,
            micro_batch_size=t.micro_batch_size,
            num_microbatches=rows // t.micro_batch_size,
            updates_per_rl_step=updates,
            forward_micro_batch_size=t.forward_micro_batch_size,
            log_prob_chunk_size=m.log_prob_chunk_size,
            reference_model=g.kl_coef > 0,
            reference_offload=g.reference_offload,
            kl_trial_rows=trial_rows,
            kl_estimator=kl.kl_estimator,
            kl_backup_offload=kl.kl_backup_offload,
            rollout_engine=engine.name,
            old_log_probs=engine.old_log_probs(
                cfg.loss.tis_cap is not None or cfg.rollout.decodes_apart(m.fp8_format),
                updates == 1,
            ),
            inference_max_tokens=cfg.rollout.inference_max_tokens,
            precision="fp8" if m.fp8_format else "bf16" if m.bf16 else "fp32",
            transformer_impl="transformer_engine" if te else "local",
            cuda=on_cuda,
            main_grads_dtype="bf16" if opt.grad_reduce_in_bf16 else "fp32",
            recompute_granularity=m.recompute_granularity or "none",
            recompute_method=m.recompute_method or "uniform",
            recompute_num_layers=m.recompute_num_layers or 1,
            optimizer=opt.optimizer,
            distributed_optimizer=opt.use_distributed_optimizer,
            overlap_param_gather=opt.overlap_param_gather,
            loggra_rank=lg.rank_for(m.hidden_size),
            loggra_min_dim=lg.loggra_min_dim,
            loggra_sketch=lg.loggra_sketch,
            loggra_targets=lg.targets(),
            loggra_row_optimizer=lg.loggra_row_optimizer,
            loggra_sketch_reduce=lg.loggra_sketch_reduce,
            loggra_fp32_grad_copy=lg.loggra_fp32_grad_copy,
            loggra_param_remainders=lg.loggra_param_remainders,
            freeze_non_targets=lg.freeze_non_targets,
            generation_ranks=cfg.placement.generation_ranks,
            generation_tensor_model_parallel_size=cfg.placement.generation_tp(
                cfg.parallel.tensor_model_parallel_size
            ),
            weight_sync=cfg.placement.weight_sync,
        )

    @property
    def prompt_tokens(self) -> int:
        """The longest prompt, ``seq_length − max_new_tokens``."""
        return self.seq_length - self.max_new_tokens

    @property
    def world_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.data_parallel_size
        )

    @property
    def generating_rows(self) -> int:
        """Rollout rows that one replica of the GPUs that generate holds: a training
        replica's (colocated) or a generation replica's (``--generation-ranks``)."""
        if self.generation_ranks:
            return self.generation_plan().rollout_batch_size
        return self.rollout_batch_size

    def generation_plan(self) -> StepPlan:
        """The step of one generation GPU (``--generation-ranks``): the policy at the
        generation TP size, one stage, the rollout split over the generation replicas, and
        nothing of training (no reference, no trial, no optimizer)."""
        tp = self.generation_tensor_model_parallel_size
        replicas = self.generation_ranks // tp
        rows = self.rollout_batch_size * self.data_parallel_size
        return dataclasses.replace(
            self,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=1,
            data_parallel_size=replicas,
            rollout_batch_size=-(-rows // replicas),
            reference_model=False,
            reference_offload=False,
            kl_trial_rows=0,
            generation_ranks=0,
        )

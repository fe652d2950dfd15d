"""The RL training loop behind ``pretrain_rl.py``: GRPO/PPO on a Megatron-Core policy.

One RL step, on every rank of a DP × PP × TP grid (``docs/architecture.md``)::

    prompts ─► experience (rollout, rewards, advantages, reference log-probs)
            ─► actor.update_policy (PPO epochs × mini-batches: Megatron's schedule, then one
               optimizer step each, through predicted-KL control when --kl-target is set)
            ─► metrics (reduced over DP/PP) ─► checkpoint every --save-interval steps

``RLTrainer`` wires the components built by ``train.build`` and owns
the loop, the stop agreement (SIGTERM on any rank) and the checkpoint: the common state is
``{name: component.state_dict()}`` of every stateful component.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from loggra_megatron.data.tokenizer import identity
from loggra_megatron.optim.megatron.gradient_energy import captured_energy, discard_captured_energy
from loggra_megatron.parallel import initialize_megatron
from loggra_megatron.placement.remote import generate_remotely
from loggra_megatron.train import build
from loggra_megatron.train.lookahead import PromptLookahead
from loggra_megatron.train.memory_phases import PHASE_PEAKS, size_kv_budget_here
from loggra_megatron.train.preflight import Preflight
from loggra_megatron.train.reporting import EnergyWatch, memory_metrics, reduce_metrics
from loggra_megatron.train.run_config import RunConfig
from loggra_megatron.train.step_plan import StepPlan
from loggra_megatron.train.steps import OptimizerStep, SkipCounter, TrainingStopped

__all__ = ["RLTrainer", "TrainingStopped"]


KVBudgetFn = Callable[[Any, StepPlan, int, Mapping[str, str]], tuple[int | None, str]]
"""``(model_args, plan, usable bytes per GPU, environment) -> (KV budget in tokens or None,
the line to print)``: how a run sizes its rollout's KV cache where ``--inference-max-tokens``
is unset (``memory.kv_budget.kv_budget``, a layer above the trainer)."""


class RLTrainer:
    """Builds the components of a run (``setup``) and runs the RL loop (``train``)."""

    def __init__(
        self,
        cfg: RunConfig,
        host: Preflight,
        size_kv_budget: KVBudgetFn | None = None,
        channel=None,
    ):
        self.cfg, self.host = cfg, host
        self.channel = channel
        """With ``--generation-ranks``: the training leader's end of the channel to the
        generation leader (``placement.channel``; None on the other ranks)."""
        self.remote = None
        """With ``--generation-ranks``: the engine on the generation ranks
        (``placement.remote.RemoteEngine``), in place of the experience maker's."""
        self.size_kv_budget = size_kv_budget
        """Sizes the rollout's KV budget on CUDA where ``--inference-max-tokens`` is unset
        (``memory.kv_budget.kv_budget``; None: not sized)."""
        self.step = 0
        """RL steps done (the checkpoint iteration)."""
        self._sigterm = False
        self.plan = StepPlan.of(cfg, cuda=torch.cuda.is_available())
        """The RL step's numbers, as the memory estimator models them."""

    # ------------------------------------------------------------------ setup
    def setup(self) -> RLTrainer:
        from megatron.core import parallel_state as ps

        from loggra_megatron.model.forward import initialize_fp8_state

        cfg, host, p = self.cfg, self.host, self.cfg.parallel
        self.device = initialize_megatron(
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            cfg.training.seed,
            p.device,
        )
        self.rank, self.dp_group = dist.get_rank(), ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self._log(*(f" {note}" for note in host.notes))
        self.dataset = host.dataset
        self.prompts = PromptLookahead(self.dataset, self._next_prompts, cfg.grpo.prompts_per_step)
        self._tokenizer_identity = identity(host.tokenizer)
        stepper = self._build_models()
        self._build_rl(stepper)
        if cfg.placement.disaggregated:  # rollouts from the generation ranks
            self.remote, note = generate_remotely(
                self.experience, stepper, self.channel, self.model_args, cfg, lambda: self.step
            )
            self._log(note)
        self._size_kv_budget()
        self._load()
        for model in (self.policy, self.reference):  # before any inference-mode forward
            if model is not None:
                initialize_fp8_state(model)
        self._release_reference()
        self.metrics = self._metrics_logger()
        self.metrics.truncate_after(self.step)  # a fresh run here continues nothing (preflight)
        for signum in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C: the same agreed save
            signal.signal(signum, self._on_sigterm)
        return self

    def _build_models(self):
        """The policy, the reference, the optimizer and what steps it; returns the stepper."""
        from loggra_megatron.model.offload import offload_to_host
        from loggra_megatron.optim.megatron.stepper import MegatronStepper
        from loggra_megatron.rl import AdaptiveKLCoefficient

        cfg, g = self.cfg, self.cfg.grpo
        self.model_args = build.model_args(cfg, self.host.tokenizer)
        self.policy, prepared = build.trainable_policy(cfg, self.model_args, self.device)
        self.reference = (
            build.gpt_model(cfg, self.model_args, self.device) if g.kl_coef > 0 else None
        )
        if g.reference_offload:  # applies with --kl-coef > 0 only: there is a reference
            offload_to_host(self.reference, self.device)
        self.optimizer = build.optimizer(cfg, self.policy, prepared)
        self.scheduler = build.lr_scheduler(cfg, self.plan, self.optimizer)
        stepper = MegatronStepper(self.optimizer, cfg.kl_control.kl_backup_offload)
        self.kl_coef = AdaptiveKLCoefficient(g.kl_coef, g.kl_ref_target, g.kl_coef_horizon)
        self.kl_controller = build.kl_controller(
            cfg, stepper, self.policy, rl_step=lambda: self.step
        )
        self.skips = SkipCounter(cfg.training.max_consecutive_skipped_steps)
        self.energy_watch = EnergyWatch(cfg.loggra.loggra_energy_warn_threshold)
        return stepper

    def _size_kv_budget(self) -> None:
        """On CUDA with ``--inference-max-tokens`` unset: the rollout's KV budget from the
        memory model and the memory of the fullest GPU (one budget for every rank: the ranks
        of a replica must generate alike; ``memory/kv_budget.py``), printed."""
        sized = size_kv_budget_here(self.size_kv_budget, self.model_args, self.plan, self.device)
        if sized is None:
            return
        tokens, note = sized
        self.experience.kv_budget = tokens
        self.plan = dataclasses.replace(self.plan, inference_max_tokens=tokens)
        self._log(f" rollouts: {note}")

    def _build_rl(self, stepper) -> None:
        """The actor, the experience maker, the evaluator and the warm-up."""
        from megatron.core import parallel_state as ps

        from loggra_megatron.rl.actor import Actor
        from loggra_megatron.train.evaluation import Evaluator
        from loggra_megatron.train.warmup import SupervisedWarmup

        cfg, host, t = self.cfg, self.host, self.cfg.training
        step = OptimizerStep(
            stepper=stepper,
            kl_controller=self.kl_controller,
            scheduler=self.scheduler,
            skips=self.skips,
            where=lambda: f"at RL step {self.step + 1}",
        )
        self.actor = Actor(
            policy=self.policy,
            optimizer=self.optimizer,
            optimizer_step=step,
            loss=build.policy_loss(cfg, self.kl_coef),
            dp_group=self.dp_group,
            micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size,
            length_grouping=t.length_grouping,
        )
        self.experience = build.experience_maker(
            cfg,
            host,
            self.policy,
            self.reference,
            tis=cfg.loss.tis_cap is not None,
            on_policy=self.plan.updates_per_rl_step == 1,
        )
        note = self.experience.engine_note
        self._log(
            f" rollouts: {self.experience.engine.name} engine" + (f"; {note}" if note else "")
        )
        self.evaluator = None
        if host.eval_dataset is not None:
            self.evaluator = Evaluator(
                self.experience,
                host.eval_dataset,
                cfg.data,
                cfg.grpo.rollout_batch_size,
                self.dp_group,
            )
        self.warmup = SupervisedWarmup(  # its phase is built when a step is ahead (_load)
            None, self.skips, host, cfg, self.device, ps.get_data_parallel_rank()
        )

    def _metrics_logger(self):
        from loggra_megatron.metrics import MetricsLogger

        cfg = self.cfg
        return MetricsLogger(
            cfg.metrics_dir,
            rank=self.rank,
            total_steps=cfg.training.train_iters,
            wandb_project=cfg.logging.wandb_project,
            wandb_run_name=cfg.logging.wandb_run_name,
            tensorboard_dir=cfg.logging.tensorboard_dir,
            config=cfg.to_dict(),
        )

    def stateful(self) -> dict:
        """The components whose state a checkpoint carries, by name."""
        parts = {
            "data": self.prompts,
            "scheduler": self.scheduler,
            "kl_coef": self.kl_coef,
            "skipped_steps": self.skips,
            "warmup": self.warmup,
            "advantages": self.experience.advantages,  # the running baseline, if any
        }
        if self.kl_controller is not None:
            parts["kl_controller"] = self.kl_controller
        return parts

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        """The RL loop; with generation ranks, they are stopped at its end, with the reason
        where it failed."""
        try:
            self._train()
        except BaseException as e:
            if self.remote is not None:
                self.remote.stop(f"the trainer stopped: {e}")
            raise
        if self.remote is not None:
            self.remote.stop()

    def _train(self) -> None:
        cfg, resumed = self.cfg, self.cfg.start.resumes
        saved_at = self._progress() if resumed else None
        if not self.warmup.done:
            self.warmup.run(self._stop_requested, self._log)
            if self.warmup.done:
                self._end_warmup()
        if self.warmup.done and (self.cfg.training.sft_iters or not resumed) and self.step == 0:
            self._copy_policy_to_reference()  # the reference is the policy as RL starts
        while self.warmup.done and self.step < cfg.training.train_iters:
            if self._stop_requested():
                break
            metrics = self.rl_step()
            self.step += 1
            if self.evaluator is not None and self.evaluator.due(self.step):
                metrics.update(self.evaluator.run(self.step))
            self.metrics.log(self.step, metrics)
            interval = cfg.checkpoint.save_interval
            if cfg.checkpoint.save and interval and self.step % interval == 0:
                self.save()
                saved_at = self._progress()
        if cfg.checkpoint.save and saved_at != self._progress():  # the same on every rank
            self.save()
        self.metrics.close()

    def rl_step(self) -> dict[str, float]:
        cfg, t0 = self.cfg, time.perf_counter()
        PHASE_PEAKS.start_step(self.device)
        exp = self.experience.make(self.prompts.take(), self.step, PHASE_PEAKS.phase)
        self._submit_ahead()
        self._release_reference()
        t_experience = time.perf_counter() - t0
        t1 = time.perf_counter()
        discard_captured_energy(self.optimizer)  # the warm-up's, or a failed step's
        with PHASE_PEAKS.phase("train"):
            batch = exp.training_batch(self.device)
            updates = self.actor.update_policy(batch, cfg.grpo.ppo_epochs)
        t_train = time.perf_counter() - t1
        peaks = PHASE_PEAKS.step_metrics()
        metrics = reduce_metrics(
            {**updates, **exp.metrics, **peaks}, self.pp_group, self.dp_group, self.device
        )
        if self.kl_coef.adaptive and math.isfinite(metrics.get("kl/ref", math.nan)):
            self.kl_coef.update(metrics["kl/ref"], n_steps=cfg.grpo.rollout_batch_size)
        step_time = time.perf_counter() - t0
        tokens = exp.num_tokens.to(torch.float64)
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(tokens, group=self.dp_group)
        metrics.update(memory_metrics(self.optimizer, [self.policy]))
        metrics.update(captured_energy(self.optimizer, self.plan.updates_per_rl_step, self.device))
        warning = self.energy_watch.update(metrics)
        if warning is not None:
            self._log(f" warning: {warning}")
        metrics.update(
            {
                "kl/coef": self.kl_coef.value,
                "optimizer/skipped_steps_total": float(self.skips.total),
                "data/dropped_prompts": float(self.host.dropped_prompts),
                "time/step_s": step_time,
                "time/experience_s": t_experience,
                "time/train_s": t_train,
                "throughput/tokens_per_s": float(tokens) / step_time,
            }
        )
        return metrics

    def _next_prompts(self) -> list[dict]:
        """This DP rank's prompts of the next RL step (resumable via the dataset state)."""
        if not hasattr(self, "_batches"):
            self._batches = self.dataset.batches(
                self.cfg.grpo.prompts_per_step,
                dp_rank=dist.get_rank(self.dp_group),
                dp_size=dist.get_world_size(self.dp_group),
            )
        return next(self._batches)

    def _submit_ahead(self) -> None:
        """``--max-policy-lag K``: the next K steps' prompts go to the generation ranks."""
        lag = self.cfg.placement.max_policy_lag if self.remote is not None else 0
        ahead = min(lag, self.cfg.training.train_iters - self.step - 1)
        exp, temperature = self.experience, self.cfg.rollout.temperature
        first = self.step + 1 + len(self.prompts.queue)
        for i, examples in enumerate(self.prompts.extend_to(ahead)):
            request = exp.request(first + i, temperature)
            self.remote.submit(self.policy, exp.prompt_ids(exp.group(examples)), request)

    def _progress(self) -> tuple[int, int]:
        return self.step, self.warmup.step

    def _stop_requested(self) -> bool:
        """Whether SIGTERM reached any rank; every rank learns it at the same step boundary
        (one all-reduce), so all of them save and exit together. The answer is the agreed
        one: a signal that lands during the all-reduce counts at the next boundary."""
        signalled = self._sigterm or (self.remote is not None and self.remote.stop_requested)
        flag = torch.tensor([float(signalled)], device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = flag.item() > 0
        if agreed and not self._sigterm:
            self._log(" SIGTERM or SIGINT on another rank: saving and exiting")
        return agreed

    def _on_sigterm(self, signum, frame) -> None:
        """SIGTERM or SIGINT: save at the next step boundary, agreed by every rank, then exit
        (a ``KeyboardInterrupt`` raised inside a save's collective or writer start would
        leave the other ranks waiting in it)."""
        name = signal.Signals(signum).name
        print(f" {name} on rank {self.rank}: saving at the next step boundary", flush=True)
        self._sigterm = True

    def _release_reference(self) -> None:
        """An offloaded reference (``--reference-offload``): free the output layer its last
        forward kept on the device (``model/offload.py``)."""
        from loggra_megatron.model.offload import release_device_weights

        if self.reference is not None:
            release_device_weights(self.reference)

    def _start_warmup_from_policy(self) -> None:
        """A warm-up still ahead trains from the RL policy's weights (the same
        initialisation, or the loaded model)."""
        from loggra_megatron.train.warmup import copy_weights

        if not self.warmup.done:
            phase = self._warmup_phase()
            copy_weights(self.policy, phase.policy, phase.optimizer)

    def _warmup_phase(self):
        """The warm-up's phase, built now if it was not (a checkpoint that fell back to an
        older one, taken during the warm-up)."""
        if self.warmup.phase is None:
            self.warmup.phase = build.warmup_phase(
                self.cfg, self.model_args, self.device, self.dp_group
            )
        return self.warmup.phase

    def _end_warmup(self) -> None:
        """The warm-up's weights become the RL policy's (and its masters'); the warm-up's
        policy and optimizer are freed."""
        from loggra_megatron.train.warmup import copy_weights

        copy_weights(self.warmup.phase.policy, self.policy, self.optimizer)
        self.warmup.phase = None

    def _training_models(self):
        """``(policy, optimizer)`` that train now and that a checkpoint holds: the warm-up's
        while it runs, else the RL policy's."""
        phase = self.warmup.phase
        if phase is not None:
            return phase.policy, phase.optimizer
        return self.policy, self.optimizer

    def _copy_policy_to_reference(self) -> None:
        from loggra_megatron.model.offload import host_weights

        if self.reference is None:
            return
        with torch.no_grad(), host_weights(self.reference):  # offloaded: into its host copies
            policy = dict(self.policy.module.named_parameters())
            for name, p in self.reference.named_parameters():
                p.copy_(policy[name])

    def _log(self, *lines: str) -> None:
        if self.rank == 0:
            for line in lines:
                print(line, flush=True)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        """Checkpoint iteration ``step`` (collective). A refused save (non-finite values)
        stops the run; the previous checkpoint stays the latest."""
        from loggra_megatron.checkpointing import CheckpointError, save_checkpoint
        from loggra_megatron.checkpointing.layout import MODEL_ARGS, RUN_CONFIG

        root = self.cfg.checkpoint.save
        common = {
            "step": self.step,
            "model_args": self.model_args.to_dict(),
            **{name: c.state_dict() for name, c in self.stateful().items()},
        }
        run = {
            "flags": self.cfg.flags(),
            "step": self.step,
            "warmup_step": self.warmup.step,
            "rollout_engine": [self.experience.engine.name, self.experience.engine_note],
            "data": self.prompts.state_dict(),
            **self._tokenizer_identity,
        }
        policy, optimizer = self._training_models()
        try:
            save_checkpoint(
                root,
                self.step,
                [policy],
                optimizer,
                common,
                self._extra_models(),
                files={RUN_CONFIG: json.dumps(run, indent=1, default=str) + "\n"},
                checksums=self.cfg.checkpoint.checkpoint_checksums,
            )
        except CheckpointError as e:
            raise TrainingStopped(str(e)) from None
        if self.rank == 0:
            self.model_args.save_json(os.path.join(root, MODEL_ARGS))
        warmup = "" if self.warmup.done else f" (warm-up step {self.warmup.step})"
        self._log(f" saved checkpoint {root} at step {self.step}{warmup}")

    def _extra_models(self) -> dict | None:
        return {"reference": [self.reference]} if self.reference is not None else None

    def _load(self) -> None:
        """Load what ``cfg.start`` says: a full resume (into the warm-up's policy and
        optimizer when it was taken during the warm-up), or the policy's weights only. A
        warm-up still ahead starts from the RL policy's weights otherwise."""
        from loggra_megatron.checkpointing import CheckpointError, load_checkpoint
        from loggra_megatron.checkpointing.integrity import verified_checkpoint

        start = self.cfg.start
        if start.mode not in ("resume", "weights"):
            self._start_warmup_from_policy()
            return
        try:
            ref = start.checkpoint
            if self.cfg.checkpoint.checkpoint_checksums:  # a corrupted one: an older one
                ref = verified_checkpoint(ref)
                new = ref.warnings[len(start.checkpoint.warnings) :]
                self._log(*(f" --load: {w}" for w in new))
            if start.mode == "weights":  # the fp32 masters must follow the loaded weights
                load_checkpoint(ref, [self.policy], None, verify=False)
                self.optimizer.reload_model_params()
                self._start_warmup_from_policy()
                return
            sft_iters = self.cfg.training.sft_iters
            in_warmup = (ref.run_config() or {}).get("warmup_step", sft_iters) < sft_iters
            policy, optimizer = self.policy, self.optimizer
            if in_warmup:
                phase = self._warmup_phase()
                policy, optimizer = phase.policy, phase.optimizer
            common = load_checkpoint(
                ref, [policy], optimizer, extra_models=self._extra_models(), verify=False
            )
        except (CheckpointError, ValueError) as e:
            raise TrainingStopped(str(e)) from None
        self.step = common["step"]
        for name, component in self.stateful().items():
            if name in common:
                component.load_state_dict(common[name])
        if "warmup" not in common:  # older checkpoints: always taken after the warm-up
            self.warmup.step = self.cfg.training.sft_iters
        if not in_warmup:  # a warm-up ahead of a checkpoint that did not say so (older)
            self._start_warmup_from_policy()
        self._log(f" resumed from {ref.path} at step {self.step}")

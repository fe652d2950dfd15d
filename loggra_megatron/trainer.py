"""The RL training loop behind ``pretrain_rl.py``: GRPO/PPO on a Megatron-Core policy.

One RL step, on every rank of a DP × PP × TP grid:

1. each DP rank takes ``prompts_per_step / DP`` prompts and samples ``num_generations``
   completions per prompt with the policy's KV-cached generator (the same tokens on every
   TP/PP rank of a model replica);
2. rewards (``--reward-fn``) and group-normalised advantages are computed per DP rank
   (each prompt's group lives on one rank);
3. the sampling log-probs are the PPO "old" log-probs; the frozen reference model's
   log-probs are recomputed when ``--kl-coef > 0``;
4. ``ppo_epochs`` passes over the rollout in mini-batches of ``global_batch_size``
   sequences run Megatron's forward/backward schedule (1F1B under PP) with the GRPO loss
   normalised by the *global* mini-batch token count, then one optimizer step each,
   through predicted-KL control when ``--kl-target`` is set;
5. metrics go to ``metrics.jsonl`` (+ W&B / TensorBoard) from rank 0; checkpoints are
   written every ``--save-interval`` steps, at the end and on SIGTERM.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import time

import torch
import torch.distributed as dist

from loggra_megatron.arguments import RLConfig
from loggra_megatron.parallel import initialize_megatron
from loggra_megatron.preflight import Preflight

SUMMED_KEYS = ("optimizer/skipped_steps",)
"""Per-update metrics an RL step reports as totals over its updates (the others: means)."""


class TrainingStopped(RuntimeError):
    """The run cannot continue (raised on every rank alike); nothing was corrupted."""


REDUCED_KEYS = (
    "loss/total", "loss/policy", "loss/kl_ref", "kl/ref", "clip/fraction", "ratio/mean",
    "reward/mean", "reward/std", "reward/accuracy", "response/length_mean",
)  # fmt: skip


class RLTrainer:
    """Builds the policy, reference, optimizer, data and logger; runs the RL loop."""

    def __init__(self, cfg: RLConfig, host: Preflight):
        self.cfg, self.host = cfg, host
        self.step = 0
        """RL steps done (the checkpoint iteration)."""
        self.sft_step = 0
        """Supervised warm-up steps done."""
        self._sigterm = False
        self.consecutive_skips = 0
        self.skipped_steps_total = 0

    # ------------------------------------------------------------------ setup
    def setup(self) -> RLTrainer:
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from loggra_megatron.metrics import MetricsLogger
        from loggra_megatron.optim.megatron.stepper import MegatronStepper
        from loggra_megatron.rl import AdaptiveKLCoefficient

        cfg = self.cfg
        p = cfg.parallel
        self.device = initialize_megatron(
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            cfg.training.seed,
            p.device,
        )
        self.rank = dist.get_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if self.rank == 0:
            for note in self.host.notes:
                print(f" {note}", flush=True)
        self.tokenizer, self.reward_fn = self.host.tokenizer, self.host.reward_fn
        self.dataset = self.host.dataset
        self.model_args = self._model_args()
        self.policy = self._build_model(trainable=True)
        self.reference = self._build_model(trainable=False) if cfg.rl.kl_coef > 0 else None
        self.optimizer = self._build_optimizer()
        self.stepper = MegatronStepper(self.optimizer)
        t = cfg.training
        # Megatron's scheduler needs warm-up < decay (also for --train-iters 0 warm-up runs)
        decay_steps = max(self.optimizer_steps_per_rl_step * t.train_iters, t.lr_warmup_iters + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if t.lr_warmup_iters else t.lr, max_lr=t.lr,
            min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_iters,
            lr_decay_steps=decay_steps, lr_decay_style=t.lr_decay_style,
            start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=decay_steps,
            wd_incr_style="constant", override_opt_param_scheduler=True,
            use_checkpoint_opt_param_scheduler=False,
        )  # fmt: skip
        self.kl_coef = AdaptiveKLCoefficient(
            cfg.rl.kl_coef, kl_target=cfg.rl.kl_coef_target, horizon=cfg.rl.kl_coef_horizon
        )
        self.kl_controller = self._build_kl_controller()
        self._load()
        self.metrics = MetricsLogger(
            cfg.metrics_dir, rank=self.rank, total_steps=t.train_iters,
            wandb_project=cfg.logging.wandb_project, wandb_run_name=cfg.logging.wandb_run_name,
            tensorboard_dir=cfg.logging.tensorboard_dir, config=cfg.to_dict(),
        )  # fmt: skip
        self.metrics.truncate_after(self.step)  # a fresh run here continues nothing (preflight)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        rl = self.cfg.rl
        batches = rl.prompts_per_step * rl.num_generations // self.cfg.training.global_batch_size
        return batches * rl.ppo_epochs

    def _model_args(self):
        from loggra_megatron.convert.checkpoint import read_model_args
        from loggra_megatron.model import GPTModelArgs

        m, where = self.cfg.model, self.cfg.start.model_args_dir
        if where is not None:  # the vocabulary was checked against the tokenizer in preflight
            args = read_model_args(where)
            args.params_dtype = "bfloat16" if m.bf16 else "float32"
            return args
        return GPTModelArgs(
            num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_size,
            num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
            vocab_size=self.tokenizer.vocab_size, max_position_embeddings=m.seq_length,
            rotary_base=m.rotary_base, untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
            params_dtype="bfloat16" if m.bf16 else "float32", init_method_std=m.init_method_std,
            make_vocab_size_divisible_by=64,
        )  # fmt: skip

    def _use_te(self) -> bool:
        impl = self.cfg.model.transformer_impl
        if impl == "auto":
            try:
                import transformer_engine  # noqa: F401
            except ImportError:
                return False
            return self.device.type == "cuda"
        return impl == "transformer_engine"

    def _build_model(self, trainable: bool):
        from megatron.core.transformer.module import Float16Module

        from loggra_megatron.convert.checkpoint import load_megatron_checkpoint
        from loggra_megatron.model import build_gpt_model, wrap_ddp

        m = self.cfg.model
        overrides = dict(use_cpu_initialization=self.device.type == "cpu")
        if m.fp8_format:
            overrides.update(fp8=m.fp8_format, fp8_recipe=m.fp8_recipe)
        model = build_gpt_model(self.model_args, use_te=self._use_te(), **overrides)
        if self.cfg.start.mode == "converted":
            load_megatron_checkpoint(model, self.cfg.start.converted_dir)
        if m.bf16:
            model = Float16Module(model.config, model)
        if not trainable:
            model.eval().requires_grad_(False)
            return model
        ddp = self.cfg.training
        return wrap_ddp(
            model, use_distributed_optimizer=ddp.use_distributed_optimizer,
            overlap_grad_reduce=ddp.overlap_grad_reduce, overlap_param_gather=ddp.overlap_param_gather,
            grad_reduce_in_fp32=not ddp.grad_reduce_in_bf16,
        )  # fmt: skip

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from loggra_megatron.optim import LoGRAOptimizerConfig, get_loggra_optimizer

        t = self.cfg.training
        base = dict(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            clip_grad=t.clip_grad, bf16=self.cfg.model.bf16,
            use_distributed_optimizer=t.use_distributed_optimizer,
            overlap_param_gather_with_optimizer_step=False,
        )  # fmt: skip
        if t.optimizer == "adam":
            return get_megatron_optimizer(OptimizerConfig(**base), [self.policy])
        lg = self.cfg.loggra
        config = LoGRAOptimizerConfig(
            **base, loggra_rank=lg.loggra_rank, loggra_update_interval=lg.loggra_update_interval,
            loggra_projection=lg.loggra_projection, loggra_oversample=lg.loggra_oversample,
            loggra_power_iters=lg.loggra_power_iters, loggra_min_dim=lg.loggra_min_dim,
            loggra_seed=t.seed, loggra_fp32_grad_copy=lg.loggra_fp32_grad_copy,
        )  # fmt: skip
        return get_loggra_optimizer(config, [self.policy])

    def _build_kl_controller(self):
        from megatron.core import parallel_state as ps

        from loggra_megatron.kl_control import PredictedKLController, gpt_probe_forward

        if not self.cfg.kl_control.enabled:
            return None
        return PredictedKLController(
            self.cfg.kl_control, self.optimizer, gpt_probe_forward(self.policy),
            ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(),
            ps.get_pipeline_model_parallel_group(),
        )  # fmt: skip

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        cfg = self.cfg
        saved_at = self.step if self.cfg.start.resumes else None
        if self.sft_step < cfg.training.sft_iters:
            self.supervised_warmup()
            if self.sft_step == cfg.training.sft_iters:
                self._copy_policy_to_reference()
        elif not self.cfg.start.resumes:
            self._copy_policy_to_reference()
        while (
            self.sft_step == cfg.training.sft_iters
            and self.step < cfg.training.train_iters
            and not self._stop_requested()
        ):
            metrics = self.rl_step()
            self.step += 1
            self.metrics.log(self.step, metrics)
            interval = cfg.checkpoint.save_interval
            if cfg.checkpoint.save and interval and self.step % interval == 0:
                self.save()
                saved_at = self.step
        if cfg.checkpoint.save and (saved_at != self.step or self._sigterm):
            self.save()
        self.metrics.close()

    def _stop_requested(self) -> bool:
        """Whether SIGTERM reached any rank; every rank learns it at the same step boundary
        (one all-reduce), so all of them save and exit together."""
        flag = torch.tensor([float(self._sigterm)], device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and not self._sigterm:
            self._sigterm = True
            if self.rank == 0:
                print(" SIGTERM on another rank: saving and exiting", flush=True)
        return self._sigterm

    def rl_step(self) -> dict[str, float]:
        from loggra_megatron.data.prompts import prompt_ids
        from loggra_megatron.rewards import RewardFunctionError, compute_rewards
        from loggra_megatron.rl import group_advantages
        from loggra_megatron.rollout import compute_log_probs, generate_rollout

        cfg, rl, tok = self.cfg, self.cfg.rl, self.tokenizer
        t0 = time.perf_counter()
        examples = self._next_prompts()
        prompts = [prompt_ids(tok, e["prompt"]) for e in examples]
        repeated = [p for p in prompts for _ in range(rl.num_generations)]
        rollout = generate_rollout(
            self.policy, repeated, max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
            top_p=rl.top_p, eos_id=tok.eos, pad_id=tok.pad, seed=cfg.training.seed, step=self.step,
        )  # fmt: skip
        # Ids of padded vocabulary rows (TP / divisibility padding) have no piece: as
        # Megatron-LM's text generation does, they decode as unknown tokens.
        responses = rollout.tokens.masked_fill(rollout.tokens >= tok.vocab_size, tok.unk)
        completions = [
            tok.detokenize(row[int(p) : int(p) + int(n)].tolist())
            for row, p, n in zip(
                responses, rollout.prompt_lengths, rollout.response_lengths, strict=True
            )
        ]
        group = [e for e in examples for _ in range(rl.num_generations)]
        args = ([e["prompt"] for e in group], completions, [e["answer"] for e in group])
        try:
            rewards, correct = compute_rewards(
                self.reward_fn, *args, [e["metadata"] for e in group], rl.accuracy_threshold
            )
        except RewardFunctionError as e:
            where = f" at RL step {self.step + 1} (dataset prompt index {group[e.index]['index']})"
            raise e.at(where) from None
        rewards = torch.tensor(rewards)
        advantages = group_advantages(
            rewards, rl.num_generations, normalize_std=not rl.no_advantage_std_normalization
        )
        ref_logp = None
        if self.reference is not None:
            ref_logp = compute_log_probs(self.reference, rollout.tokens)
        t_rollout = time.perf_counter() - t0

        t1 = time.perf_counter()
        train_metrics = self._ppo_updates(rollout, advantages, ref_logp)
        t_train = time.perf_counter() - t1
        local = {
            **train_metrics,
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "reward/accuracy": sum(correct) / len(correct),
            "response/length_mean": rollout.response_lengths.float().mean().item(),
        }
        metrics = self._reduce_metrics(local)
        if self.kl_coef.adaptive and math.isfinite(metrics.get("kl/ref", math.nan)):
            self.kl_coef.update(metrics["kl/ref"], n_steps=rl.prompts_per_step * rl.num_generations)
        step_time = time.perf_counter() - t0
        tokens = rollout.token_mask.sum().to(torch.float64)
        if self.dp > 1:
            dist.all_reduce(tokens, group=self._dp_group())
        metrics.update(self._memory_metrics())
        metrics.update({
            "kl/coef": self.kl_coef.value, "lr": self.optimizer.param_groups[0]["lr"],
            "optimizer/skipped_steps_total": float(self.skipped_steps_total),
            "data/dropped_prompts": float(self.host.dropped_prompts),
            "time/step_s": step_time, "time/rollout_s": t_rollout, "time/train_s": t_train,
            "throughput/tokens_per_s": float(tokens) / step_time,
        })  # fmt: skip
        return metrics

    # ------------------------------------------------------------------ updates
    def _next_prompts(self) -> list[dict]:
        """This DP rank's prompts of the next RL step (resumable via the dataset state)."""
        if not hasattr(self, "_batches"):
            self._batches = self.dataset.batches(
                self.cfg.rl.prompts_per_step, dp_rank=self.dp_rank, dp_size=self.dp
            )
        return next(self._batches)

    def _dp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def _ppo_updates(self, rollout, advantages, ref_logp) -> dict[str, float]:
        from loggra_megatron.rl.actor import (
            combine_micro_metrics,
            forward_backward,
            global_counts,
            grpo_loss_fn,
            split_micro,
        )

        rl, t = self.cfg.rl, self.cfg.training
        dev = self.device
        data = {
            "tokens": rollout.tokens.to(dev), "mask": rollout.response_mask.to(dev),
            "old": rollout.log_probs.to(dev), "adv": advantages.to(dev),
        }  # fmt: skip
        if ref_logp is not None:
            data["ref"] = ref_logp.to(dev)
        per_step = t.global_batch_size // self.dp
        sums, n = {}, 0
        for _ in range(rl.ppo_epochs):
            for start in range(0, len(data["tokens"]), per_step):
                mini = {k: v[start : start + per_step] for k, v in data.items()}
                n_tok, n_seq = global_counts(mini["mask"], per_step, self._dp_group())
                loss_fn = grpo_loss_fn(rl, self.kl_coef.value, n_tok, n_seq)
                outs = forward_backward(
                    self.policy, self.optimizer, split_micro(mini, t.micro_batch_size), loss_fn,
                    t.micro_batch_size, self.dp,
                )  # fmt: skip
                step_metrics = self._optimizer_step(mini)
                for key, value in combine_micro_metrics(outs, self.dp).items():
                    sums[key] = sums.get(key, 0.0) + value
                for key, value in step_metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                n += 1
        # means over the optimizer updates, except the count of skipped ones
        return {k: v if k in SUMMED_KEYS else v / n for k, v in sums.items()}

    def _optimizer_step(self, mini: dict) -> dict[str, float]:
        if self.kl_controller is None:
            prepared = self.stepper.step()
            ok, grad_norm, metrics = prepared.ok, prepared.grad_norm, {}
        else:
            probe, holdout = self.kl_controller.config.probe_split(len(mini["tokens"]))
            result = self.kl_controller.step(
                (mini["tokens"][probe], mini["mask"][probe]),
                (mini["tokens"][holdout], mini["mask"][holdout]) if holdout.stop > holdout.start else None,
            )  # fmt: skip
            ok, grad_norm, metrics = result.update_successful, result.grad_norm, result.metrics
        self._count_update(ok, grad_norm)
        if ok:
            self.scheduler.step(1)
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        metrics["optimizer/skipped_steps"] = 0.0 if ok else 1.0
        if grad_norm is not None:
            metrics["grad/norm"] = float(grad_norm)
        return metrics

    def _count_update(self, ok: bool, grad_norm: float | None) -> None:
        """Count a skipped optimizer step; stop the run after too many in a row (every rank
        takes the same decision: the grad norm and the KL are global)."""
        if ok:
            self.consecutive_skips = 0
            return
        self.consecutive_skips += 1
        self.skipped_steps_total += 1
        limit = self.cfg.training.max_consecutive_skipped_steps
        if limit and self.consecutive_skips >= limit:
            raise TrainingStopped(
                f"{self.consecutive_skips} consecutive optimizer steps were skipped (non-finite "
                f"gradient norm or predicted KL; last grad norm {grad_norm}) at RL step "
                f"{self.step + 1}. Weights, optimizer state and checkpoints are unchanged since "
                "the last good step. Lower --lr, check --kl-coef and the reward, or raise "
                "--max-consecutive-skipped-steps."
            )

    def _reduce_metrics(self, local: dict[str, float]) -> dict[str, float]:
        """Means over DP of the per-rank metrics; the loss terms live on the last PP stage
        and are summed over PP (other stages contribute zeros)."""
        from megatron.core import parallel_state as ps

        keys = set(REDUCED_KEYS) | set(local)
        pp_group = ps.get_pipeline_model_parallel_group()
        if dist.get_world_size(pp_group) > 1:  # the loss keys exist on the last stage only
            gathered = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(gathered, sorted(keys), group=pp_group)
            keys = set().union(*gathered)
        keys = sorted(keys)
        values = torch.tensor([float(local.get(k, 0.0)) for k in keys], dtype=torch.float64)
        present = torch.tensor([float(k in local) for k in keys], dtype=torch.float64)
        stacked = torch.stack([values, present])
        for group in (pp_group, self._dp_group()):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(stacked, group=group)
        return {
            k: float(stacked[0, i] / stacked[1, i]) for i, k in enumerate(keys) if stacked[1, i] > 0
        }

    def _memory_metrics(self) -> dict[str, float]:
        from loggra_megatron.optim import state_bytes

        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated()
        else:  # CPU: the process's peak resident set size (KiB on Linux)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "memory/optimizer_state_bytes": float(state_bytes(self.optimizer)),
            "memory/peak_bytes": float(peak),
        }

    # ------------------------------------------------------------------ warm-up
    def supervised_warmup(self) -> None:
        """``--sft-iters`` steps of next-token training on the tasks' reference solutions
        (prompt tokens masked out), so that a model trained from scratch can earn rewards.
        Continues from ``sft_step``; returns early (state intact) when a stop is requested."""
        from loggra_megatron.data.prompts import format_completion, prompt_ids
        from loggra_megatron.rl.actor import (
            combine_micro_metrics,
            forward_backward,
            global_counts,
            sft_loss_fn,
            split_micro,
        )

        t, tok = self.cfg.training, self.tokenizer
        lr = t.sft_lr if t.sft_lr is not None else t.lr
        per_step, mbs = t.global_batch_size // self.dp, t.micro_batch_size
        batches = self.dataset.batches(t.global_batch_size, dp_rank=self.dp_rank, dp_size=self.dp)
        width = self.cfg.model.seq_length
        while self.sft_step < t.sft_iters:
            if self._stop_requested():
                return
            examples = next(batches)
            tokens = torch.full((per_step, width + 1), tok.pad, dtype=torch.long)
            mask = torch.zeros(per_step, width, dtype=torch.bool)
            for i, e in enumerate(examples):
                prompt = prompt_ids(tok, e["prompt"])
                answer = tok.tokenize(format_completion(e["answer"], e["metadata"].get("solution")))
                ids = (prompt + answer + [tok.eos])[: width + 1]
                tokens[i, : len(ids)] = torch.tensor(ids)
                mask[i, len(prompt) - 1 : len(ids) - 1] = True
            tokens, mask = tokens.to(self.device), mask.to(self.device)
            n_tok, _ = global_counts(mask, per_step, self._dp_group())
            micro = split_micro({"tokens": tokens, "mask": mask}, mbs)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            outs = forward_backward(self.policy, self.optimizer, micro, sft_loss_fn(n_tok), mbs,
                                    self.dp)  # fmt: skip
            prepared = self.stepper.step()
            self._count_update(prepared.ok, prepared.grad_norm)
            self.sft_step += 1
            loss = combine_micro_metrics(outs, self.dp).get("loss/sft")
            if self.rank == 0 and loss is not None and self.sft_step % 10 == 0:
                print(f" sft {self.sft_step:5d}/{t.sft_iters} | loss {loss:.4f}", flush=True)
        self.dataset.consumed_samples = 0  # RL starts from the beginning of the prompt stream
        self.scheduler.step(0)  # restore the RL learning rate

    def _copy_policy_to_reference(self) -> None:
        """The reference model is the policy as RL starts (after any warm-up)."""
        if self.reference is None:
            return
        with torch.no_grad():
            policy = dict(self.policy.module.named_parameters())
            for name, p in self.reference.named_parameters():
                p.copy_(policy[name])

    # ------------------------------------------------------------------ checkpoints
    def _common_state(self) -> dict:
        state = {
            "step": self.step,
            "sft_step": self.sft_step,
            "data": self.dataset.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "kl_coef": self.kl_coef.state_dict(),
            "model_args": self.model_args.to_dict(),
            "skipped_steps": {
                "total": self.skipped_steps_total, "consecutive": self.consecutive_skips,
            },
        }  # fmt: skip
        if self.kl_controller is not None:
            state["kl_controller"] = {
                "num_steps": self.kl_controller.num_steps,
                "num_skipped_steps": self.kl_controller.num_skipped_steps,
            }
        return state

    def save(self) -> None:
        """Checkpoint iteration ``step`` (collective). A refused save (non-finite values)
        stops the run; the previous checkpoint stays the latest."""
        from loggra_megatron.checkpointing import CheckpointError, save_checkpoint
        from loggra_megatron.checkpointing.layout import MODEL_ARGS, RUN_CONFIG

        root = self.cfg.checkpoint.save
        models = {"reference": [self.reference]} if self.reference is not None else None
        run = {"config": self.cfg.to_dict(), "step": self.step, "sft_step": self.sft_step,
               "data": self.dataset.state_dict()}  # fmt: skip
        try:
            save_checkpoint(
                root, self.step, [self.policy], self.optimizer, self._common_state(), models,
                files={RUN_CONFIG: json.dumps(run, indent=1, default=str) + "\n"},
                checksums=self.cfg.checkpoint.checkpoint_checksums,
            )  # fmt: skip
        except CheckpointError as e:
            raise TrainingStopped(str(e)) from None
        if self.rank == 0:
            self.model_args.save_json(os.path.join(root, MODEL_ARGS))
            what = f"step {self.step}" + (
                f" (warm-up step {self.sft_step})" if self.sft_step < self.cfg.training.sft_iters
                else ""
            )  # fmt: skip
            print(f" saved checkpoint {root} at {what}", flush=True)

    def _load(self) -> None:
        """Load what ``cfg.start`` says: a full resume, or the policy's weights only."""
        from loggra_megatron.checkpointing import CheckpointError, load_checkpoint

        start, verify = self.cfg.start, self.cfg.checkpoint.checkpoint_checksums
        if start.mode not in ("resume", "weights"):
            return
        try:
            if start.mode == "weights":  # the fp32 masters must follow the loaded weights
                load_checkpoint(start.checkpoint, [self.policy], None, verify=verify)
                self.optimizer.reload_model_params()
                return
            models = {"reference": [self.reference]} if self.reference is not None else None
            common = load_checkpoint(
                start.checkpoint, [self.policy], self.optimizer, extra_models=models, verify=verify
            )
        except (CheckpointError, ValueError) as e:
            raise TrainingStopped(str(e)) from None
        self.step = common["step"]
        self.sft_step = common.get("sft_step", self.cfg.training.sft_iters)
        self.dataset.load_state_dict(common["data"])
        self.scheduler.load_state_dict(common["scheduler"])
        self.kl_coef.load_state_dict(common["kl_coef"])
        skips = common.get("skipped_steps", {"total": 0, "consecutive": 0})
        self.skipped_steps_total, self.consecutive_skips = skips["total"], skips["consecutive"]
        if self.kl_controller is not None and "kl_controller" in common:
            self.kl_controller.num_steps = common["kl_controller"]["num_steps"]
            self.kl_controller.num_skipped_steps = common["kl_controller"]["num_skipped_steps"]
        if self.rank == 0:
            print(f" resumed from {start.checkpoint.path} at step {self.step}", flush=True)

    def _on_sigterm(self, signum, frame) -> None:
        print(f" SIGTERM on rank {self.rank}: saving at the next step boundary", flush=True)
        self._sigterm = True

"""What ``--load`` / ``--save`` mean for a run, decided before any process group starts.

``plan_start`` (then ``check_resume``) reads only small files (tracker,
manifests, ``run_config.json``, ``loggra_model_args.json``) and the pickles of the checkpoint
(``pickles.check_pickles``: a crafted one is refused) and returns a
``StartPlan``, or raises ``ConfigError`` (exit status 2)
with one sentence. The plan is **fresh** (no ``--load``, or the first launch of an
auto-resume script), **resume** (a trainer checkpoint: architecture adopted or checked, the
settings the saved state depends on unchanged, schedule flags following the new values),
**weights** (``--no-load-optim``: the policy's weights only) or **converted** (a model from
``tools/convert_checkpoint.py``). Nothing is overwritten or appended to: a ``--save`` that
holds another run's checkpoint or a converted model, or an output directory with another
run's ``metrics.jsonl``, is refused.

Every situation and its result: docs/checkpointing.md#what---load-and---save-mean.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from loggra_megatron.checkpointing.config import CheckpointConfig
from loggra_megatron.checkpointing.layout import (
    MODEL_ARGS,
    RELEASE,
    TRACKER,
    CheckpointRef,
    has_checkpoint,
    holds_converted_model,
    latest_iteration,
    select_model_checkpoint,
    tracker_note,
)
from loggra_megatron.checkpointing.pickles import UnsafeCheckpointError, check_pickles
from loggra_megatron.config import ConfigError
from loggra_megatron.metrics import LoggingConfig
from loggra_megatron.model.config import ARCHITECTURE, ModelConfig
from loggra_megatron.tasks import TASKS
from loggra_megatron.tasks.flags import data_defining_flags, flag_defaults

STATE_DEFINING = (
    "bf16",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "optimizer",
    "use_distributed_optimizer",
    "seed",
    "data_path",
    "task",
    "num_tasks",
    *data_defining_flags(TASKS),
)
"""Flags the saved optimizer state, reference model or data position depend on (the knobs
of the generated tasks among them)."""

SKETCH_DEFINING = ("loggra_sketch", "loggra_rank", "loggra_projection", "loggra_min_dim")
"""Flags the shapes of a sketching optimizer's saved state depend on."""
BACKWARD_SKETCH_DEFINING = (
    "loggra_seed",
    "loggra_targets",
    "loggra_row_optimizer",
    "loggra_sketch_matrix",
    "loggra_refresh_interval",
    "freeze_non_targets",
)
"""Flags the backward sketch's state depends on besides: its projection is drawn again from
the seed, the matrix kind and the refresh interval (never saved), the targets own the state,
RowAdam's state is SGD's (none), and frozen non-targets have no dense optimizer state."""

ADOPTED_ON_RESUME = ("loggra_sketch",)
"""Settings a resume takes from the checkpoint where the command line does not give them:
the mode its optimizer state was written in, whatever the default is now."""

SCHEDULE = (
    "train_iters",
    "lr",
    "min_lr",
    "lr_warmup_iters",
    "lr_decay_style",
    "weight_decay",
    "global_batch_size",
    "prompts_per_step",
    "num_generations",
    "ppo_epochs",
)
"""Flags that shape the LR schedule; on resume they follow the new values."""

NOT_COMPARED = ("save", "load", "ckpt_step", "no_load_optim", "output_dir", "wandb_run_name")
"""Flags that name where a run reads and writes, not what it computes."""


@dataclass
class StartPlan:
    """How this run starts (see the module docstring)."""

    mode: str = "fresh"
    """``fresh`` | ``resume`` | ``weights`` | ``converted``."""
    checkpoint: CheckpointRef | None = None
    """The checkpoint to load (``resume`` / ``weights``; ``converted``: its ``release``)."""
    notes: list[str] = field(default_factory=list)
    """Warnings and changed flags, printed once by rank 0."""
    seen: dict[str, tuple] = field(default_factory=dict)
    """The state of each directory the run writes when the plan was made (see
    ``checkpointing.run_lock``)."""

    @property
    def resumes(self) -> bool:
        return self.mode == "resume"

    @property
    def model_args_dir(self) -> str | None:
        """Where the architecture file of the model to load lives."""
        return self.checkpoint.root if self.checkpoint is not None else None


def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def plan_start(
    checkpoint: CheckpointConfig, logging: LoggingConfig, model: ModelConfig, explicit: set[str]
) -> StartPlan:
    """Decide how the run starts; adopt the checkpoint's architecture into ``model`` (flags
    named in ``explicit`` must agree with it). Raises ``ConfigError``. The plan records the
    state of the directories the run writes (``seen``), which the run checks again once it
    holds their run lock."""
    from loggra_megatron.checkpointing.run_lock import directory_state, written_directories

    written = written_directories(checkpoint, logging)
    for directory, flag in written.items():
        _check_writable(flag, directory)
    plan = _plan_start(checkpoint, logging.metrics_dir(checkpoint.save), model, explicit)
    plan.seen = {d: directory_state(d) for d in written}
    return plan


def _plan_start(
    ck: CheckpointConfig, metrics_dir: str, model: ModelConfig, explicit: set[str]
) -> StartPlan:
    load, save = ck.load, ck.save
    auto_resume = _same_dir(load, save)
    if save is not None and holds_converted_model(save):
        raise ConfigError(
            f"--save {save!r} holds a converted model (tools/convert_checkpoint.py); a run's "
            f"first save would replace its {TRACKER}. Load it with --load {save} and give "
            "--save another directory (relaunch with --load set to that directory)"
        )
    if save is not None and has_checkpoint(save) and not auto_resume:
        raise ConfigError(
            f"--save {save!r} already holds a checkpoint of another run "
            f"({_tracked(save)}); pass --load {save} to resume it, or choose another --save "
            "directory"
        )
    if load is None or (auto_resume and not has_checkpoint(load)):
        if ck.ckpt_step is not None:
            raise ConfigError(f"--ckpt-step {ck.ckpt_step}: there is no checkpoint to load")
        _check_metrics_file(metrics_dir, continues=auto_resume)
        return StartPlan("fresh")
    if auto_resume and ck.no_load_optim:
        raise ConfigError(
            "--no-load-optim starts a new run from the loaded weights: give it a --save "
            f"directory other than --load {load!r}"
        )
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load!r}: no such directory")
    converted = not has_checkpoint(load)
    if converted and not holds_converted_model(load):
        raise ConfigError(
            f"--load {load!r} holds neither a pretrain_rl.py checkpoint ({tracker_note(load)}, "
            f"no complete iter_* directory) nor a converted model (no {RELEASE} directory; "
            "convert one with tools/convert_checkpoint.py)"
        )
    try:
        ref = select_model_checkpoint(load, ck.ckpt_step)
        check_pickles(ref.path)  # a crafted file is refused here, before any process group
    except (FileNotFoundError, UnsafeCheckpointError) as e:
        raise ConfigError(f"--load {load!r}: {e}") from None
    if converted:
        plan = StartPlan("converted", checkpoint=ref)
    else:
        plan = StartPlan("weights" if ck.no_load_optim else "resume", checkpoint=ref)
    plan.notes += [f"--load: {w}" for w in ref.warnings]
    _check_metrics_file(metrics_dir, continues=plan.resumes)
    _adopt_architecture(model, load, explicit)
    return plan


def _tracked(root: str) -> str:
    iteration = latest_iteration(root)
    return f"iteration {iteration}" if iteration is not None else tracker_note(root)


def _check_writable(flag: str, path: str) -> None:
    """``path`` is a writable directory, or can be made one (its nearest existing ancestor
    is a writable directory): found here, not at the first save after training ran."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is a file" if existing == os.path.abspath(path) else f"is under the file {existing}"
        raise ConfigError(f"{flag} {path!r} {what}, not a directory; give a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag} {path!r}: {existing} is not writable by this user; choose a writable directory"
        )


def check_resume(now: dict, plan: StartPlan) -> None:
    """On a full resume: refuse changed state-defining settings, note every changed flag;
    ``now``: every flag's value (``RunConfig.flags()``, after the derived defaults are filled
    in). Raises ``ConfigError``."""
    try:
        saved = plan.checkpoint.run_config() if plan.resumes else None
    except ValueError as e:
        raise ConfigError(f"--load: {e}; resume an earlier iteration with --ckpt-step") from None
    if saved is None:  # weights only, or a checkpoint older than run_config.json
        return
    flags = _with_task_defaults(saved["flags"])
    _check_state_settings(now, flags)
    plan.notes += _changed_settings(now, flags)


def _with_task_defaults(saved: dict) -> dict:
    """``saved`` with each task flag an older run recorded as None (when the flags had no
    default of their own and the task's knob default applied) as that default: today's
    flag default, the same value."""
    defaults = flag_defaults(TASKS)
    return {**saved, **{k: d for k, d in defaults.items() if k in saved and saved[k] is None}}


def adopt_saved_settings(sections: dict, plan: StartPlan, explicit: set[str]) -> list[str]:
    """On a full resume: each of ``ADOPTED_ON_RESUME`` that was not given takes the
    checkpoint's value (in whichever section of ``sections`` owns it); returns a note for
    each. Raises ``ConfigError`` for an unreadable ``run_config.json``."""
    try:
        saved = plan.checkpoint.run_config() if plan.resumes else None
    except ValueError as e:
        raise ConfigError(f"--load: {e}; resume an earlier iteration with --ckpt-step") from None
    notes = []
    for name in ADOPTED_ON_RESUME if saved is not None else ():
        if name in explicit or name not in saved["flags"]:
            continue
        for settings in sections.values():
            if hasattr(settings, name) and getattr(settings, name) != saved["flags"][name]:
                setattr(settings, name, saved["flags"][name])
                notes.append(
                    f"resume: {_flag(name)} {saved['flags'][name]} (the checkpoint's; give "
                    f"{_flag(name)} to choose)"
                )
    return notes


def _check_metrics_file(metrics_dir: str, continues: bool) -> None:
    """A run that does not continue the run in its output directory must not append to (or
    truncate) that run's ``metrics.jsonl``."""
    from loggra_megatron.metrics import METRICS_FILE

    path = os.path.join(metrics_dir, METRICS_FILE)
    if not continues and os.path.isfile(path) and os.path.getsize(path) > 0:
        raise ConfigError(
            f"--output-dir: {path} holds the metrics of another run; choose another "
            "--output-dir (or --save), or pass --load to resume that run"
        )


def _adopt_architecture(m: ModelConfig, load: str, explicit: set[str]) -> None:
    from loggra_megatron.model.args import GPTModelArgs

    path = os.path.join(load, MODEL_ARGS)
    if not os.path.isfile(path):
        raise ConfigError(f"--load {load!r}: {MODEL_ARGS} is missing (the architecture)")
    try:
        args = GPTModelArgs.load_json(path)
    except ValueError as e:
        raise ConfigError(f"--load {load!r}: {e}") from None
    saved = {name: getattr(args, name) for name in ARCHITECTURE}
    heads = saved["num_attention_heads"]
    mismatches = []
    for name, value in saved.items():
        given = getattr(m, name)
        if name == "num_query_groups":  # None means one group per head on both sides
            value, given = value or heads, given or m.num_attention_heads
        if name in explicit and given != value:
            mismatches.append(f"{_flag(name)} {given} (checkpoint: {value})")
    if mismatches:
        raise ConfigError(
            f"--load {load!r}: the model flags differ from the checkpoint's architecture: "
            f"{', '.join(mismatches)}; drop them to use the checkpoint's, or start a new run"
        )
    for name, value in saved.items():
        setattr(m, name, value)


def _check_state_settings(now: dict, saved: dict) -> None:
    from loggra_megatron.optim.registry import OPTIMIZERS, backward_sketch

    sketched = OPTIMIZERS[now["optimizer"]].sketched
    backward = backward_sketch(now["optimizer"], now["loggra_sketch"])
    names = (
        STATE_DEFINING
        + (SKETCH_DEFINING if sketched else ())
        + (BACKWARD_SKETCH_DEFINING if backward else ())
    )
    for name in names:
        if now[name] != saved.get(name, now[name]):
            raise ConfigError(
                f"{_flag(name)}: the checkpoint was saved with {_flag(name)} {saved[name]}, "
                f"this run has {now[name]}; its optimizer state, reference model or data "
                "position depend on it. Resume with the same value, or load the weights only "
                "with --no-load-optim"
            )
    had_reference, has_reference = saved["kl_coef"] > 0, now["kl_coef"] > 0
    if had_reference != has_reference:
        raise ConfigError(
            f"--kl-coef: the checkpoint was saved with --kl-coef {saved['kl_coef']} "
            f"(reference model: {'yes' if had_reference else 'no'}), this run has "
            f"{now['kl_coef']}; a reference model cannot be added or dropped on resume. Keep "
            "--kl-coef on the same side of 0, or load the weights only with --no-load-optim"
        )


def _changed_settings(now: dict, saved: dict) -> list[str]:
    """One note per changed flag; the schedule flags are marked as followed."""
    notes = []
    for name, then in saved.items():
        if name in NOT_COMPARED or name not in now or now[name] == then:
            continue
        note = f"{_flag(name)} {then} -> {now[name]}"
        if name in SCHEDULE:
            note += " (the LR schedule follows the new value)"
        notes.append(f"resume: {note}")
    return notes

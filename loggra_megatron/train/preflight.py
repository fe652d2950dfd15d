"""What ``pretrain_rl.py`` loads and checks before any process group starts.

``preflight`` returns the host-side parts of a run, or raises
``ConfigError`` (exit status 2, nothing started or written):

* the tokenizer (``--tokenizer-type``, ``--tokenizer-model``), checked against the vocabulary
  of the model in ``--load``, and how prompts are rendered (its chat template or the task's
  plain template; ``--system-prompt`` needs the chat template);
* the task (``--task``) and its scoring: the task's reward and verdict, or ``--reward-fn``
  (the user's module is imported here); without ``--reward-fn`` every reference answer
  must be one the task's scoring can read;
* the prompt dataset (``--data-path`` or a task generator) and the held-out one
  (``--eval-data-path``). Every prompt is rendered here: a chat template that fails on one,
  or renders it as nothing, is reported with the prompt's ``file:line``. Prompts whose
  tokens leave no room for ``--max-new-tokens`` within ``--seq-length`` are dropped here,
  counted (``data/dropped_prompts``) and reported, so that no sequence ever exceeds the
  budget;
* on resume, that the dataset is the one the checkpoint's data position belongs to (its
  size, seed and a fingerprint of its contents).

It also notes (a warning, the run goes on) a CUDA run whose allocator and NCCL environment
is not ``ESTIMATED_ENVIRONMENT``, what the memory estimator's verdicts assume
(``environment_note``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from loggra_megatron.config import ConfigError
from loggra_megatron.data.config import DataConfig
from loggra_megatron.data.prompts import PromptDataset, PromptRenderer
from loggra_megatron.data.tokenizer import Tokenizer
from loggra_megatron.library_notes import missing_extras_note
from loggra_megatron.megatron_version import untested_version_note
from loggra_megatron.tasks import TASKS, Task
from loggra_megatron.tasks.scoring import Scoring
from loggra_megatron.train.run_config import RunConfig


@dataclass
class Preflight:
    """The host-side parts of a run."""

    tokenizer: Tokenizer
    task: Task
    renderer: PromptRenderer
    """Prompt → token ids."""
    scoring: Scoring
    dataset: PromptDataset
    """The prompt dataset, prompts over the length budget removed."""
    dropped_prompts: int
    """How many prompts were removed for length."""
    eval_dataset: PromptDataset | None = None
    notes: list[str] = field(default_factory=list)
    """Messages for rank 0 to print (resume notes, dropped prompts)."""


def preflight(cfg: RunConfig) -> Preflight:
    d = cfg.data
    if cfg.logging.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "--tensorboard-dir: the 'tensorboard' package is not installed "
            "(`pip install tensorboard`), or drop --tensorboard-dir"
        )
    tokenizer = _tokenizer(cfg)
    try:
        task = TASKS[d.task](**cfg.task.knobs(d.task))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--task {d.task}: {e}") from None
    chat = tokenizer.has_chat_template if d.apply_chat_template is None else d.apply_chat_template
    if chat and not tokenizer.has_chat_template:
        raise ConfigError(f"--apply-chat-template: {d.tokenizer_model!r} has no chat template")
    if d.system_prompt is not None and not chat:
        raise ConfigError(
            "--system-prompt: applies with a chat template only (--tokenizer-model "
            f"{d.tokenizer_model!r} has none, or --no-apply-chat-template); drop it"
        )
    renderer = PromptRenderer(tokenizer, task, chat, d.system_prompt)
    scoring = _scoring(d, task)
    notes = list(cfg.start.notes)
    extras_note = missing_extras_note()
    if extras_note is not None:
        notes.append(extras_note)
    version_note = untested_version_note()
    if version_note is not None:
        notes.insert(0, version_note)
    env_note = environment_note(os.environ, cfg.parallel.uses_cuda(torch.cuda.is_available()))
    if env_note is not None:
        notes.insert(0, env_note)
    dataset, dropped = _prompts(cfg, renderer, d.data_path, notes, "data")
    eval_dataset = None
    if d.eval_data_path is not None:
        eval_dataset, _ = _prompts(cfg, renderer, d.eval_data_path, notes, "eval data")
    _check_data_position(cfg, dataset)
    return Preflight(tokenizer, task, renderer, scoring, dataset, dropped, eval_dataset, notes)


ESTIMATED_ENVIRONMENT = {
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "NCCL_NVLS_ENABLE": "0",
}
"""The allocator and NCCL settings behind the memory estimator's verdicts in docs/memory.md
(``tools/estimate_memory.py --expandable-segments --no-nccl-nvls``) and exported by the
launch scripts: no second KV-cache segment pinned by fragmentation, no NVLS buffers."""


def environment_note(env: Mapping[str, str], cuda: bool) -> str | None:
    """A warning when a CUDA run's ``env`` differs from ``ESTIMATED_ENVIRONMENT``, else
    None. The allocator reads ``PYTORCH_ALLOC_CONF`` where set (PyTorch's newer name), else
    ``PYTORCH_CUDA_ALLOC_CONF``."""
    if not cuda:
        return None
    differs = []
    name = _alloc_conf_name(env)
    if not expandable_segments(env):
        differs.append(f"{name}={env[name]!r}" if name in env else f"{name} unset")
    if nccl_nvls(env):
        nvls = env.get("NCCL_NVLS_ENABLE")
        differs.append("NCCL_NVLS_ENABLE unset" if nvls is None else f"NCCL_NVLS_ENABLE={nvls!r}")
    if not differs:
        return None
    wanted = " ".join(f"{k}={v}" for k, v in ESTIMATED_ENVIRONMENT.items())
    return (
        f"warning: {' and '.join(differs)}: the memory estimator's verdicts (docs/memory.md) "
        f"assume {wanted}; without them this run may need more memory than estimated (a freed "
        "KV cache's segment pinned, NCCL's NVLS buffers): export them, or estimate this "
        "environment (tools/estimate_memory.py without --expandable-segments or --no-nccl-nvls)"
    )


def nccl_nvls(env: Mapping[str, str]) -> bool:
    """NCCL may allocate NVLS buffers: ``NCCL_NVLS_ENABLE`` is not ``0`` in ``env``."""
    return env.get("NCCL_NVLS_ENABLE") != "0"


def _alloc_conf_name(env: Mapping[str, str]) -> str:
    return "PYTORCH_ALLOC_CONF" if "PYTORCH_ALLOC_CONF" in env else "PYTORCH_CUDA_ALLOC_CONF"


def expandable_segments(env: Mapping[str, str]) -> bool:
    """The allocator configuration of ``env`` (``PYTORCH_ALLOC_CONF`` where set, else
    ``PYTORCH_CUDA_ALLOC_CONF``: ``option:value`` pairs, comma-separated, spaces ignored)
    turns expandable segments on: its last ``expandable_segments`` is ``True``."""
    conf = env.get(_alloc_conf_name(env), "")
    pairs = (pair.partition(":") for pair in conf.replace(" ", "").split(","))
    values = [value for option, _, value in pairs if option == "expandable_segments"]
    return values[-1:] == ["True"]


def _tokenizer(cfg: RunConfig) -> Tokenizer:
    from loggra_megatron.data.tokenizer import load_tokenizer

    d = cfg.data
    try:
        tokenizer = load_tokenizer(d.tokenizer_model, d.tokenizer_type)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    _check_vocab(cfg, tokenizer)
    return tokenizer


def _scoring(d: DataConfig, task: Task) -> Scoring:
    """The task's scoring, or ``--reward-fn``'s: a built-in in this process, a user function
    in worker processes (``tasks.reward_workers``)."""
    from loggra_megatron.tasks.reward_workers import RewardWorkers
    from loggra_megatron.tasks.rewards import BUILTIN_REWARDS, RewardSpecError, load_reward_fn

    errors = d.reward_max_error_fraction
    if d.reward_fn is None:
        return Scoring(task.reward, task.is_correct, d.accuracy_threshold, errors)
    try:
        fn = load_reward_fn(d.reward_fn)
    except RewardSpecError as e:
        raise ConfigError(str(e)) from None
    workers = None
    if d.reward_fn not in BUILTIN_REWARDS:
        workers = RewardWorkers(d.reward_fn, d.reward_workers, d.reward_timeout)
    return Scoring(fn, None, d.accuracy_threshold, errors, workers)


def _prompts(
    cfg: RunConfig, renderer: PromptRenderer, spec: str | None, notes: list[str], what: str
) -> tuple[PromptDataset, int]:
    """The dataset of ``spec`` (files) or of the task generator, prompts over budget dropped."""
    from loggra_megatron.data.prompts import DatasetFormatError

    d, seed = cfg.data, cfg.training.seed
    flag = "--eval-data-path" if what == "eval data" else "--data-path"
    try:
        dataset = (
            PromptDataset.from_files(
                spec, seed=seed, prompt_key=d.prompt_key, answer_key=d.answer_key
            )
            if spec is not None
            else PromptDataset.builtin(d.task, d.num_tasks, seed, **cfg.task.knobs(d.task))
        )
    except (DatasetFormatError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{flag if spec else '--task'}: {e}") from None
    if not renderer.chat and any(not isinstance(e["prompt"], str) for e in dataset.examples):
        raise ConfigError(
            f"{flag}: chat-message prompts need --apply-chat-template (a tokenizer "
            "with a chat template)"
        )
    flag = flag if spec else "--task"
    if d.reward_fn is None:
        _check_answers(renderer.task, dataset, flag)
    lengths = [_prompt_length(renderer, dataset, i, flag) for i in range(len(dataset))]
    budget = cfg.model.seq_length - cfg.rollout.max_new_tokens
    longest = max(lengths)
    try:
        dataset, dropped = dataset.filtered(lambda i: lengths[i] <= budget)
    except DatasetFormatError:
        raise ConfigError(
            f"--seq-length: every prompt is longer than --seq-length {cfg.model.seq_length} − "
            f"--max-new-tokens {cfg.rollout.max_new_tokens} = {budget} tokens ({what})"
        ) from None
    if dropped:
        notes.append(
            f"{what}: dropped {len(dropped)} of {len(dataset) + len(dropped)} prompts longer than "
            f"{budget} tokens (--seq-length {cfg.model.seq_length} − --max-new-tokens "
            f"{cfg.rollout.max_new_tokens}; the longest has {longest})"
        )
    return dataset, len(dropped)


def _check_answers(task: Task, dataset: PromptDataset, flag: str) -> None:
    """Every reference answer is one the task's scoring can read (else every completion of
    that prompt would score alike, found only after the warm-up)."""
    for i, example in enumerate(dataset.examples):
        problem = task.answer_problem(example["answer"])
        if problem is not None:
            raise ConfigError(
                f"{flag}: {dataset.locations[i]}: answer {example['answer']!r} {problem}"
            )


def _prompt_length(renderer: PromptRenderer, dataset: PromptDataset, i: int, flag: str) -> int:
    """Tokens of prompt ``i`` as the policy sees it; a chat template that fails on it (or
    renders it as nothing) is reported with the prompt's location."""
    where = f"{flag}: {dataset.locations[i]}"
    try:
        n = len(renderer.ids(dataset[i]["prompt"]))
    except Exception as e:  # a chat template is user code: jinja2, ValueError, ...
        hint = " (with --system-prompt: does the template take a system turn?)"
        raise ConfigError(
            f"{where}: rendering the prompt failed ({type(e).__name__}: {e})"
            f"{hint if renderer.system_prompt else ''}"
        ) from None
    if n == 0:
        raise ConfigError(f"{where}: the prompt renders as no tokens (an empty chat template?)")
    return n


def _check_vocab(cfg: RunConfig, tokenizer: Tokenizer) -> None:
    from loggra_megatron.checkpointing.layout import MODEL_ARGS
    from loggra_megatron.data.tokenizer import identity
    from loggra_megatron.model.args import GPTModelArgs

    where = cfg.start.model_args_dir
    if where is None:
        return
    args = GPTModelArgs.load_json(os.path.join(where, MODEL_ARGS))
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"--tokenizer-model has {tokenizer.vocab_size} tokens but the model in --load "
            f"{cfg.checkpoint.load!r} has {args.vocab_size}: use the tokenizer it was trained with"
        )
    ref = cfg.start.checkpoint
    saved = ref.run_config() if ref is not None else None
    if saved and not cfg.data.override_tokenizer_check:
        _check_tokenizer_identity(cfg, saved, identity(tokenizer))


def _check_tokenizer_identity(cfg: RunConfig, saved: dict, mine: dict[str, str]) -> None:
    """The checkpoint's tokenizer (``data.tokenizer.identity``; checkpoints from before
    ``tokenizer_encoding`` have the vocabulary's only) against this run's."""
    fix = "use that tokenizer, or --override-tokenizer-check if the change is meant"
    where = f"--tokenizer-model {cfg.data.tokenizer_model!r} is not the tokenizer the checkpoint"
    theirs = saved.get("tokenizer", mine["tokenizer"])
    if theirs != mine["tokenizer"]:
        raise ConfigError(
            f"{where} in --load was trained with (its vocabulary's SHA-256 {theirs[:12]}..., "
            f"this one's {mine['tokenizer'][:12]}...; same size or not, its ids mean other "
            f"pieces): {fix}"
        )
    encoding = saved.get("tokenizer_encoding", mine["tokenizer_encoding"])
    if encoding != mine["tokenizer_encoding"]:
        raise ConfigError(
            f"{where} in --load was trained with: the same pieces, but another normalization "
            f"or encoding rule (SHA-256 {encoding[:12]}..., this one's "
            f"{mine['tokenizer_encoding'][:12]}...), so every prompt tokenizes differently: {fix}"
        )


def _check_data_position(cfg: RunConfig, dataset: PromptDataset) -> None:
    saved = cfg.start.checkpoint.run_config() if cfg.start.resumes else None
    if saved is None or "data" not in saved:
        return
    problem = dataset.state_problem(saved["data"])
    if problem is not None:
        raise ConfigError(
            f"--load: the checkpoint's data position does not fit this run's prompts: "
            f"{problem}; resume with the same --data-path/--task/--num-tasks, --seq-length and "
            "--max-new-tokens, or load the weights only with --no-load-optim"
        )

"""What ``pretrain_rl.py`` loads and checks before any process group starts.

:func:`preflight` returns the host-side parts of a run, or raises
:class:`~loggra_megatron.config.ConfigError` (exit status 2, nothing started or written):

* the tokenizer (``--tokenizer-model``), checked against the vocabulary of the model in
  ``--load``;
* the reward function (``--reward-fn``; the user's module is imported here);
* the prompt dataset (``--data-path`` or the built-in tasks). Prompts whose tokens leave no
  room for ``--max-new-tokens`` within ``--seq-length`` are dropped here, counted
  (``data/dropped_prompts``) and reported, so that no sequence ever exceeds the budget;
* on resume, that the dataset is the one the checkpoint's data position belongs to.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from loggra_megatron.config import ConfigError


@dataclass
class Preflight:
    """The host-side parts of a run."""

    tokenizer: object
    reward_fn: object
    dataset: object
    """The prompt dataset, prompts over the length budget removed."""
    dropped_prompts: int
    """How many prompts were removed for length."""
    notes: list[str]
    """Messages for rank 0 to print (resume notes, dropped prompts)."""


def preflight(cfg) -> Preflight:
    from loggra_megatron.data.prompts import DatasetFormatError, PromptDataset, prompt_ids
    from loggra_megatron.data.tokenizer import SentencePieceTokenizer
    from loggra_megatron.tasks.rewards import RewardSpecError, load_reward_fn

    d, t = cfg.data, cfg.training
    if cfg.logging.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "--tensorboard-dir: the 'tensorboard' package is not installed "
            "(`pip install tensorboard`), or drop --tensorboard-dir"
        )
    try:
        tokenizer = SentencePieceTokenizer(d.tokenizer_model)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    _check_vocab(cfg, tokenizer)
    try:
        reward_fn = load_reward_fn(d.reward_fn)
    except RewardSpecError as e:
        raise ConfigError(str(e)) from None
    try:
        dataset = (
            PromptDataset.from_jsonl(d.data_path, seed=t.seed)
            if d.data_path
            else PromptDataset.builtin(d.task, d.num_tasks, t.seed, **d.task_knobs)
        )
    except (DatasetFormatError, ValueError) as e:
        raise ConfigError(f"--data-path: {e}" if d.data_path else f"--task: {e}") from None
    budget = cfg.model.seq_length - cfg.rollout.max_new_tokens
    lengths = {}

    def fits(example) -> bool:
        lengths[example["prompt"]] = n = len(prompt_ids(tokenizer, example["prompt"]))
        return n <= budget

    try:
        dataset, dropped = dataset.filtered(fits)
    except DatasetFormatError:
        raise ConfigError(
            f"--seq-length: every prompt is longer than --seq-length {cfg.model.seq_length} − "
            f"--max-new-tokens {cfg.rollout.max_new_tokens} = {budget} tokens"
        ) from None
    notes = list(cfg.start.notes)
    if dropped:
        notes.append(
            f"data: dropped {len(dropped)} of {len(dataset) + len(dropped)} prompts longer than "
            f"{budget} tokens (--seq-length {cfg.model.seq_length} − --max-new-tokens "
            f"{cfg.rollout.max_new_tokens}; the longest has {max(lengths.values())})"
        )
    _check_data_position(cfg, dataset)
    return Preflight(tokenizer, reward_fn, dataset, len(dropped), notes)


def _check_vocab(cfg, tokenizer) -> None:
    from loggra_megatron.checkpointing.layout import MODEL_ARGS
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


def _check_data_position(cfg, dataset) -> None:
    saved = cfg.start.checkpoint.run_config() if cfg.start.resumes else None
    if saved is None or "data" not in saved:
        return
    state = saved["data"]
    if state["num_examples"] != len(dataset) or state["seed"] != dataset.seed:
        raise ConfigError(
            f"--load: the checkpoint's data position is for {state['num_examples']} prompts "
            f"(seed {state['seed']}), this run has {len(dataset)} (seed {dataset.seed}); resume "
            "with the same --data-path/--task/--num-tasks, --seq-length and --max-new-tokens, "
            "or load the weights only with --no-load-optim"
        )

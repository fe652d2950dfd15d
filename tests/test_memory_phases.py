"""The RL-step terms of the memory model that follow ``pretrain_rl.py``'s flags: the
rollout's KV budget (``--inference-max-tokens``), Megatron's recompute methods, the reference
forward's micro-batch (``--log-prob-micro-batch-size``), the FP8 caches, the prefill and the
KL probe, and the CLI's mapping of those flags (same names, same meaning)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest
from launch_flags import names_flag

from loggra_megatron.convert.hf_config import gpt_args_from_hf
from loggra_megatron.memory.model import (
    GiB,
    MemoryConfigError,
    ParallelConfig,
    RLStepConfig,
    TransformerShape,
    activation_bytes,
    activation_bytes_per_layer,
    estimate_rl_step_memory,
    forward_activation_bytes,
    kv_cache_bytes,
    logits_bytes,
    main_grad_copy_bytes,
    master_param_bytes,
    max_rollout_batch_size,
    rollout_kv_cache_bytes,
    stage_parameters,
)
from loggra_megatron.memory.transient import LOGITS_COPIES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(REPO, "tools", "estimate_memory.py")
CONFIGS = os.path.join(REPO, "tools", "configs")
SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4)
SMALL.update(num_query_groups=2, vocab_size=200)


def _hf_shape(name: str) -> TransformerShape:
    return TransformerShape.from_model_args(gpt_args_from_hf(os.path.join(CONFIGS, f"{name}.json")))


def _cli_module():
    spec = importlib.util.spec_from_file_location("estimate_memory_cli", CLI)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _27b():
    return _hf_shape("llama-style-27b"), ParallelConfig(tensor_model_parallel_size=8)


def test_kv_budget_term_is_min_of_rollout_and_inference_max_tokens():
    """KV cache = min(rows x full length, --inference-max-tokens) x per-token K+V bytes."""
    model, par = _27b()
    s = 16384
    per_token = 64 * 2 * (8 // 8) * 128 * 2  # layers x (K, V) x KV heads per rank x d x bf16
    assert kv_cache_bytes(model, par, 1, 1) == per_token == 32 * 1024
    for rows in (1, 8, 64):
        for budget in (None, s, 5 * s, 32 * s, 10**9):
            step = RLStepConfig(seq_length=s, rollout_batch_size=rows, inference_max_tokens=budget)
            tokens = rows * s if budget is None else min(rows * s, budget)
            assert step.rollout_kv_tokens == tokens
            assert estimate_rl_step_memory(model, par, step).kv_cache == tokens * per_token
            assert rollout_kv_cache_bytes(model, par, step) == tokens * per_token
            assert step.rollout_rows == max(1, tokens // s)
    # linear in the budget below the whole batch, flat above it
    kv = [
        estimate_rl_step_memory(
            model, par, RLStepConfig(seq_length=s, rollout_batch_size=64, inference_max_tokens=m)
        ).kv_cache
        for m in (8 * s, 16 * s, 32 * s, 64 * s, 128 * s)
    ]
    assert kv[1] == 2 * kv[0] and kv[2] == 2 * kv[1] and kv[3] == 2 * kv[2] == 32 * GiB
    assert kv[4] == kv[3]
    # at least one row; the dynamic engine's paged buffer is the budget whatever the batch
    one = RLStepConfig(seq_length=s, rollout_batch_size=4, inference_max_tokens=100)
    assert one.rollout_kv_tokens == s and one.rollout_rows == 1
    dyn = dataclasses.replace(one, rollout_engine="dynamic", inference_max_tokens=8 * s)
    assert dyn.rollout_kv_tokens == 8 * s
    # under PP each stage holds its own layers' cache
    pp = ParallelConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2)
    step = RLStepConfig(seq_length=s, rollout_batch_size=64, inference_max_tokens=16 * s)
    assert (
        estimate_rl_step_memory(model, pp, step, stage=0).kv_cache == 16 * s * 32 * 2 * 2 * 128 * 2
    )
    with pytest.raises(MemoryConfigError, match="inference_max_tokens"):
        RLStepConfig(inference_max_tokens=0)


def test_max_rollout_rows_ignore_the_budget_and_terminate():
    model, par = _27b()
    step = RLStepConfig(
        seq_length=16384,
        rollout_batch_size=64,
        inference_max_tokens=16384,
        recompute_granularity="full",
    )
    cap = max_rollout_batch_size(model, par, step, 80 * GiB)
    free = dataclasses.replace(step, inference_max_tokens=None)
    assert cap == max_rollout_batch_size(model, par, free, 80 * GiB) and 0 < cap < 200


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_recompute_methods_follow_megatron(method):
    model, par = _27b()
    par = dataclasses.replace(par, sequence_parallel=True)
    s, layers = 4096, 64
    per_layer = activation_bytes_per_layer(model, par, 1, s)
    layer_in = 2 * s * 5120 // 8
    head = 2 * layer_in  # final-norm and output-layer inputs
    full = RLStepConfig(seq_length=s, recompute_granularity="full", recompute_method=method)
    none = dataclasses.replace(full, recompute_granularity="none")
    assert activation_bytes(model, par, none) == layers * per_layer + head
    # one layer per checkpoint (uniform 1) and every layer recomputed (block 64) coincide
    every = 1 if method == "uniform" else layers
    base = activation_bytes(model, par, dataclasses.replace(full, recompute_num_layers=every))
    assert base == layers * layer_in + per_layer + head
    n = 4
    got = activation_bytes(model, par, dataclasses.replace(full, recompute_num_layers=n))
    if method == "uniform":  # 16 checkpoints of 4 layers, one of them re-materialised
        assert got == (layers // n) * layer_in + n * per_layer + head
    else:  # 4 layers recomputed, 60 keep everything
        assert got == n * layer_in + (layers - n) * per_layer + per_layer + head
    assert activation_bytes(model, par, dataclasses.replace(full, recompute_num_layers=999)) > 0
    with pytest.raises(MemoryConfigError, match="recompute_method"):
        RLStepConfig(recompute_method="chunked")


def test_log_prob_forward_uses_the_log_prob_micro_batch_size():
    model, par = _27b()
    s = 16384
    step = RLStepConfig(seq_length=s, micro_batch_size=1, recompute_granularity="full")
    default = estimate_rl_step_memory(model, par, step)
    assert default.log_prob_logits == logits_bytes(model, par, s)  # forward only: 12 B/logit
    assert default.logits == logits_bytes(model, par, s, copies=4)  # and its backward: 16 B
    for lp in (2, 4, 8):
        b = estimate_rl_step_memory(
            model, par, dataclasses.replace(step, log_prob_micro_batch_size=lp)
        )
        assert b.log_prob_logits == lp * default.log_prob_logits
        assert b.log_prob_activations == forward_activation_bytes(model, par, lp, s)
        assert b.phases()["ref log-probs"] == b.log_prob_logits + b.log_prob_activations
        assert b.logits == default.logits  # the training micro-batch is unchanged
    b8 = estimate_rl_step_memory(model, par, dataclasses.replace(step, log_prob_micro_batch_size=8))
    assert b8.peak_phase == "ref log-probs"
    no_ref = dataclasses.replace(step, reference_model=False, log_prob_micro_batch_size=8)
    b = estimate_rl_step_memory(model, par, no_ref)
    assert b.log_prob_logits == b.log_prob_activations == b.reference_model == 0


def test_fp8_caches_prefill_and_kl_probe_terms():
    model, par = _27b()
    s, n = 16384, 15360
    step = RLStepConfig(seq_length=s, rollout_batch_size=64, precision="fp8")
    b = estimate_rl_step_memory(model, par, step)
    linear = sum(p.numel for p in stage_parameters(model, par) if p.kind == "linear")
    assert b.fp8_weight_cache == 2 * linear and b.reference_fp8_weight_cache == linear
    assert b.prefill_activations == 0  # prompt length unknown without max_new_tokens
    pre = estimate_rl_step_memory(model, par, dataclasses.replace(step, max_new_tokens=n))
    assert pre.prefill_activations == forward_activation_bytes(
        model, par, 64, s - n, sequence_parallel=False
    )
    probe = dataclasses.replace(step, kl_probe_sequences=8, kl_estimator="k3")
    k = estimate_rl_step_memory(model, par, probe)
    rows = probe.log_prob_rows  # the probe runs in micro-batches; k3 keeps log-probs only
    assert rows < 8
    assert k.kl_probe_logits == logits_bytes(model, par, rows * s, copies=LOGITS_COPIES)
    assert k.kl_probe_activations == forward_activation_bytes(model, par, rows, s)
    full = estimate_rl_step_memory(model, par, dataclasses.replace(probe, kl_estimator="full"))
    # every row's reference logits kept; one micro-batch's candidate logits and KL temporaries
    assert full.kl_probe_logits == (
        logits_bytes(model, par, 8 * s, copies=1) + logits_bytes(model, par, rows * s, copies=4)
    )
    with pytest.raises(MemoryConfigError, match="max_new_tokens"):
        RLStepConfig(seq_length=128, max_new_tokens=128)


def test_loggra_fp32_grad_copy_and_no_distributed_optimizer():
    model, par = TransformerShape(**SMALL), ParallelConfig(data_parallel_size=2)
    params = stage_parameters(model, par, 0)
    step = RLStepConfig(main_grads_dtype="bf16", seq_length=8, runtime_overhead_bytes=0)
    copy = dataclasses.replace(step, loggra_fp32_grad_copy=True)
    shards = [-(-p.numel // 2) for p in params]
    assert main_grad_copy_bytes(params, copy, 2) == 4 * sum(shards)
    assert main_grad_copy_bytes(params, step, 2) == 4 * max(shards)
    zero1 = estimate_rl_step_memory(model, par, step)
    plain = estimate_rl_step_memory(
        model, par, dataclasses.replace(step, distributed_optimizer=False)
    )
    assert plain.master_params == master_param_bytes(params, 1) > zero1.master_params


def test_masters_as_remainders_and_the_kl_trial_backup():
    """--loggra-param-remainders halves LoGRA's masters (2 bytes per element of the DP shard,
    as ShardedLoGRAAdamW's int16 remainders; tests/test_param_remainders.py checks the real
    bytes) and adds the bf16 weight backup to the KL-control phase; dense Adam's masters
    halve only with Megatron's precision-aware optimizer (bf16 moments)."""
    model, par = TransformerShape(**SMALL), ParallelConfig(data_parallel_size=2)
    params = stage_parameters(model, par, 0)
    shard = sum(-(-p.numel // 2) for p in params)
    step = RLStepConfig(seq_length=8, runtime_overhead_bytes=0, kl_probe_sequences=1)
    rem = dataclasses.replace(step, loggra_param_remainders=True)
    base, halved = (estimate_rl_step_memory(model, par, s) for s in (step, rem))
    assert base.master_params == 4 * shard and halved.master_params == 2 * shard
    assert base.kl_weight_backup == 0 and halved.kl_weight_backup == 2 * shard
    assert halved.phases()["kl control"] == base.phases()["kl control"] + 2 * shard
    no_probe = dataclasses.replace(rem, kl_probe_sequences=0)
    assert estimate_rl_step_memory(model, par, no_probe).kl_weight_backup == 0
    dense = dataclasses.replace(rem, optimizer="adam")
    assert estimate_rl_step_memory(model, par, dense).master_params == 4 * shard
    aware = dataclasses.replace(dense, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert estimate_rl_step_memory(model, par, aware).master_params == 2 * shard


def _cli_json(capsys, argv):
    assert _cli_module().main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


EXAMPLE_LIKE = [
    "--hf-config",
    os.path.join(CONFIGS, "llama-style-27b.json"),
    "--world-size",
    "16",
    "--tensor-model-parallel-size",
    "8",
    "--bf16",
    "--fp8-format",
    "hybrid",
    "--sequence-parallel",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
    "--seq-length",
    "16384",
    "--max-new-tokens",
    "15360",
    "--prompts-per-step",
    "16",
    "--num-generations",
    "8",
    "--global-batch-size",
    "128",
    "--inference-max-tokens",
    "524288",
    "--log-prob-micro-batch-size",
    "4",
    "--kl-target",
    "0.01",
    "--kl-estimator",
    "k3",
    "--kl-coef",
    "0.001",
]


def test_cli_takes_pretrain_rl_flags_with_their_meaning(capsys):
    res = _cli_json(capsys, EXAMPLE_LIKE)["loggra"]
    model, par = _27b()
    par = ParallelConfig(tensor_model_parallel_size=8, data_parallel_size=2, sequence_parallel=True)
    step = RLStepConfig(
        seq_length=16384,
        precision="fp8",
        recompute_granularity="full",
        rollout_batch_size=64,
        inference_max_tokens=524288,
        max_new_tokens=15360,
        log_prob_micro_batch_size=4,
        num_microbatches=64,
        kl_probe_sequences=16,
        kl_estimator="k3",
        rollout_engine="dynamic",
        loggra_rank=5120 // 8,
    )
    # 16·8/DP rollouts; ceil(0.125·128/2) probe + as many held-out sequences;
    # the rank pretrain_rl.py's --loggra-rank defaults to: hidden / 8
    b = estimate_rl_step_memory(model, par, step)
    assert res["total"] == pytest.approx(b.total_bytes / GiB)
    assert res["kv_cache"] == pytest.approx(16.0) and res["peak_phase"] == b.peak_phase
    # --kl-coef 0: pretrain_rl builds no reference model
    no_ref = _cli_json(capsys, [*EXAMPLE_LIKE, "--kl-coef", "0"])["loggra"]
    assert no_ref["reference_model"] == no_ref["log_prob_logits"] == 0
    # --grad-reduce-in-bf16 = bf16 grad buffers; without --kl-target no probe
    no_kl = [*EXAMPLE_LIKE[:-6], "--kl-coef", "0.001"]
    bf16 = _cli_json(capsys, [*no_kl, "--grad-reduce-in-bf16"])["loggra"]
    assert bf16["grads"] == pytest.approx(res["grads"] / 2) and bf16["kl_probe_logits"] == 0
    rem = _cli_json(capsys, [*EXAMPLE_LIKE, "--loggra-param-remainders"])
    assert rem["loggra"]["master_params"] == pytest.approx(res["master_params"] / 2)
    assert rem["adam"]["master_params"] == pytest.approx(res["master_params"])
    # full-vocab KL: the 8 held-out rows of kl/realized join the trial forward, their fp32
    # reference logits (16k × V/8 each) kept
    full = _cli_json(capsys, [*EXAMPLE_LIKE, "--kl-estimator", "full"])["loggra"]
    no_check = _cli_json(
        capsys, [*EXAMPLE_LIKE, "--kl-estimator", "full", "--kl-realized-interval", "0"]
    )["loggra"]
    held_reference = 8 * 16384 * model.padded_vocab_size(8) // 8 * 4 / GiB
    assert full["kl_probe_logits"] - no_check["kl_probe_logits"] == pytest.approx(held_reference)
    more = _cli_json(capsys, [*EXAMPLE_LIKE, "--inference-max-tokens", "1048576"])["loggra"]
    assert more["kv_cache"] == pytest.approx(32.0)  # 64 rows of 16k: the whole batch


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--recompute-granularity", "selective"], "--recompute-method"),
        (["--prompts-per-step", "3"], "--prompts-per-step"),  # 24 rollouts over DP 2
        (["--transformer-impl", "local"], "--fp8-format"),
        (["--global-batch-size", "100"], "--global-batch-size"),
        (["--kl-coef", "-1"], "--kl-coef"),
        (["--max-new-tokens", "16384"], "--max-new-tokens"),
        (["--inference-max-tokens", "0"], "--inference-max-tokens"),
    ],
)
def test_cli_refuses_inconsistent_pretrain_rl_flags(extra, flag, capsys):
    with pytest.raises(SystemExit) as e:
        _cli_module().main([*EXAMPLE_LIKE, *extra])
    assert e.value.code == 2
    assert names_flag(capsys.readouterr().err, flag)

"""The RL-step terms of the memory model that follow ``pretrain_rl.py``'s flags: the
rollout's KV budget (``--inference-max-tokens``), Megatron's recompute methods, the output
head's chunked log-probs (``--log-prob-chunk-size``, by hand at a small shape), the reference
forward's micro-batch (``--log-prob-micro-batch-size``) and its offload
(``--reference-offload``), the FP8 caches, the prefill, the KL probe, the checkpoint save's
copy bucket (``--loggra-param-remainders``), and the CLI's mapping
of those flags (same names, same meaning)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
from launch_flags import names_flag
from memory_plans import plan

from loggra_megatron.convert.hf_config import gpt_args_from_hf
from loggra_megatron.memory.model import (
    EstimateConfig,
    GiB,
    TransformerShape,
    activation_bytes,
    activation_bytes_per_layer,
    estimate_rl_step_memory,
    forward_activation_bytes,
    full_kl_logits_bytes,
    kv_cache_bytes,
    log_prob_head_bytes,
    main_grad_copy_bytes,
    master_param_bytes,
    max_rollout_batch_size,
    rollout_kv_cache_bytes,
    rollout_kv_tokens,
    rollout_rows,
    stage_parameters,
)
from loggra_megatron.model.config import log_prob_chunk_tokens

REPO = str(Path(__file__).resolve().parents[3])
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
    return _hf_shape("llama-style-27b"), plan(tensor_model_parallel_size=8)


def test_kv_budget_term_is_min_of_rollout_and_inference_max_tokens():
    """KV cache = min(rows x full length, --inference-max-tokens) x per-token K+V bytes."""
    model, par = _27b()
    s = 16384
    per_token = 64 * 2 * (8 // 8) * 128 * 2  # layers x (K, V) x KV heads per rank x d x bf16
    assert kv_cache_bytes(model, par, 1, 1) == per_token == 32 * 1024
    for rows in (1, 8, 64):
        for budget in (None, s, 5 * s, 32 * s, 10**9):
            step = dataclasses.replace(
                par, seq_length=s, rollout_batch_size=rows, inference_max_tokens=budget
            )
            tokens = rows * s if budget is None else min(rows * s, budget)
            assert rollout_kv_tokens(step) == tokens
            assert estimate_rl_step_memory(model, step).kv_cache == tokens * per_token
            assert rollout_kv_cache_bytes(model, step) == tokens * per_token
            assert rollout_rows(step) == max(1, tokens // s)
    # linear in the budget below the whole batch, flat above it
    kv = [
        estimate_rl_step_memory(
            model,
            dataclasses.replace(par, seq_length=s, rollout_batch_size=64, inference_max_tokens=m),
        ).kv_cache
        for m in (8 * s, 16 * s, 32 * s, 64 * s, 128 * s)
    ]
    assert kv[1] == 2 * kv[0] and kv[2] == 2 * kv[1] and kv[3] == 2 * kv[2] == 32 * GiB
    assert kv[4] == kv[3]
    # at least one row; the dynamic engine's paged buffer is the budget whatever the batch
    one = dataclasses.replace(par, seq_length=s, rollout_batch_size=4, inference_max_tokens=100)
    assert rollout_kv_tokens(one) == s and rollout_rows(one) == 1
    dyn = dataclasses.replace(one, rollout_engine="dynamic", inference_max_tokens=8 * s)
    assert rollout_kv_tokens(dyn) == 8 * s
    # under PP each stage holds its own layers' cache
    pp = plan(tensor_model_parallel_size=4, pipeline_model_parallel_size=2, seq_length=s)
    step = dataclasses.replace(pp, rollout_batch_size=64, inference_max_tokens=16 * s)
    assert estimate_rl_step_memory(model, step, stage=0).kv_cache == 16 * s * 32 * 2 * 2 * 128 * 2


def test_max_rollout_rows_ignore_the_budget_and_terminate():
    model, par = _27b()
    step = dataclasses.replace(
        par,
        seq_length=16384,
        rollout_batch_size=64,
        inference_max_tokens=16384,
        recompute_granularity="full",
    )
    est = EstimateConfig()
    cap = max_rollout_batch_size(model, step, est, 80 * GiB)
    free = dataclasses.replace(step, inference_max_tokens=None)
    assert cap == max_rollout_batch_size(model, free, est, 80 * GiB) and 0 < cap < 200


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_recompute_methods_follow_megatron(method):
    model, par = _27b()
    s, layers = 4096, 64
    full = dataclasses.replace(
        par,
        sequence_parallel=True,
        seq_length=s,
        recompute_granularity="full",
        recompute_method=method,
    )
    per_layer = activation_bytes_per_layer(model, full, 1, s)
    layer_in = 2 * s * 5120 // 8
    head = 2 * layer_in  # final-norm and output-layer inputs
    none = dataclasses.replace(full, recompute_granularity="none")
    assert activation_bytes(model, none) == layers * per_layer + head
    # one layer per checkpoint (uniform 1) and every layer recomputed (block 64) coincide
    every = 1 if method == "uniform" else layers
    base = activation_bytes(model, dataclasses.replace(full, recompute_num_layers=every))
    assert base == layers * layer_in + per_layer + head
    n = 4
    got = activation_bytes(model, dataclasses.replace(full, recompute_num_layers=n))
    if method == "uniform":  # 16 checkpoints of 4 layers, one of them re-materialised
        assert got == (layers // n) * layer_in + n * per_layer + head
    else:  # 4 layers recomputed, 60 keep everything
        assert got == n * layer_in + (layers - n) * per_layer + per_layer + head
    assert activation_bytes(model, dataclasses.replace(full, recompute_num_layers=999)) > 0


def test_chunked_log_prob_head_by_hand():
    """The output head at a small shape, by hand: V/t = 256/2 = 128, h = 64, chunks of
    c = min(--log-prob-chunk-size, tokens); bf16 forward 6·c·V_t, training 6·c·V_t + 6·V_t·h
    (the fp32 accumulator and a chunk's gradient) + 2·tokens·h (the input's gradient) +
    4·tokens; an fp32 model no upcast and no casts back (4·c·V_t, 4·c·V_t + 8·V_t·h + ...)."""
    model = TransformerShape(**SMALL)  # vocab 200, padded to 256 at TP 2
    p = plan(tensor_model_parallel_size=2, log_prob_chunk_size=32)
    assert log_prob_head_bytes(model, p, 96) == 6 * 32 * 128 == 24576
    assert log_prob_head_bytes(model, p, 96, training=True) == (
        6 * 32 * 128 + 6 * 128 * 64 + 2 * 96 * 64 + 4 * 96
    )
    # one chunk: the chunk's gradient is the weight's, no accumulator
    assert log_prob_head_bytes(model, p, 32, training=True) == (
        6 * 32 * 128 + 2 * 128 * 64 + 2 * 32 * 64 + 4 * 32
    )
    # untied (or on a later stage than the embeddings): the weight's gradient goes into
    # DDP's main_grad chunk by chunk, then a bf16 placeholder for DDP's hook
    untied = TransformerShape(**SMALL, untie_embeddings_and_output_weights=True)
    assert log_prob_head_bytes(untied, p, 96, training=True) == (
        6 * 32 * 128 + 2 * 128 * 64 + 2 * 96 * 64 + 4 * 96
    )
    assert log_prob_head_bytes(model, p, 20) == 6 * 20 * 128  # one short chunk
    assert log_prob_head_bytes(model, p, 0) == 0
    fp32 = dataclasses.replace(p, precision="fp32")
    assert log_prob_head_bytes(model, fp32, 96) == 4 * 32 * 128
    assert log_prob_head_bytes(model, fp32, 96, training=True) == (
        4 * 32 * 128 + 8 * 128 * 64 + 4 * 96 * 64 + 4 * 96
    )


def test_log_prob_passes_are_bounded_by_the_chunk_not_the_micro_batch():
    model, par = _27b()
    s = 16384
    vocab = model.padded_vocab_size(8) // 8
    step = dataclasses.replace(
        par, seq_length=s, recompute_granularity="full", reference_model=True
    )
    default = estimate_rl_step_memory(model, step)
    assert step.log_prob_chunk_size is None  # --log-prob-chunk-size's default: 2^22 logits
    c = log_prob_chunk_tokens(None, vocab)
    assert c == 256 < s and c * vocab <= 1 << 22 < 2 * c * vocab
    assert default.log_prob_logits == 6 * c * vocab  # forward only
    # and its backward: the untied output weight's gradient goes into main_grad
    assert default.logits == 6 * c * vocab + 2 * vocab * 5120 + 2 * s * 5120 + 4 * s
    for lp in (2, 4, 8):
        b = estimate_rl_step_memory(model, dataclasses.replace(step, forward_micro_batch_size=lp))
        assert b.log_prob_logits == default.log_prob_logits  # one chunk at a time
        assert b.log_prob_activations == forward_activation_bytes(model, step, lp, s)
        assert b.phases()["ref log-probs"] == b.log_prob_logits + b.log_prob_activations
        assert b.logits == default.logits  # the training micro-batch is unchanged
    # a chunk of the whole micro-batch is the unchunked pass: it scales with the rows
    whole = dataclasses.replace(step, forward_micro_batch_size=8, log_prob_chunk_size=8 * s)
    assert estimate_rl_step_memory(model, whole).log_prob_logits == 6 * 8 * s * vocab
    no_ref = dataclasses.replace(step, reference_model=False, forward_micro_batch_size=8)
    b = estimate_rl_step_memory(model, no_ref)
    assert b.log_prob_logits == b.log_prob_activations == b.reference_model == 0


def test_fp8_caches_prefill_and_kl_probe_terms():
    model, par = _27b()
    s, n = 16384, 15360
    step = dataclasses.replace(
        par,
        seq_length=s,
        max_new_tokens=n,
        rollout_batch_size=64,
        precision="fp8",
        reference_model=True,
    )
    b = estimate_rl_step_memory(model, step)
    linear = sum(p.numel for p in stage_parameters(model, par) if p.kind == "linear")
    assert b.fp8_weight_cache == 2 * linear and b.reference_fp8_weight_cache == linear
    prompts = 64 // step.num_generations  # one prefill per GRPO group
    assert b.prefill_activations == forward_activation_bytes(
        model, par, prompts, s - n, sequence_parallel=False
    )
    probe = dataclasses.replace(step, kl_trial_rows=8, kl_estimator="k3")
    k = estimate_rl_step_memory(model, probe)
    rows = probe.forward_micro_batch_size  # the probe runs in micro-batches; k3: log-probs
    assert rows < 8
    assert k.kl_probe_logits == log_prob_head_bytes(model, probe, rows * s)
    assert k.kl_probe_activations == forward_activation_bytes(model, par, rows, s)
    full = estimate_rl_step_memory(model, dataclasses.replace(probe, kl_estimator="full"))
    # every row's reference logits kept; one micro-batch's candidate logits and KL temporaries
    per_row = s * model.padded_vocab_size(8) // 8
    assert full.kl_probe_logits == full_kl_logits_bytes(model, probe, 8, rows)
    assert full.kl_probe_logits == 4 * 8 * per_row + 16 * rows * per_row


def test_adam_temporaries_by_implementation():
    """--adam-implementation: FusedAdam none; torch's foreach AdamW one fp32 denominator per
    element of the shard; its single-tensor loop (CPU) the largest shard's square root and
    denominator; none for LoGRA (its own update) or the precision-aware FusedAdam."""
    from loggra_megatron.config import ConfigError

    model = TransformerShape(**SMALL)
    step = plan(data_parallel_size=2, optimizer="adam", seq_length=8, max_new_tokens=4)
    shards = [-(-s.numel // 2) for s in stage_parameters(model, step, 0)]
    got = {
        impl: estimate_rl_step_memory(model, step, EstimateConfig(adam_implementation=impl))
        for impl in ("fused", "foreach", "single")
    }
    assert got["fused"].adam_temporaries == 0
    assert got["foreach"].adam_temporaries == 4 * sum(shards)
    assert got["single"].adam_temporaries == 8 * max(shards)
    assert got["foreach"].phases()["optimizer step"] == 4 * sum(shards)
    loggra = dataclasses.replace(step, optimizer="loggra")
    foreach = EstimateConfig(adam_implementation="foreach")
    assert estimate_rl_step_memory(model, loggra, foreach).adam_temporaries == 0
    aware = EstimateConfig(adam_implementation="foreach", exp_avg_sq_dtype="bf16")
    assert estimate_rl_step_memory(model, step, aware).adam_temporaries == 0
    with pytest.raises(ConfigError, match="adam.implementation"):
        EstimateConfig(adam_implementation="apex")


def test_loggra_fp32_grad_copy_and_no_distributed_optimizer():
    model, par = TransformerShape(**SMALL), plan(data_parallel_size=2)
    params = stage_parameters(model, par, 0)
    step = dataclasses.replace(par, main_grads_dtype="bf16", seq_length=8, max_new_tokens=4)
    copy = dataclasses.replace(step, loggra_fp32_grad_copy=True)
    shards = [-(-p.numel // 2) for p in params]
    est = EstimateConfig()
    assert main_grad_copy_bytes(params, copy, est, 2) == 4 * sum(shards)
    assert main_grad_copy_bytes(params, step, est, 2) == 4 * max(shards)
    zero1 = estimate_rl_step_memory(model, step)
    plain = estimate_rl_step_memory(model, dataclasses.replace(step, distributed_optimizer=False))
    assert plain.master_params == master_param_bytes(params, 1) > zero1.master_params


def test_masters_as_remainders_the_kl_trial_backup_and_the_checkpoint_save():
    """--loggra-param-remainders halves LoGRA's masters (2 bytes per element of the DP shard,
    as ShardedLoGRAAdamW's int16 remainders; tests/integration/test_param_remainders.py checks the real
    bytes), adds the bf16 weight backup to the KL-control phase and the fp32 of one copy
    bucket to the checkpoint save; dense Adam's masters halve only with Megatron's
    precision-aware optimizer (bf16 moments)."""
    model, par = TransformerShape(**SMALL), plan(data_parallel_size=2)
    params = stage_parameters(model, par, 0)
    shard = sum(-(-p.numel // 2) for p in params)
    step = dataclasses.replace(par, seq_length=8, max_new_tokens=4, kl_trial_rows=1)
    rem = dataclasses.replace(step, loggra_param_remainders=True)
    base, halved = (estimate_rl_step_memory(model, s) for s in (step, rem))
    assert base.master_params == 4 * shard and halved.master_params == 2 * shard
    assert base.kl_weight_backup == 0 and halved.kl_weight_backup == 2 * shard
    assert halved.phases()["kl control"] == base.phases()["kl control"] + 2 * shard
    no_probe = dataclasses.replace(rem, kl_trial_rows=0)
    assert estimate_rl_step_memory(model, no_probe).kl_weight_backup == 0
    # --kl-backup-offload: the copy is on the host, the phase loses exactly it
    host = estimate_rl_step_memory(model, dataclasses.replace(rem, kl_backup_offload=True))
    assert host.kl_weight_backup == 0
    assert host.phases()["kl control"] == base.phases()["kl control"]
    numel = max(p.numel for p in params)  # a small model: its largest master at once
    assert base.checkpoint_save == 0 and halved.checkpoint_save == 4 * numel
    assert halved.phases()["checkpoint save"] == 4 * numel
    dense = dataclasses.replace(rem, optimizer="adam")
    assert estimate_rl_step_memory(model, dense).master_params == 4 * shard
    aware = EstimateConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    aware_adam = estimate_rl_step_memory(model, dense, aware)
    assert aware_adam.master_params == 2 * shard and aware_adam.checkpoint_save == 0


def test_checkpoint_save_rebuilds_one_copy_bucket_at_a_time():
    """A save with remainders rebuilds each master in buckets of the save code's own size
    (``optim.param_remainders.COPY_BUCKET_NUMEL``, which the estimator's constant equals),
    whatever the model: 64 MiB at the 27B example; a smaller model's largest master."""
    from loggra_megatron.memory.params import SAVE_COPY_NUMEL
    from loggra_megatron.optim.param_remainders import COPY_BUCKET_NUMEL, copy_transient_bytes

    assert SAVE_COPY_NUMEL == COPY_BUCKET_NUMEL
    model, par = _27b()
    rem = dataclasses.replace(par, precision="bf16", loggra_param_remainders=True)
    assert estimate_rl_step_memory(model, rem).checkpoint_save == copy_transient_bytes()
    small, splan = TransformerShape(**SMALL), plan(loggra_param_remainders=True)
    largest = max(p.numel for p in stage_parameters(small, splan, 0))
    assert largest < SAVE_COPY_NUMEL
    assert estimate_rl_step_memory(small, splan).checkpoint_save == 4 * largest


def test_dense_updates_convert_one_piece_at_a_time():
    """LoGRA's AdamW converts a dense shard's bf16 gradient in pieces of the optimizer's own
    size (``optim.gradient_sketch.distributed.DENSE_PIECE_NUMEL``, which the estimator's constant equals): at
    the 27B example the [V/t, h] embedding shard's 0.6 GiB fp32 copy becomes 16 MiB with the
    backward sketch; a gradient-sketched weight still converts its whole shard."""
    from loggra_megatron.memory.params import DENSE_PIECE_NUMEL
    from loggra_megatron.optim.gradient_sketch.distributed import (
        DENSE_PIECE_NUMEL as OPTIMIZER_PIECE,
    )

    assert DENSE_PIECE_NUMEL == OPTIMIZER_PIECE
    model, par = _27b()
    bf16 = dataclasses.replace(par, main_grads_dtype="bf16", optimizer="loggra")
    params = stage_parameters(model, bf16, 0)
    embedding = max(p.numel for p in params if p.kind == "embedding")
    assert embedding > DENSE_PIECE_NUMEL
    backward = dataclasses.replace(bf16, loggra_sketch="backward")
    assert estimate_rl_step_memory(model, backward).main_grad_copies == 4 * DENSE_PIECE_NUMEL
    sketched = max(p.numel for p in params if p.kind == "linear")
    gradient = estimate_rl_step_memory(model, dataclasses.replace(bf16, loggra_sketch="gradient"))
    assert gradient.main_grad_copies == 4 * max(sketched, DENSE_PIECE_NUMEL)
    adam = estimate_rl_step_memory(model, dataclasses.replace(bf16, optimizer="adam"))
    assert adam.main_grad_copies == 4 * sum(p.numel for p in params)  # Megatron's copies


def test_reference_offload_keeps_two_units_in_its_forward():
    """--reference-offload: no resident reference (nor its FP8 cache); its log-prob forward
    holds two units, the largest twice: here the final norm + the [V/t, h] output layer."""
    model, par = _27b()
    ref = dataclasses.replace(par, seq_length=4096, reference_model=True)
    resident = estimate_rl_step_memory(model, ref)
    offload = estimate_rl_step_memory(model, dataclasses.replace(ref, reference_offload=True))
    head = 16128 * 5120 + 5120  # output layer + final norm, TP-local
    layer = sum(
        p.numel for p in stage_parameters(model, par) if p.name.startswith("decoder.layers.0.")
    )
    assert head > layer
    assert resident.reference_model == resident.weights and resident.reference_streamed == 0
    assert offload.reference_model == 0 and offload.reference_streamed == 2 * 2 * head
    assert offload.phases()["ref log-probs"] == resident.phases()["ref log-probs"] + 4 * head
    assert offload.static_bytes == resident.static_bytes - resident.reference_model
    fp8 = dataclasses.replace(ref, precision="fp8", reference_offload=True)
    b = estimate_rl_step_memory(model, fp8)
    assert b.reference_fp8_weight_cache == 0 and b.reference_streamed == 4 * head
    # a layer larger than the head (a small vocabulary): two layers and their FP8 copies
    small = TransformerShape(**SMALL)
    tiny = plan(precision="fp8", reference_model=True, reference_offload=True, seq_length=8)
    params = stage_parameters(small, tiny)
    in_layer = [p for p in params if p.name.startswith("decoder.layers.0.")]
    linear = sum(p.numel for p in in_layer if p.kind == "linear")
    units = 2 * (2 * sum(p.numel for p in in_layer) + linear)
    head = 256 * 64 + 64  # the tied embedding [V, h] and the final norm
    assert units > 2 * 2 * head
    assert estimate_rl_step_memory(small, tiny).reference_streamed == units


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
    model, _ = _27b()
    step = plan(
        tensor_model_parallel_size=8,
        data_parallel_size=2,
        sequence_parallel=True,
        seq_length=16384,
        precision="fp8",
        recompute_granularity="full",
        rollout_batch_size=64,
        inference_max_tokens=524288,
        max_new_tokens=15360,
        forward_micro_batch_size=4,
        rows_per_update=64,
        num_microbatches=64,
        updates_per_rl_step=1,
        reference_model=True,
        kl_trial_rows=16,
        kl_estimator="k3",
        rollout_engine="dynamic",
        loggra_rank=5120 // 8,
    )
    # 16·8/DP rollouts; ceil(0.125·128/2) probe + as many held-out sequences;
    # the rank pretrain_rl.py's --loggra-rank defaults to: hidden / 8
    b = estimate_rl_step_memory(model, step)
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

"""The per-GPU memory model against real objects, and its CLI.

* Optimizer state: ``state_bytes`` of a real ``LoGRAAdamW`` and ``torch.optim.AdamW`` after
  one step on plain torch parameters of the model's shapes (exact); on Megatron-Core's own
  ranks: ``tests/integration/test_memory_model_ranks.py``.
* Closed forms: Korthikanti et al.'s GPT activation formula, Llama-3-8B's 128 KiB/token KV
  cache, exact published parameter counts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from launch_flags import names_flag
from memory_plans import plan
from optimizer_state import MIN_DIM, RANK, SMALL, step_optimizers

from loggra_megatron.convert.hf_config import gpt_args_from_hf
from loggra_megatron.memory.model import (
    EstimateConfig,
    GiB,
    MemoryConfigError,
    TransformerShape,
    activation_bytes,
    activation_bytes_per_layer,
    estimate_rl_step_memory,
    grad_bytes,
    kv_cache_bytes,
    main_grad_copy_bytes,
    max_rollout_batch_size,
    num_parameters,
    optimizer_state_bytes,
    stage_parameters,
    weight_bytes,
)

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

REPO = str(Path(__file__).resolve().parents[3])
CLI = os.path.join(REPO, "tools", "estimate_memory.py")
CONFIGS = os.path.join(REPO, "tools", "configs")


def _hf_shape(name: str) -> TransformerShape:

    args = gpt_args_from_hf(os.path.join(CONFIGS, f"{name}.json"))
    return TransformerShape.from_model_args(args)


def test_optimizer_state_exact_for_plain_torch_modules():
    model = TransformerShape(**SMALL, untie_embeddings_and_output_weights=True)
    specs = stage_parameters(model, plan())
    named = [(s.name, torch.nn.Parameter(torch.zeros(s.shape))) for s in specs]
    got = step_optimizers(named)
    assert got["loggra"] == optimizer_state_bytes(specs, "loggra", rank=RANK, min_dim=MIN_DIM)
    assert got["adam"] == optimizer_state_bytes(specs, "adam")
    # weights and grads of a bf16 copy, one backward pass
    lin = torch.nn.Linear(64, 96, bias=False, dtype=torch.bfloat16)
    lin(torch.ones(3, 64, dtype=torch.bfloat16)).sum().backward()
    spec = [dataclasses.replace(specs[1], shape=(96, 64))]
    assert lin.weight.numel() * lin.weight.element_size() == weight_bytes(spec, 2)
    assert lin.weight.grad.numel() * lin.weight.grad.element_size() == grad_bytes(spec, 2)


# ---------------------------------------------------------------------- closed forms
def test_published_parameter_counts_and_kv_cache():
    assert num_parameters(_hf_shape("llama-2-7b")) == 6_738_415_616
    llama3 = _hf_shape("llama-3-8b")
    assert num_parameters(llama3) == 8_030_261_248
    assert num_parameters(_hf_shape("llama-style-27b")) == 26_983_142_400
    assert num_parameters(_hf_shape("llama-3-70b")) == 70_553_706_496
    assert num_parameters(_hf_shape("qwen2.5-7b-instruct")) == 7_615_616_512  # QKV bias
    # Llama-3-8B: 32 layers · 2 · 8 KV heads · 128 · 2 B = 128 KiB per token (bf16)
    assert kv_cache_bytes(llama3, plan(), 1, 1) == 128 * 1024
    assert kv_cache_bytes(llama3, plan(tensor_model_parallel_size=8), 4, 100) == (
        4 * 100 * 16 * 1024
    )


@pytest.mark.parametrize("sp", [False, True])
def test_activations_reduce_to_korthikanti_for_gpt(sp):
    """GPT (MHA, GeLU 4h): sbh(10 + 24/t) [paper] − sbh dropout masks ×2 + 4sba/t (LSE)."""
    s, b, h, a, t = 512, 2, 1024, 16, 4
    gpt = TransformerShape(
        num_layers=8,
        hidden_size=h,
        ffn_hidden_size=4 * h,
        num_attention_heads=a,
        vocab_size=1000,
        swiglu=False,
    )
    step = plan(
        tensor_model_parallel_size=t,
        sequence_parallel=sp,
        micro_batch_size=b,
        seq_length=s,
        recompute_granularity="full",
    )
    replicated = 8 * s * b * h // (t if sp else 1)
    assert (
        activation_bytes_per_layer(gpt, step, b, s)
        == replicated + (24 * s * b * h + 4 * s * b * a) // t
    )
    layer_in = 2 * s * b * h // (t if sp else 1)
    per_layer = activation_bytes_per_layer(gpt, step, b, s)
    assert activation_bytes(gpt, step) == 8 * layer_in + per_layer + 2 * layer_in
    sel = dataclasses.replace(step, recompute_granularity="selective")
    assert activation_bytes(gpt, sel) == 8 * per_layer + 2 * layer_in  # flash: no gain
    none = dataclasses.replace(
        step, recompute_granularity="none", sequence_parallel=False, pipeline_model_parallel_size=4
    )
    layer = activation_bytes_per_layer(gpt, none, b, s)
    assert none.num_microbatches >= 4
    assert activation_bytes(gpt, none, stage=0) == 4 * 2 * layer  # 1F1B: p in flight
    one = dataclasses.replace(none, num_microbatches=1)
    assert activation_bytes(gpt, one, stage=0) == 2 * layer


def test_estimate_terms_and_phases():
    model = _hf_shape("llama-style-27b")
    step = plan(
        tensor_model_parallel_size=8,
        sequence_parallel=True,
        seq_length=8192,
        max_new_tokens=7168,
        rollout_batch_size=64,
        optimizer="adam",
        reference_model=True,
    )
    dense = estimate_rl_step_memory(model, step)
    loggra = estimate_rl_step_memory(model, dataclasses.replace(step, optimizer="loggra"))
    n = dense.num_parameters
    h, f, qkv = 5120, 22016, (40 + 2 * 8) * 128
    per_layer = (qkv * h + h * 40 * 128 + 2 * f * h + h * f) // 8 + 2 * h  # norms replicated
    assert n == 64 * per_layer + h + 2 * 129024 // 8 * h  # padded vocab split over TP
    assert (dense.weights, dense.grads, dense.master_params) == (2 * n, 4 * n, 4 * n)
    assert dense.reference_model == 2 * n and dense.fp8_weight_cache == 0
    assert dense.optimizer_state == 8 * n + 4 * (1 + 64 * 6 + 1 + 1)  # + fp32 step per tensor
    assert loggra.optimizer_state < dense.optimizer_state / 8
    assert dense.total_bytes == dense.static_bytes + max(dense.rollout_bytes, dense.training_bytes)
    assert dense.kv_cache == 64 * 8192 * 64 * 2 * 1 * 128 * 2 == 16 * GiB
    fp8 = estimate_rl_step_memory(model, dataclasses.replace(step, precision="fp8"))
    assert fp8.fp8_weight_cache == 2 * sum(
        s.numel for s in stage_parameters(model, step) if s.kind == "linear"
    )
    gpu, est = 80 * GiB, EstimateConfig()
    long = dataclasses.replace(step, seq_length=16384, max_new_tokens=15360)
    assert max_rollout_batch_size(model, long, est, gpu) is None  # 16k training: too large
    step = dataclasses.replace(step, recompute_granularity="full")
    cap = max_rollout_batch_size(model, step, est, gpu)
    assert estimate_rl_step_memory(model, dataclasses.replace(step, rollout_batch_size=cap)).fits(
        gpu
    )
    over = dataclasses.replace(step, rollout_batch_size=cap + 1)
    assert not estimate_rl_step_memory(model, over).fits(gpu)


def test_invalid_configurations_name_the_field():
    llama3 = _hf_shape("llama-3-8b")
    with pytest.raises(MemoryConfigError) as e:
        estimate_rl_step_memory(llama3, plan(tensor_model_parallel_size=3))
    assert e.value.field == "tensor_model_parallel_size"
    with pytest.raises(MemoryConfigError, match="pipeline_model_parallel_size"):
        stage_parameters(llama3, plan(pipeline_model_parallel_size=5))
    with pytest.raises(MemoryConfigError, match="hidden_size"):
        TransformerShape(2, -4, 8, 2, 10)
    with pytest.raises(MemoryConfigError, match="num_query_groups"):
        TransformerShape(2, 64, 8, 4, 10, num_query_groups=3)
    with pytest.raises(MemoryConfigError, match="loggra_rank"):
        optimizer_state_bytes(stage_parameters(llama3, plan()), "loggra")


# ---------------------------------------------------------------------- CLI
def _cli_module():
    spec = importlib.util.spec_from_file_location("estimate_memory_cli", CLI)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HEADLINE = [
    "--hf-config",
    os.path.join(CONFIGS, "llama-style-27b.json"),
    "--tensor-model-parallel-size",
    "8",
    "--sequence-parallel",
    "--world-size",
    "8",
    "--micro-batch-size",
    "1",
    "--seq-length",
    "8192",
    "--bf16",
    "--loggra-rank",
    "128",
    "--prompts-per-step",
    "8",
    "--num-generations",
    "8",
    "--max-new-tokens",
    "7168",
    "--inference-max-tokens",
    "262144",
    "--kl-coef",
    "0.001",
    "--gpu-memory-gb",
    "80",
]


def test_cli_prints_table_for_a_config_file_and_reproduces_docs(capsys):
    cli = _cli_module()
    assert cli.main(HEADLINE) == 0
    out = capsys.readouterr().out
    for text in ("dense Adam", "LoGRA bwd r=128*", "optimizer state", "sketch buffer S"):
        assert text in out  # the default: LoGRA's backward sketch
    assert "TOTAL per GPU" in out and "fits 80 GiB" in out
    assert "% saved" in out and "NO (over by" in out and "yes (" in out
    assert cli.main([*HEADLINE, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert not res["adam"]["fits"] and res["loggra"]["fits"]  # docs/memory.md's headline


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--tensor-model-parallel-size", "3"], "--num-attention-heads"),  # 8 heads
        (["--hidden-size", "-4"], "--hidden-size"),
        (
            ["--world-size", "6", "--tensor-model-parallel-size", "4"],
            "--tensor-model-parallel-size",
        ),
        (["--num-query-groups", "3"], "--num-query-groups"),
    ],
)
def test_cli_bad_flags_exit_2_naming_the_flag(argv, flag, capsys):
    base = {"--num-layers": "4", "--hidden-size": "256", "--ffn-hidden-size": "512"}
    base.update({"--num-attention-heads": "8", "--vocab-size": "1000"})
    for k, v in zip(argv[::2], argv[1::2], strict=True):
        base[k] = v
    with pytest.raises(SystemExit) as e:
        _cli_module().main([x for kv in base.items() for x in kv])
    assert e.value.code == 2
    assert names_flag(capsys.readouterr().err, flag)


def test_optimizer_step_phase_counts_megatrons_fp32_grad_copies_only_for_16_bit_grads():
    model = TransformerShape(**SMALL)
    bf16 = plan(
        data_parallel_size=2,
        main_grads_dtype="bf16",
        optimizer="adam",
        seq_length=8,
        max_new_tokens=4,
        rollout_batch_size=0,
    )
    params = stage_parameters(model, bf16, 0)
    shards = [-(-s.numel // 2) for s in params]
    est = EstimateConfig(runtime_overhead_gb=0)
    dense = estimate_rl_step_memory(model, bf16, est)
    assert dense.main_grad_copies == 4 * sum(shards) == main_grad_copy_bytes(params, bf16, est, 2)
    assert dense.phases()["optimizer step"] == dense.main_grad_copies
    loggra = estimate_rl_step_memory(model, dataclasses.replace(bf16, optimizer="loggra"), est)
    assert loggra.main_grad_copies == 4 * max(shards)  # converted one weight at a time
    fp32 = dataclasses.replace(bf16, main_grads_dtype="fp32")
    aware = EstimateConfig(runtime_overhead_gb=0, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert estimate_rl_step_memory(model, fp32, est).main_grad_copies == 0
    assert estimate_rl_step_memory(model, bf16, aware).main_grad_copies == 0
    # with no rollout and tiny activations, the copies are the dense step's peak phase
    assert dense.peak_phase == "optimizer step"
    assert dense.total_bytes == dense.static_bytes + dense.main_grad_copies

"""The per-GPU memory model against Megatron-Core's own objects on CPU/gloo ranks.

* Parameter names/shapes per TP rank and PP stage: the real ``GPTModel`` (GQA, QKV bias,
  QK-norm, tied embeddings with PP=2), and ``state_bytes`` of a real ``LoGRAAdamW`` and
  ``torch.optim.AdamW`` after one step on those parameters (exact).
* LoGRA's gradient sketch inside Megatron's ``DistributedOptimizer`` at DP=2 (even-split
  ZeRO-1 model, within 10 %), with the real grad buffer, param buffer and fp32 master shards.
* The estimator's command line on a missing config file (exit 2, naming the flag).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_flags import names_flag
from memory_plans import plan
from optimizer_state import MIN_DIM, RANK, SMALL, step_optimizers

from loggra_megatron.memory.model import (
    TransformerShape,
    grad_bytes,
    master_param_bytes,
    optimizer_state_bytes,
    stage_parameters,
    weight_bytes,
)
from loggra_megatron.optim import state_bytes
from loggra_megatron.testing import run_distributed, tiny_gpt_model, train_step, wrap_ddp

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

CLI = os.path.join(str(Path(__file__).resolve().parents[2]), "tools", "estimate_memory.py")


def _megatron_stage(rank: int, tie: bool) -> dict:
    from loggra_megatron.model.args import GPTModelArgs
    from loggra_megatron.model.build import build_gpt_model

    args = GPTModelArgs(
        **SMALL,
        add_qkv_bias=True,
        qk_layernorm=True,
        untie_embeddings_and_output_weights=not tie,
    )
    model = build_gpt_model(args, use_cpu_initialization=True)
    named = list(model.named_parameters())
    return {"shapes": {n: tuple(p.shape) for n, p in named}, "state": step_optimizers(named)}


@pytest.mark.parametrize("tp,pp,tie", [(2, 1, False), (1, 2, True)])
def test_parameters_and_optimizer_state_match_megatron_gptmodel(tp, pp, tie):
    model = TransformerShape(
        **SMALL,
        add_qkv_bias=True,
        qk_layernorm=True,
        untie_embeddings_and_output_weights=not tie,
    )
    parallel = plan(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    results = run_distributed(_megatron_stage, 2, tie, tp=tp, pp=pp)
    for rank, res in enumerate(results):
        specs = stage_parameters(model, parallel, stage=rank if pp > 1 else 0)
        assert {s.name: s.shape for s in specs} == res["shapes"]
        # Exact: same tensors, same rank clamping and min_dim rule, scalars included.
        loggra = optimizer_state_bytes(specs, "loggra", rank=RANK, min_dim=MIN_DIM)
        assert res["state"]["loggra"] == loggra
        assert res["state"]["adam"] == optimizer_state_bytes(specs, "adam")
    if pp == 2:  # tied embeddings: the last stage trains its own copy of the output layer
        assert "output_layer.weight" in results[1]["shapes"]


def _zero1_rank(rank: int) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from loggra_megatron.optim import LoGRAConfig, get_loggra_optimizer

    model = tiny_gpt_model(
        num_layers=2,
        hidden_size=40,
        heads=4,
        vocab=64,
        seq=8,
        bf16=True,
        use_cpu_initialization=True,
    )
    ddp = wrap_ddp(model, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=1000)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True)
    # The gradient sketch: a dense-gradient LoGRA whose state ZeRO-1 shards (the default
    # backward sketch's accounting is tests/integration/test_memory_backward_sketch.py's).
    loggra = LoGRAConfig(loggra_sketch="gradient", loggra_rank=8, loggra_min_dim=16)
    opt = get_loggra_optimizer(config, [ddp], loggra)
    tokens = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(rank))
    train_step(ddp, opt, tokens)
    leaves = getattr(opt, "chained_optimizers", [opt])
    shards = [p for o in leaves for g in o.shard_fp32_from_float16_groups for p in g]
    return {
        "grad_buffer": sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers),
        "param_buffer": sum(b.param_data.numel() * 2 for b in ddp.buffers),
        "master": sum(p.numel() * p.element_size() for p in shards),
        "state": state_bytes(opt),
    }


def test_zero1_accounting_matches_megatron_distributed_optimizer_dp2():
    model = TransformerShape(  # tiny_gpt_model: SwiGLU with ffn = 2·hidden, untied, no padding
        num_layers=2,
        hidden_size=40,
        ffn_hidden_size=80,
        num_attention_heads=4,
        vocab_size=64,
        untie_embeddings_and_output_weights=True,
        make_vocab_size_divisible_by=64,
    )
    specs = stage_parameters(model, plan(data_parallel_size=2))
    numel = sum(s.numel for s in specs)
    res = run_distributed(_zero1_rank, 2)
    padding = 2 * 64 * len(specs) + 2 * 128 * 10  # Megatron's param alignment, bucket padding
    for r in res:  # replicated over DP: bf16 params, fp32 grads (grad_reduce_in_fp32)
        assert 0 <= r["param_buffer"] - weight_bytes(specs, 2) <= padding
        assert 0 <= r["grad_buffer"] - grad_bytes(specs, 4) <= 2 * padding
        assert abs(r["master"] - master_param_bytes(specs, dp=2)) <= 0.02 * 4 * numel
        est = optimizer_state_bytes(specs, "loggra", rank=8, min_dim=16, dp=2)
        assert 0.9 * est <= r["state"] <= 1.1 * est
    assert sum(r["master"] for r in res) == 4 * numel  # fp32 masters: an exact DP partition
    assert sum(r["state"] for r in res) <= 2 * optimizer_state_bytes(
        specs, "loggra", rank=8, min_dim=16, dp=2
    )


def test_cli_missing_config_file_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, CLI, "--hf-config", str(tmp_path / "nope.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert names_flag(proc.stderr, "--hf-config") and "no such file" in proc.stderr

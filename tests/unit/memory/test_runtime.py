"""The memory model's terms that real GPU runs showed it needed: the output head's bytes
(measured on the real chunked log-prob code and the full-vocabulary KL), the dynamic
engine's prefill step and its old-log-prob recompute, NCCL's communicator buffers (NVLS
included), the allocator's fragmentation, and the CLI flags that select them (``--bf16``,
``--rollout-engine auto``, ``--nccl-nvls``, ``--expandable-segments``, ``--gpus-per-node``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import weakref
from pathlib import Path

import pytest
import torch
from launch_flags import names_flag
from memory_plans import plan
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from loggra_megatron.config import ConfigError
from loggra_megatron.convert.hf_config import gpt_args_from_hf
from loggra_megatron.memory.model import (
    EstimateConfig,
    GiB,
    TransformerShape,
    estimate_rl_step_memory,
    forward_activation_bytes,
    full_kl_logits_bytes,
    log_prob_head_bytes,
    prefill_tokens,
    rollout_rows,
)
from loggra_megatron.memory.runtime import (
    NCCL_CHANNELS,
    NCCL_FIFO_BYTES,
    NVLS_BYTES_PER_LOCAL_RANK,
    communicators,
)
from loggra_megatron.rollout.dynamic import DynamicEngine

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

REPO = str(Path(__file__).resolve().parents[3])
CONFIG_27B = os.path.join(REPO, "tools", "configs", "llama-style-27b.json")
MiB = 1024**2


def _27b(**fields):
    model = TransformerShape.from_model_args(gpt_args_from_hf(CONFIG_27B))
    return model, plan(tensor_model_parallel_size=8, **fields)


# ---------------------------------------------------------------------- logits, measured
class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors of at least ``min_bytes`` that ops create while it is on
    (storages freed as their last reference goes; views count once; inputs not at all)."""

    def __init__(self, min_bytes: int, *inputs: torch.Tensor):
        super().__init__()
        self.min_bytes, self.peak = min_bytes, 0
        self.live = {t.untyped_storage().data_ptr(): 0 for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() >= self.min_bytes and key not in self.live:
                    self.live[key] = storage.nbytes()
                    weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def test_output_head_bytes_bound_the_real_chunked_code():
    """What the model charges for the output head bounds what ``model/output_head.py``
    allocates, chunk after chunk, at any micro-batch: a forward-only pass keeps one chunk's
    bf16 logits and their fp32 copy (6·c·V_t: its ``exp`` is in place), the training backward
    one chunk's, the output weight's fp32 gradient and a chunk's (6·c·V_t + 6·V_t·h) and the
    input's gradient (2·n·h): the model's count to the byte, but for the saved log-sum-exp
    (4·n, below the tracked size). The unchunked logits alone (6·n·V_t) would exceed it."""
    from loggra_megatron.model.output_head import chunked_token_log_probs

    n, v, h, c = 96, 1024, 32, 32  # three chunks of 32 tokens
    shape = TransformerShape(1, h, 64, 4, v)
    step = plan(log_prob_chunk_size=c)
    hidden = torch.randn(n, h, dtype=torch.bfloat16)
    weight = torch.randn(v, h, dtype=torch.bfloat16)
    targets = torch.randint(0, v, (n,))
    with torch.no_grad(), LiveBytes(1024, hidden, weight) as mode:
        out = chunked_token_log_probs(hidden, weight, targets, c)
    model = log_prob_head_bytes(shape, step, n)
    assert out.shape == (n,) and mode.peak == 6 * c * v == model < 6 * n * v
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with LiveBytes(1024, hidden, weight) as mode:
        chunked_token_log_probs(hidden, weight, targets, c).sum().backward()
    model = log_prob_head_bytes(shape, step, n, training=True)
    assert mode.peak == 6 * c * v + 6 * v * h + 2 * n * h
    assert mode.peak + 4 * n == model < 6 * n * v + 6 * v * h


def test_full_kl_bytes_are_measured_on_the_kl_code():
    """The ``full`` estimator's trial: 16 B per candidate logit (its fp32 logits, and
    ``vocab_parallel_kl``'s ``p_old``, ``z_old − z_new`` and their product) next to the kept
    fp32 reference logits (4 B)."""
    from loggra_megatron.model.vocab_parallel import vocab_parallel_kl

    b, s, v, h = 2, 16, 1024, 32
    n = b * s * v
    hidden = torch.randn(b, s, h, dtype=torch.bfloat16)
    weight = torch.randn(v, h, dtype=torch.bfloat16)
    reference = torch.randn(b, s, v)  # kept from the trial's reference forward
    with torch.no_grad(), LiveBytes(4 * n, hidden, weight, reference) as mode:
        z = (hidden @ weight.t()).float()  # the candidate's logits, in fp32
        kl = vocab_parallel_kl(reference, z)
        del z
    assert kl.shape == (b, s) and mode.peak == 16 * n
    model, step = _27b(seq_length=16384)
    per_row = 16384 * model.padded_vocab_size(8) // 8
    assert full_kl_logits_bytes(model, step, 3, 1) == 4 * 3 * per_row + 16 * per_row
    trial = dataclasses.replace(step, kl_trial_rows=3, forward_micro_batch_size=2)
    est = estimate_rl_step_memory(model, trial)
    assert est.kl_probe_logits == 4 * 3 * per_row + 16 * 2 * per_row


# ---------------------------------------------------------------------- the dynamic engine
def test_dynamic_engine_prefills_every_prompt_in_one_step():
    """The 27B example: 64 prompts of 1k tokens fit the 524288-token step budget, so the
    dynamic engine prefills 65536 tokens at once (the static engine: a chunk of 32 rows),
    rounded as Megatron's DynamicInferenceContext rounds."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    from loggra_megatron.rollout.dynamic.generate import DEFAULT_BLOCK_SIZE

    assert DynamicEngine.block_tokens == DEFAULT_BLOCK_SIZE
    assert DynamicEngine.token_rounder == DynamicInferenceContext.TOKEN_ROUNDER
    model, par = _27b(sequence_parallel=True)
    s, new, m = 16384, 15360, 524288
    static = dataclasses.replace(
        par, seq_length=s, max_new_tokens=new, rollout_batch_size=64, inference_max_tokens=m
    )
    dynamic = dataclasses.replace(static, rollout_engine="dynamic")
    assert rollout_rows(static) == 32  # one prefill per GRPO group of the chunk's rows
    assert prefill_tokens(static) == 32 // static.num_generations * 1024
    assert prefill_tokens(dataclasses.replace(static, num_generations=3)) == 12 * 1024
    # the dynamic engine admits as many requests as its blocks hold at full length
    # (524288 / 16384 = 32: none evicted) and prefills them in one flat step
    assert prefill_tokens(dynamic) == 32 * 1024 and rollout_rows(dynamic) == 32
    b = estimate_rl_step_memory(model, dynamic)
    assert b.prefill_activations == forward_activation_bytes(
        model, par, 1, 32768, sequence_parallel=False
    )
    every_row = dataclasses.replace(static, num_generations=1)  # a prefill of each row
    assert b.prefill_activations == estimate_rl_step_memory(model, every_row).prefill_activations
    for tp, budget, prompt in ((8, 30000, 1024), (3, 30000, 1024), (1, 4097, 100), (8, None, 7)):
        step = plan(
            tensor_model_parallel_size=tp,
            seq_length=prompt + 16,
            max_new_tokens=16,
            rollout_batch_size=64,
            inference_max_tokens=budget,
            rollout_engine="dynamic",
        )
        rows = rollout_rows(step)  # the requests in flight
        want = min(rows * prompt, budget or rows * prompt)
        assert prefill_tokens(step) == DynamicInferenceContext.round_up_tokens(want, tp)
    # no rollout: nothing
    assert prefill_tokens(dataclasses.replace(dynamic, rollout_batch_size=0)) == 0


def test_dynamic_engine_recomputes_old_log_probs_in_log_prob_micro_batches():
    """The recompute after generation is a phase of its own, sized like the reference
    forward (--log-prob-micro-batch-size rows, not --inference-max-tokens // width); the
    static engine samples the log-probs while decoding and has none, nor has a step of one
    update (π_old is the training forward's own)."""
    model, par = _27b(sequence_parallel=True)
    s = 16384
    dyn = dataclasses.replace(
        par,
        seq_length=s,
        rollout_batch_size=64,
        inference_max_tokens=32 * s,
        rollout_engine="dynamic",
        old_log_probs="recompute",  # several updates per RL step
        forward_micro_batch_size=4,
        reference_model=True,
    )
    b = estimate_rl_step_memory(model, dyn)
    assert b.old_log_prob_activations == forward_activation_bytes(model, par, 4, s)
    assert b.old_log_prob_logits == log_prob_head_bytes(model, par, 4 * s)
    assert b.phases()["old log-probs"] == b.phases()["ref log-probs"]
    for budget in (s, 64 * s):  # the KV budget does not size it
        other = estimate_rl_step_memory(
            model, dataclasses.replace(dyn, inference_max_tokens=budget)
        )
        assert other.phases()["old log-probs"] == b.phases()["old log-probs"]
    no_ref = estimate_rl_step_memory(model, dataclasses.replace(dyn, reference_model=False))
    assert no_ref.phases()["old log-probs"] == b.phases()["old log-probs"]
    assert no_ref.phases()["ref log-probs"] == 0
    one = estimate_rl_step_memory(model, dataclasses.replace(dyn, forward_micro_batch_size=1))
    assert one.old_log_prob_activations == forward_activation_bytes(model, par, 1, s)
    for step in (
        dataclasses.replace(dyn, rollout_engine="static", old_log_probs="rollout"),
        dataclasses.replace(dyn, old_log_probs="training"),  # one update: on-policy
        dataclasses.replace(dyn, rollout_batch_size=0),
    ):
        assert estimate_rl_step_memory(model, step).phases()["old log-probs"] == 0


# ---------------------------------------------------------------------- NCCL, allocator
def test_nccl_communicators_and_nvls_buffers():
    fifo, nvls = NCCL_FIFO_BYTES, NVLS_BYTES_PER_LOCAL_RANK
    assert fifo == 4 * MiB + 4_915_200 + 512 * 1024  # Simple + LL128 + LL, NCCL's defaults
    assert nvls == 32 * MiB  # 16 channels x 2 x 128 KiB x 8 steps
    one_node = plan(tensor_model_parallel_size=8)
    assert communicators(one_node, 8) == [
        ("world", 8, 8),
        ("tensor", 8, 8),
        ("distributed-optimizer instance", 8, 8),
    ]
    two_nodes = plan(tensor_model_parallel_size=8, data_parallel_size=2, seq_length=8)
    assert [(n, r, loc) for n, r, loc in communicators(two_nodes, 8) if n.startswith("data")] == [
        ("data", 2, 1),
        ("data (Megatron DDP)", 2, 1),
    ]
    pipeline = plan(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=4, distributed_optimizer=False
    )
    assert communicators(pipeline, 8) == [
        ("world", 8, 8),
        ("tensor", 2, 2),
        ("pipeline", 4, 4),
        ("model", 8, 8),
    ]
    assert communicators(plan(), 8) == []  # one GPU: no communicator
    model = TransformerShape(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8, vocab_size=256
    )
    b = estimate_rl_step_memory(model, two_nodes)
    assert b.nccl_buffers == 5 * NCCL_CHANNELS * NCCL_FIFO_BYTES
    assert b.nvls_buffers == 3 * 8 * 32 * MiB  # DP stays across nodes: one GPU per node
    off = estimate_rl_step_memory(model, two_nodes, EstimateConfig(nccl_nvls=False))
    assert off.nvls_buffers == 0 and off.static_bytes == b.static_bytes - b.nvls_buffers
    single = estimate_rl_step_memory(model, plan(seq_length=8))
    assert single.nccl_buffers == single.nvls_buffers == 0
    with pytest.raises(ConfigError, match="gpus_per_node|gpus-per-node"):
        EstimateConfig(gpus_per_node=0)


def test_fragmentation_is_the_kv_buffer_without_expandable_segments():
    model, par = _27b(sequence_parallel=True)
    step = dataclasses.replace(
        par,
        seq_length=16384,
        rollout_batch_size=64,
        inference_max_tokens=2**19,
        rollout_engine="dynamic",
    )
    plain = estimate_rl_step_memory(model, step)
    assert plain.allocator_fragmentation == plain.kv_cache == 16 * GiB
    b = estimate_rl_step_memory(model, step, EstimateConfig(expandable_segments=True))
    assert b.allocator_fragmentation == 0
    assert b.phases()["rollout"] == plain.phases()["rollout"] - 16 * GiB


# ---------------------------------------------------------------------- the capacity
def test_capacity_is_the_gpu_less_the_cuda_context_and_the_report_says_so(capsys):
    """--gpu-memory-gb's default is what the process can allocate on an H100 80GB, its
    81559 MiB less a 560 MiB CUDA context (79.1 GiB); the runtime allowance and NCCL's
    buffers are terms of the total compared with it, and the report states all three."""
    from loggra_megatron.memory import capacity

    assert capacity.H100_80GB_CAPACITY_GIB == 79.1 == EstimateConfig().gpu_memory_gb
    assert (capacity.H100_80GB_TOTAL_MIB - capacity.CUDA_CONTEXT_MIB) * MiB == pytest.approx(
        79.1 * GiB, abs=MiB
    )
    assert EstimateConfig().runtime_overhead_gb == capacity.RUNTIME_OVERHEAD_GIB
    res = json.loads(_printed(capsys, [*BASE, "--bf16", "--json"]))["loggra"]
    terms = res["runtime_overhead"] + res["nccl_buffers"] + res["nvls_buffers"]
    assert terms > 2 and res["total"] > terms  # counted in the total, not off the capacity
    out = _printed(capsys, [*BASE, "--bf16"])
    line = next(x for x in out.splitlines() if x.startswith("capacity"))
    assert "79.1 GiB per GPU" in line and "CUDA context" in line and "79.65 - 0.55" in line
    assert "runtime overhead 2.00" in line and "NCCL" in line
    assert "fits 79.1 GiB" in out  # the verdict, without --gpu-memory-gb
    small = _printed(capsys, [*BASE, "--bf16", "--gpu-memory-gb", "40"])
    assert "capacity  40 GiB per GPU" in small and "fits 40 GiB" in small


def _printed(capsys, argv) -> str:
    assert _cli().main(argv) == 0
    return capsys.readouterr().out


# ---------------------------------------------------------------------- the CLI
def _cli():
    spec = importlib.util.spec_from_file_location(
        "estimate_memory_cli", os.path.join(REPO, "tools", "estimate_memory.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BASE = [
    "--hf-config",
    CONFIG_27B,
    "--tensor-model-parallel-size",
    "8",
    "--world-size",
    "16",
    "--sequence-parallel",
    "--seq-length",
    "8192",
    "--max-new-tokens",
    "4096",
    "--prompts-per-step",
    "4",
    "--num-generations",
    "8",
    "--kl-coef",
    "0.001",
]


def _json(capsys, argv) -> dict:
    assert _cli().main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["loggra"]


def test_cli_runtime_flags_and_pretrain_rl_precision(capsys):
    bf16 = _json(capsys, [*BASE, "--bf16"])
    fp32 = _json(capsys, BASE)  # pretrain_rl.py without --bf16: fp32 params, static engine
    assert fp32["weights"] == pytest.approx(2 * bf16["weights"]) and fp32["master_params"] == 0
    assert fp32["phases"]["old log-probs"] == 0 < bf16["phases"]["old log-probs"]
    static_engine = _json(capsys, [*BASE, "--bf16", "--rollout-engine", "static"])
    assert static_engine["phases"]["old log-probs"] == 0  # auto: the dynamic engine recomputes
    assert bf16["nvls_buffers"] == pytest.approx(3 * 8 * 32 / 1024)  # world, TP, dist-opt
    assert bf16["nccl_buffers"] == pytest.approx(5 * NCCL_CHANNELS * NCCL_FIFO_BYTES / GiB)
    assert bf16["allocator_fragmentation"] == bf16["kv_cache"] > 0
    env = _json(capsys, [*BASE, "--bf16", "--no-nccl-nvls", "--expandable-segments"])
    assert env["nvls_buffers"] == env["allocator_fragmentation"] == 0
    rollout = bf16["phases"]["rollout"] - bf16["allocator_fragmentation"]
    assert env["phases"]["rollout"] == pytest.approx(rollout)
    static = {k: v["total"] - max(v["phases"].values()) for k, v in (("a", bf16), ("b", env))}
    assert static["b"] == pytest.approx(static["a"] - bf16["nvls_buffers"])
    spread = _json(capsys, [*BASE, "--bf16", "--gpus-per-node", "4"])  # TP spans two nodes
    assert spread["nvls_buffers"] == pytest.approx(3 * 4 * 32 / 1024)


FP8 = ["--bf16", "--fp8-format", "hybrid"]


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--fp8-format", "hybrid"], "--fp8-format"),  # FP8 needs --bf16, as pretrain_rl.py
        (["--gpus-per-node", "0"], "--gpus-per-node"),
        # (auto takes the static engine for blockwise FP8, as pretrain_rl.py on a GPU)
        ([*FP8, "--fp8-recipe", "blockwise", "--rollout-engine", "dynamic"], "--rollout-engine"),
    ],
)
def test_cli_refuses_runtime_and_precision_flags(extra, flag, capsys):
    with pytest.raises(SystemExit) as e:
        _cli().main([*BASE, *extra])
    assert e.value.code == 2 and names_flag(capsys.readouterr().err, flag)

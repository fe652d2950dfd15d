"""The real Megatron-Core (GPTModel, DDP, DistributedOptimizer, 1F1B) on CPU/gloo, 2 ranks.

Each distributed test runs 2 workers via ``loggra_megatron.testing.run_distributed``;
the worker functions below must stay at module level (they are pickled by reference).
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from loggra_megatron import cpu
from loggra_megatron.testing import run_distributed, tiny_gpt_model, train_step, wrap_ddp

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

VOCAB, SEQ, STEPS = 64, 16, 5


# ---------------------------------------------------------------- enable / refuse (in-process)


class _AllocInBackward(torch.autograd.Function):
    """Allocates on "cuda" in backward, like Megatron's TP autograd functions and recompute."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * torch.full_like(g, 2.0, device=torch.cuda.current_device())


def test_enable_is_idempotent_and_redirects(monkeypatch):
    if cpu.is_cpu_megatron_enabled():
        pytest.skip("CPU mode already enabled in this process")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        cpu.enable_cpu_megatron()
    assert not cpu.is_cpu_megatron_enabled()
    monkeypatch.undo()

    original_current_device = torch.cuda.current_device
    depth = torch._C._len_torch_function_stack()
    try:
        cpu.enable_cpu_megatron()
        cpu.enable_cpu_megatron()  # second call: no-op
        assert cpu.is_cpu_megatron_enabled()
        assert torch._C._len_torch_function_stack() == depth + 1
        assert torch.cuda.current_device() == 0
        assert torch.empty(3, device="cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(2).to("cuda:0").device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(2).type("torch.cuda.HalfTensor").dtype == torch.float16
        # "CUDA" RNG == the CPU generator.
        torch.cuda.manual_seed(7)
        a = torch.rand(3)
        torch.manual_seed(7)
        assert torch.equal(a, torch.rand(3))
        state = torch.cuda.get_rng_state()
        b = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(b, torch.rand(3))
        torch.cuda.synchronize()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream())
        with torch.cuda.stream(torch.cuda.Stream()):
            pass
        # The mode stays active inside the backward pass (both entry points).
        x = torch.ones(3, requires_grad=True)
        _AllocInBackward.apply(x).sum().backward()
        torch.autograd.backward(_AllocInBackward.apply(x).sum())
        assert torch.equal(x.grad, torch.full((3,), 4.0))
    finally:
        cpu.disable_cpu_megatron()
    assert not cpu.is_cpu_megatron_enabled()
    assert torch.cuda.current_device is original_current_device
    assert torch._C._len_torch_function_stack() == depth
    assert torch.ones(2).type() == "torch.FloatTensor"


def test_force_enables_on_gpu_machine(monkeypatch):
    if cpu.is_cpu_megatron_enabled():
        pytest.skip("CPU mode already enabled in this process")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with cpu.cpu_megatron(force=True):
        assert cpu.is_cpu_megatron_enabled()
        assert torch.empty(1, device="cuda").device.type == "cpu"
    assert not cpu.is_cpu_megatron_enabled()


# ---------------------------------------------------------------- distributed workers


def _local_shard_numel(optimizer) -> int:
    """Number of parameter elements this rank's DistributedOptimizer(s) update."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(p.numel() for o in chained for g in o.optimizer.param_groups for p in g["params"])


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(
    rank, *, num_microbatches=1, per_rank_data=False, steps=STEPS, bf16=False, **model_kwargs
):
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    ddp = wrap_ddp(tiny_gpt_model(vocab=VOCAB, seq=SEQ, bf16=bf16, **model_kwargs))
    config = OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.0, bf16=bf16, use_distributed_optimizer=True
    )
    opt = get_megatron_optimizer(config, [ddp])
    gen = torch.Generator().manual_seed(100 + (rank if per_rank_data else 0))
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=gen)
    before = _params(ddp)
    losses, results, grad_seen = [], [], set()
    for _ in range(steps):
        loss, (ok, grad_norm, _zeros) = train_step(ddp, opt, tokens, num_microbatches)
        losses.append(loss)
        results.append((bool(ok), float(grad_norm)))
        grad_seen |= {n for n, p in ddp.named_parameters() if p.main_grad.abs().sum() > 0}
    with get_cuda_rng_tracker().fork():  # model-parallel RNG stream
        tp_rand = torch.rand(4)
    return dict(
        losses=losses,
        results=results,
        before=before,
        after=_params(ddp),
        grad_seen=grad_seen,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        shard_numel=_local_shard_numel(opt),
        param_dtypes={p.dtype for p in ddp.parameters()},
        main_param_dtypes={
            p.dtype
            for o in getattr(opt, "chained_optimizers", [opt])
            for g in o.optimizer.param_groups
            for p in g["params"]
        },
        total_numel=sum(p.numel() for p in ddp.parameters()),
        tp_rand=tp_rand,
        dp_rand=torch.rand(4),  # default ("data-parallel") stream
        grad_buffer_devices={str(b.grad_data.device) for b in ddp.buffers},
        schedule=get_forward_backward_func().__name__,
    )


def _check_training(r, expect_loss=True):
    assert all(ok for ok, _ in r["results"]), r["results"]
    assert all(math.isfinite(g) and g > 0 for _, g in r["results"]), r["results"]
    if expect_loss:
        losses = r["losses"]
        assert all(math.isfinite(x) for x in losses), losses
        assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
        assert losses[-1] < losses[0] - 0.1, losses
    assert r["grad_seen"] == set(r["before"])  # every parameter received a gradient ...
    unchanged = [n for n in r["before"] if torch.equal(r["before"][n], r["after"][n])]
    assert not unchanged  # ... and was updated (weight_decay=0, so only via gradients)
    assert r["grad_buffer_devices"] == {"cpu"}


# ---------------------------------------------------------------- distributed tests


def test_tp2_forward_backward_distributed_optimizer():
    r0, r1 = run_distributed(_train, 2, tp=2)
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1) and r0["dp_size"] == 1
    for r in (r0, r1):
        _check_training(r)
    # Both TP ranks compute the same (vocab-parallel) loss.
    assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-5)
    fc1 = "module.decoder.layers.0.mlp.linear_fc1.weight"
    assert r0["before"][fc1].shape == (64, 32)  # SwiGLU: 2 * ffn(64) / tp(2) rows
    # TP ranks hold different shards (different "CUDA" RNG stream per TP rank) ...
    for name in (fc1, "module.output_layer.weight", "module.embedding.word_embeddings.weight"):
        assert not torch.allclose(r0["before"][name], r1["before"][name]), name
    assert not torch.equal(r0["tp_rand"], r1["tp_rand"])
    assert torch.equal(r0["dp_rand"], r1["dp_rand"])
    # ... while replicated (non-TP) parameters stay identical after training.
    norm = "module.decoder.final_layernorm.weight"
    assert torch.allclose(r0["after"][norm], r1["after"][norm], atol=1e-6)


def test_tp2_recompute_replays_dropout_rng():
    kw = dict(tp=2, steps=3, hidden_dropout=0.1, attention_dropout=0.1)
    plain = run_distributed(_train, 2, **kw)
    full = run_distributed(
        _train,
        2,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        **kw,
    )
    no_dropout = run_distributed(_train, 2, tp=2, steps=3)
    assert plain[0]["losses"] != no_dropout[0]["losses"]  # dropout is really active
    for a, b in zip(plain, full, strict=True):
        assert a["losses"] == b["losses"]  # bit-identical: recompute restored the RNG states
        for n in a["after"]:
            assert torch.equal(a["after"][n], b["after"][n]), n


def test_pp2_1f1b_schedule_distributed_optimizer():
    r0, r1 = run_distributed(_train, 2, pp=2, num_microbatches=4)
    assert r0["schedule"] == r1["schedule"] == "forward_backward_pipelining_without_interleaving"
    assert (r0["pp_rank"], r1["pp_rank"]) == (0, 1)
    assert all(x is None for x in r0["losses"])  # only the last stage sees the loss
    _check_training(r0, expect_loss=False)  # stage-0 grads arrived via p2p from stage 1
    _check_training(r1)
    assert any("embedding" in n for n in r0["before"])
    assert not any("output_layer" in n for n in r0["before"])
    assert any("output_layer" in n for n in r1["before"])
    assert not any("embedding" in n for n in r1["before"])


def test_dp2_distributed_optimizer_shards_and_syncs():
    r0, r1 = run_distributed(_train, 2, per_rank_data=True, num_microbatches=2)
    assert r0["dp_size"] == r1["dp_size"] == 2
    for r in (r0, r1):
        _check_training(r)
    assert r0["losses"] != r1["losses"]  # different data per DP rank ...
    for n in r0["after"]:  # ... yet identical replicas: grads averaged, params all-gathered
        assert torch.equal(r0["before"][n], r1["before"][n]), n
        assert torch.allclose(r0["after"][n], r1["after"][n], atol=1e-6), n
    # The distributed optimizer really shards: each rank updates part of the parameters.
    total = r0["total_numel"]
    assert r0["shard_numel"] + r1["shard_numel"] == total
    assert 0 < r0["shard_numel"] < total and 0 < r1["shard_numel"] < total


def test_dp2_bf16_params_keep_fp32_main_params():
    r0, r1 = run_distributed(_train, 2, bf16=True, per_rank_data=True, steps=3)
    for r in (r0, r1):
        _check_training(r)
        assert r["param_dtypes"] == {torch.bfloat16}
        assert r["main_param_dtypes"] == {torch.float32}  # via param.type() == 'torch.cuda.BF16..'
    for n in r0["after"]:
        assert torch.equal(r0["after"][n], r1["after"][n]), n


# ---------------------------------------------------------------- harness failure modes


def _fail_on_rank1(rank):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def _exit_on_rank1(rank):
    if rank == 1:
        os._exit(3)
    return rank


def _hang(rank):
    time.sleep(60)


def _env_probe(rank, suffix, *, scale):
    return os.environ["LOGGRA_PROBE"] + suffix, os.getcwd(), int(os.environ["RANK"]) * scale


def test_run_distributed_forwards_args_env_and_cwd(monkeypatch, tmp_path):
    monkeypatch.setenv("LOGGRA_PROBE", "probe")
    monkeypatch.chdir(tmp_path)
    results = run_distributed(_env_probe, 2, "!", scale=10)
    assert results == [("probe!", str(tmp_path), 0), ("probe!", str(tmp_path), 10)]


def test_run_distributed_propagates_worker_errors():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1.*ValueError: boom from rank 1"):
        run_distributed(_fail_on_rank1, 2)
    with pytest.raises(RuntimeError, match=r"(?s)rank 1.*exited with code 3"):
        run_distributed(_exit_on_rank1, 2)
    with pytest.raises(TimeoutError):
        run_distributed(_hang, 2, timeout=3)


@pytest.mark.slow
def test_run_distributed_spawn_start_method():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1.*ValueError: boom from rank 1"):
        run_distributed(_fail_on_rank1, 2, start_method="spawn")


def _rank_of_world(rank):
    import torch.distributed as dist

    return (rank, dist.get_world_size())


def test_run_distributed_retries_a_taken_rendezvous_port(monkeypatch):
    """The rendezvous port taken between rendezvous_port() and the bind (a second pytest run
    on the machine that chose the same port) is a fresh launch, not a failed test."""
    import socket

    from loggra_megatron import testing

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = iter([held.getsockname()[1], testing.rendezvous_port()])
        monkeypatch.setattr(testing, "rendezvous_port", lambda: next(ports))
        assert run_distributed(_rank_of_world, 2) == [(0, 2), (1, 2)]
        assert next(ports, None) is None  # the second launch took the second port

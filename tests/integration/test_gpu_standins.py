"""The GPU path on CPU through ``tests/helpers/gpu_standins.py`` (what Transformer Engine and flash-attn
enforce): the 27B example's flag set end to end, and the failures real GPU runs hit at
the first step, each of which fails here without its fix."""

from __future__ import annotations

import json

import pytest
import torch
from rl_runs import tiny_argv, torchrun

from loggra_megatron.metrics import read_metrics
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def _reports(report_dir, nproc: int = 2) -> list[dict]:
    return [json.loads((report_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def _run(tmp_path, argv, nproc: int = 2) -> tuple[list[dict], object]:
    report = tmp_path / "report"
    script = "tests/helpers/gpu_standins.py"
    proc = torchrun([str(report), "--", *argv], nproc=nproc, script=script, check=False)
    reports = _reports(report, nproc)
    for rank, r in enumerate(reports):
        assert r["exit"] == 0, f"rank {rank} exited {r['exit']}: {proc.stderr[-4000:]}"
        assert r["violations"] == [], f"rank {rank}:\n" + "\n".join(r["violations"][:5])
    return reports, proc


# The flags of examples/h100_8gpu/train_27b_loggra.sh, scaled down to 2 CPU processes:
# TP=2 with sequence parallelism, FP8 through TE layers, full recompute of every layer, the
# dynamic engine with a KV budget, no supervised warm-up (the first FP8 forward of the run is
# then the engine's, under inference mode), LoGRA with remainders, predicted-KL control (k3)
# and a KL penalty. The example itself runs --loggra-sketch backward: this dict keeps the
# gradient sketch, and test_27b_example_flags_with_the_backward_sketch adds the published one.
EXAMPLE_27B = {
    "tensor-model-parallel-size": 2,
    "bf16": True,
    "fp8-format": "hybrid",
    "transformer-impl": "transformer_engine",
    "sequence-parallel": True,
    "recompute-granularity": "full",
    "recompute-method": "uniform",
    "recompute-num-layers": 1,
    "rollout-engine": "auto",
    "inference-max-tokens": 64,
    "micro-batch-size": 1,
    "log-prob-micro-batch-size": 2,
    "optimizer": "loggra",
    "loggra-param-remainders": True,
    "kl-target": 0.01,
    "kl-estimator": "k3",
    "kl-coef": 0.001,
    "sft-iters": 0,
}


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_27b_example_flags_run_end_to_end_through_the_standins(tokenizer, tmp_path, recipe):
    """Two RL steps with the example's flags (``--fp8-recipe`` delayed, with FP8 rollouts: the
    recompute writes into TE's FP8 meta in place; tensorwise, the default, with the default
    bf16 rollouts: it does not) on the simulated CUDA
    device: the dynamic engine is chosen and runs, every FP8 GEMM meets TE's shape rule, the
    FP8 state is made outside inference mode (otherwise the first recompute backward
    raised "Inplace update to inference tensor outside InferenceMode"), every tensor is on
    the device, and the step is trained and controlled. Under current scaling TE's amax
    all-reduce over TP runs in the training forwards and never while generating."""
    out = tmp_path / "out"
    flags = {**EXAMPLE_27B, "fp8-recipe": recipe, "output-dir": out}
    flags["rollout-fp8"] = recipe == "delayed"  # FP8 rollouts: the first FP8 forward is theirs
    reports, proc = _run(tmp_path, tiny_argv(tokenizer, **flags))
    assert "rollouts: dynamic engine" in proc.stdout
    for r in reports:
        record = r["record"]
        assert record["fp8_forwards"] > 0 and record["fp8_meta_created"] == 16  # 2 models
        # the engine's steps run under inference mode: FP8 there with --rollout-fp8 only
        assert (record["fp8_forwards_in_inference_mode"] > 0) == (recipe == "delayed")
        assert record["fp8_meta_created_in_inference_mode"] == 0
        assert (record.get("recompute_meta_copies", 0) > 0) == (recipe == "delayed")
        # TE's amax all-reduce over TP: in the training forwards (sequence parallel), never
        # in generation, and kept for training though the first FP8 forward is a rollout's
        assert (record.get("amax_allreduces", 0) > 0) == (recipe == "tensorwise")
        assert record.get("amax_allreduces_without_sp", 0) == 0
        assert record.get("sp_forwards_without_amax_reduction", 0) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["kl/predicted"] > 0 and 0 < m["kl/step_scale"] <= 1 for m in lines)


@pytest.mark.parametrize("generation_tp", [1, 2])
def test_the_split_example_generates_with_the_dynamic_engine_on_its_own_ranks(
    tokenizer, tmp_path, generation_tp
):
    """The 27B split example's flags scaled down (2 training ranks at TP 2 with sequence
    parallelism + generation ranks at TP 1, which Megatron refuses sequence parallelism
    at, or at TP 2 as the example; the backward sketch and the low-rank sync,
    --kl-backup-offload, no --inference-max-tokens) on the simulated CUDA device: the
    generation ranks size the KV budget for their own GPU (the training ranks size none),
    share each sync's buckets and checksum verdict through device tensors (NCCL's rule),
    their dynamic engine generates (in bf16 by default, with FP8 at generation TP 2:
    --rollout-fp8) through the stand-ins, and every sync's checksum matches."""
    out = tmp_path / "out"
    flags = {**EXAMPLE_27B, "inference-max-tokens": None, "output-dir": out, "train-iters": 2}
    flags.update({"loggra-sketch": None, "weight-sync": "lowrank", "kl-backup-offload": True})
    flags.update({"generation-ranks": generation_tp, "weight-sync-check-interval": 1})
    flags["rollout-fp8"] = generation_tp == 2  # else the default: bf16 decode steps
    flags["generation-tensor-model-parallel-size"] = generation_tp
    nproc = 2 + generation_tp
    reports, proc = _run(tmp_path, tiny_argv(tokenizer, **flags), nproc=nproc)
    assert "generation ranks: rollouts: " in proc.stdout
    assert proc.stdout.count("by the memory model for") == 1  # sized once, whatever it found
    assert "rollouts: dynamic engine" in proc.stdout
    decoded = [r["record"]["fp8_forwards_in_inference_mode"] > 0 for r in reports[2:]]
    assert decoded == [generation_tp == 2] * generation_tp  # their engine's decode steps
    rows = read_metrics(out)
    assert [r["sync/checksum_ok"] for r in rows] == [1.0, 1.0]


def test_fp32_run_on_a_gpu_chooses_the_static_engine(tokenizer, tmp_path):
    """flash-attn takes fp16/bf16 only: without --bf16, ``--rollout-engine auto`` is the
    static engine (the dynamic engine used to be chosen, and its attention
    raised)."""
    argv = tiny_argv(tokenizer, **{"rollout-engine": "auto", "output-dir": tmp_path / "out"})
    _, proc = _run(tmp_path, argv)
    assert (
        "rollouts: static engine; --rollout-engine auto: static (not dynamic: flash-attn"
        in proc.stdout
    )


def _sp_fp8_step(rank, seq: int):
    """One forward/backward through Megatron's schedule of the stand-in TE model at TP=4 with
    sequence parallelism and FP8, micro-batch 1, ``seq`` tokens."""
    import gpu_standins
    from megatron.core import parallel_state as ps

    from loggra_megatron.model.forward import run_schedule
    from loggra_megatron.testing import tiny_bf16_gpt_model, wrap_ddp

    gpu_standins.install_transformer_engine()
    model = tiny_bf16_gpt_model(
        num_layers=1,
        hidden_size=64,
        heads=4,
        vocab=64,
        seq=64,
        fp8="hybrid",
        fp8_recipe="tensorwise",
        sequence_parallel=True,
        use_te=True,
    )
    ddp = wrap_ddp(model, use_distributed_optimizer=False)
    tokens = torch.randint(0, 64, (1, seq + 1), generator=torch.Generator().manual_seed(0))

    def step(data_iterator, model):
        batch = next(data_iterator)
        x = batch["tokens"][:, :-1]
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        out = model(x, positions, None, labels=batch["tokens"][:, 1:])
        return out, lambda loss: (loss.float().mean(), {})

    run_schedule(ddp, step, [{"tokens": tokens}], forward_only=False)
    return ps.get_tensor_model_parallel_world_size(), dict(gpu_standins.RECORD)


def test_sp_fp8_pads_the_local_shard_to_te_shape_rule_at_tp4():
    """Under sequence parallelism TE checks the local [s/TP, b, h] shard a column-parallel
    linear receives: at TP=4, micro-batch 1, 10 tokens padded to 16 left 4 rows per rank
    (16 = lcm(TP, 16)); padded to TP × 16 they are 16."""
    results = run_distributed(_sp_fp8_step, 4, 10, tp=4)
    for tp, record in results:
        assert tp == 4 and record["fp8_forwards"] > 0


def _rollouts_after_a_weight_change(rank):
    """Greedy rollouts of an FP8 stand-in model after its weights changed (as an optimizer
    step changes them): as the code runs, with ``set_is_first_microbatch`` turned into a
    no-op, and from a fresh model with the new weights."""
    import gpu_standins
    from megatron.core.utils import unwrap_model

    from loggra_megatron.rollout import RolloutRequest, generate_rollout
    from loggra_megatron.testing import tiny_bf16_gpt_model

    gpu_standins.install_transformer_engine()
    shape = dict(num_layers=1, hidden_size=64, heads=4, vocab=64, seq=32, use_te=True)
    shape.update(fp8="hybrid", fp8_recipe="tensorwise", init_method_std=0.3)
    prompts = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    gen = dict(max_new_tokens=4, temperature=0.0, fp8=True)

    def model_with(state=None):
        torch.manual_seed(0)
        model = tiny_bf16_gpt_model(**shape)
        if state is not None:
            model.load_state_dict(state)
        return model

    model = model_with()
    generate_rollout(model, prompts, RolloutRequest(**gen))  # casts (and caches) the FP8 weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))  # an optimizer step
    state = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
    after = generate_rollout(model, prompts, RolloutRequest(**gen))
    fresh = generate_rollout(model_with(state), prompts, RolloutRequest(**gen))
    inner = unwrap_model(model)
    with torch.no_grad():  # another step, then a rollout that forgets to ask for a recast
        for p in model.parameters():
            p.sub_(0.25)
    inner.set_is_first_microbatch = lambda: None  # the call forgotten
    stale = generate_rollout(model, prompts, RolloutRequest(**gen))
    state = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
    fresh_2 = generate_rollout(model_with(state), prompts, RolloutRequest(**gen))
    return after, fresh, stale, fresh_2


def test_fp8_weight_cache_standin_catches_a_rollout_of_stale_weights():
    """TE computes later micro-batches with the FP8 cast of the first: a rollout after an
    optimizer step samples the new weights only because it asks for a recast
    (``set_is_first_microbatch``). The stand-in models the cache, so the rollout equals a
    fresh model's with the new weights, and without the call it would not."""
    after, fresh, stale, fresh_2 = run_distributed(_rollouts_after_a_weight_change, 1)[0]
    assert torch.equal(after.tokens, fresh.tokens)
    torch.testing.assert_close(after.log_probs, fresh.log_probs)
    assert not torch.allclose(stale.log_probs, fresh_2.log_probs)  # the old weights' numbers


def _bf16_rollouts_of_an_fp8_model(rank):
    """An FP8 stand-in model's rollouts, by default (bf16) and with ``fp8=True``, and its FP8
    forward after a weight change and a bf16 rollout, beside a fresh model's."""
    import gpu_standins
    from decoder_records import recorded_decoders

    from loggra_megatron.rollout import RolloutRequest, generate_rollout
    from loggra_megatron.testing import tiny_bf16_gpt_model

    gpu_standins.install_transformer_engine()
    shape = dict(num_layers=1, hidden_size=64, heads=4, vocab=64, seq=32, use_te=True)
    shape.update(fp8="hybrid", fp8_recipe="tensorwise", init_method_std=0.3)
    prompts = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    gen = dict(max_new_tokens=4, temperature=0.0)
    torch.manual_seed(0)
    model = tiny_bf16_gpt_model(**shape)
    out = {}
    with recorded_decoders() as made:
        for key, fp8 in (("bf16", False), ("fp8", True)):
            before = gpu_standins.RECORD["fp8_forwards"]
            out[key] = generate_rollout(model, prompts, RolloutRequest(fp8=fp8, **gen))
            out[f"{key}_fp8_forwards"] = gpu_standins.RECORD["fp8_forwards"] - before
            out[f"{key}_graphs"] = made[-1].graphs is not None
    out["fp8_after"] = model.config.fp8
    x = prompts[:2]
    positions = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        model(x, positions, None)  # an FP8 forward: casts the weights
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))  # an optimizer step
        generate_rollout(model, prompts, RolloutRequest(**gen))  # bf16
        out["forward"] = model(x, positions, None)
        fresh = tiny_bf16_gpt_model(**shape)
        fresh.load_state_dict({k: v for k, v in model.state_dict().items() if v is not None})
        out["fresh_forward"] = fresh(x, positions, None)
    return out


def test_an_fp8_model_decodes_in_bf16_through_the_step_graphs_by_default():
    """By default an FP8 policy decodes outside FP8 (no FP8 GEMM in the rollout) through the
    step graphs, with ``fp8=True`` (``--rollout-fp8``) in FP8, eagerly: the same greedy
    tokens through the stand-in. The config's FP8 comes back after, and the first FP8
    forward after a bf16 rollout recasts the changed weights (Megatron's TE wrappers
    clear the recast request after the rollout's bf16 forwards too)."""
    out = run_distributed(_bf16_rollouts_of_an_fp8_model, 1)[0]
    assert out["bf16_fp8_forwards"] == 0 and out["bf16_graphs"]
    assert out["fp8_fp8_forwards"] > 0 and not out["fp8_graphs"]
    assert torch.equal(out["bf16"].tokens, out["fp8"].tokens)
    assert out["fp8_after"] == "hybrid"
    torch.testing.assert_close(out["forward"], out["fresh_forward"])


# ---------------------------------------------------------------- the stand-ins themselves


def test_fp8_shape_rule_is_te_rule():
    import gpu_standins

    gpu_standins.assert_dim_for_fp8_exec(torch.empty(4, 2, 32), torch.empty(48, 64))
    with pytest.raises(AssertionError, match="divisible by 8"):
        gpu_standins.assert_dim_for_fp8_exec(torch.empty(4, 1, 64))  # the TP=4 shard of 16
    with pytest.raises(AssertionError, match="divisible by 16"):
        gpu_standins.assert_dim_for_fp8_exec(torch.empty(8, 40))


def _meta_in_inference_mode(rank, warm_up: bool):
    """A stand-in TE model at delayed scaling whose first FP8 forward runs under
    inference_mode (or after a no_grad warm-up), then a training step with full recompute."""
    import gpu_standins

    from loggra_megatron.model.forward import initialize_fp8_state, run_schedule
    from loggra_megatron.rollout.dynamic.generate import _inference_state  # RoPE cache, FP8 casts
    from loggra_megatron.testing import tiny_bf16_gpt_model, wrap_ddp

    gpu_standins.install_transformer_engine()
    model = tiny_bf16_gpt_model(
        num_layers=1,
        hidden_size=64,
        heads=4,
        vocab=64,
        seq=32,
        fp8="hybrid",
        fp8_recipe="delayed",
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        use_te=True,
    )
    ddp = wrap_ddp(model, use_distributed_optimizer=False)
    if warm_up:
        initialize_fp8_state(ddp)
    tokens = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0)
    ddp.eval()
    with _inference_state(ddp), torch.inference_mode():  # as the dynamic engine's step
        ddp(tokens[:, :-1], positions, None)
    ddp.train()

    def step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch["tokens"][:, :-1], positions, None, labels=batch["tokens"][:, 1:])
        return out, lambda loss: (loss.float().mean(), {})

    try:
        run_schedule(ddp, step, [{"tokens": tokens}], forward_only=False)
    except RuntimeError as e:
        return str(e)
    return None


def test_fp8_meta_made_under_inference_mode_fails_the_recompute_as_on_a_gpu():
    """The stand-in reproduces TE: FP8 meta made by a first forward under inference mode
    cannot be written by the recompute's copy_; ``initialize_fp8_state`` before it fixes it."""
    (error,) = run_distributed(_meta_in_inference_mode, 1, False)
    assert error and "Inplace update to inference tensor outside InferenceMode" in error
    assert run_distributed(_meta_in_inference_mode, 1, True) == [None]


def test_flash_attn_standin_takes_fp16_and_bf16_only():
    import gpu_standins

    q = torch.randn(3, 2, 8)
    cache = torch.randn(2, 256, 2, 8)  # flash-attn's pages: a multiple of 256 tokens
    lengths, table = torch.tensor([3], dtype=torch.int32), torch.tensor([[0, 1]]).int()
    kwargs = dict(cache_seqlens=lengths, block_table=table)
    with pytest.raises(RuntimeError, match=gpu_standins.FLASH_DTYPE_ERROR):
        gpu_standins.kvcache_attention(q[None, :1], cache, cache, **kwargs)
    out = gpu_standins.kvcache_attention(
        q[None, :1].bfloat16(), cache.bfloat16(), cache.bfloat16(), **kwargs
    )
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_27b_example_flags_with_the_backward_sketch(tokenizer, tmp_path, packing):
    """The example's flags with ``--loggra-sketch backward`` on the simulated CUDA device:
    FP8 linears sketched from their high-precision input under TP=2 + SP, full recompute
    (``P`` from the recomputation), the dynamic engine, predicted-KL control and, packed, THD
    micro-batches; every tensor on the device and TE's rules met."""
    out = tmp_path / "out"
    flags = {**EXAMPLE_27B, "loggra-sketch": "backward", "loggra-min-dim": None}
    if packing:
        flags["sequence-packing"] = True
    reports, _ = _run(tmp_path, tiny_argv(tokenizer, **flags, **{"output-dir": out}))
    assert all(r["record"]["fp8_forwards"] > 0 for r in reports)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["loggra/sketch_norm"] > 0 and m["memory/sketch_buffer_bytes"] > 0
        assert 0 < m["kl/step_scale"] <= 1

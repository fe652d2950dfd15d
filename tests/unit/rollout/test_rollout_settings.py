"""Rollout settings that would do nothing with the engine and device a run takes are refused at
parse time (exit 2, the flag named), as every setting that does not apply is."""

import torch
from rl_runs import refused, tiny_argv

from loggra_megatron.arguments import parse_args
from loggra_megatron.rollout.config import RolloutConfig


def test_dynamic_engine_graph_sizes_are_refused_where_the_static_engine_runs(tokenizer, capsys):
    """--inference-dynamic-batching-num-cuda-graphs 8 was accepted with --rollout-engine auto
    on CPU, where auto takes the static engine, which captures no decode batch sizes."""
    argv = tiny_argv(tokenizer, device="cpu")
    refused(
        [*argv, "--inference-dynamic-batching-num-cuda-graphs", "8"],
        capsys,
        "--inference-dynamic-batching-num-cuda-graphs=8: applies with the dynamic engine only, "
        "and --rollout-engine auto takes the static engine here",
    )
    assert parse_args([*argv, "--inference-dynamic-batching-num-cuda-graphs", "16"], world_size=2)
    rollout = RolloutConfig(inference_dynamic_batching_num_cuda_graphs=8)
    assert list(rollout.problems_with("dynamic", cuda=True)) == []
    assert len(list(rollout.problems_with("static", cuda=True))) == 1


def test_eager_decoding_is_refused_on_cpu(tokenizer, capsys):
    """--no-rollout-cuda-graphs on CPU was accepted: there are no CUDA graphs to turn off."""
    refused(
        [*tiny_argv(tokenizer, device="cpu"), "--no-rollout-cuda-graphs"],
        capsys,
        "--no-rollout-cuda-graphs: applies on a GPU only, and this run computes on CPU",
    )
    assert parse_args([*tiny_argv(tokenizer, device="cpu"), "--rollout-cuda-graphs"], world_size=2)
    assert list(RolloutConfig(rollout_cuda_graphs=False).problems_with("static", cuda=True)) == []


def test_auto_says_which_engine_it_takes_and_why():
    """``--rollout-engine auto`` always names the engine it took and why the engines it
    ranks higher were passed over (a CPU run said nothing)."""
    from loggra_megatron.rollout.protocol import EngineTarget
    from loggra_megatron.rollout.registry import is_fallback, passed_over, select_engine

    engine, note = select_engine("auto", EngineTarget(cuda=False, half=True))
    assert engine.name == "static" and is_fallback(engine)
    assert note.startswith("--rollout-engine auto: static (not dynamic: the dynamic engine needs")
    (why,) = passed_over(engine, EngineTarget(cuda=False, half=True))
    assert note == f"--rollout-engine auto: static ({why})"
    engine, note = select_engine("auto", EngineTarget(cuda=True, half=True), planning=True)
    assert engine.name == "dynamic" and not is_fallback(engine)
    assert note == "--rollout-engine auto: dynamic (the first choice, and it runs here)"
    assert select_engine("static", EngineTarget(cuda=True, half=True), planning=True)[1] is None


def test_auto_does_not_fall_back_to_the_static_engine_for_a_large_model(tokenizer, monkeypatch):
    """A 27B-shaped bf16 run on a GPU without flash-attn was quietly decoded by the static
    engine; auto now refuses to fall back above 3B parameters for what this machine lacks,
    while a named engine, a small model, or a fallback the settings decide (fp32) runs."""
    from loggra_megatron.arguments import validate
    from loggra_megatron.rollout.dynamic import mcore_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mcore_engine, "missing_attention_kernels", lambda: "no flash-attn")
    cfg = parse_args(tiny_argv(tokenizer, device="cpu", bf16=True), world_size=2)
    cfg.parallel.device = "cuda"
    assert validate(cfg) is None  # tiny: the fallback is fine
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 64, 5120, 25600
    m.num_attention_heads, m.num_query_groups = 64, 8
    problem = validate(cfg)
    assert problem.startswith("--rollout-engine: auto would fall back to the static engine")
    assert "28.9B-parameter model (not dynamic: no flash-attn)" in problem
    assert problem.endswith("name the engine: --rollout-engine static")
    cfg.rollout.rollout_engine = "static"
    assert validate(cfg) is None
    cfg.rollout.rollout_engine, m.bf16 = "auto", False  # fp32: the settings' fallback
    assert validate(cfg) is None


def test_rollout_fp8_is_refused_without_fp8(tokenizer, capsys):
    """--rollout-fp8 on a bf16 run would do nothing; with --fp8-format the sampling
    log-probs of a bf16 rollout are not π_old."""
    refused(
        [*tiny_argv(tokenizer, device="cpu"), "--rollout-fp8"],
        capsys,
        "--rollout-fp8=True: applies with --fp8-format only",
    )
    rollout = RolloutConfig()
    assert rollout.decodes_apart("hybrid") and not rollout.decodes_apart(None)
    assert not RolloutConfig(rollout_fp8=True).decodes_apart("hybrid")

"""Rollout settings that would do nothing with the engine and device a run takes are refused at
parse time (exit 2, the flag named), as every setting that does not apply is."""

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

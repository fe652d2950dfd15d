"""The model's Megatron-Core ``TransformerConfig`` sets nothing Megatron-Core deprecates:
0.16's default CUDA-graph scope ``"full"`` warned on every construction (0.19 deprecates
setting the field at all)."""

import warnings

import pytest

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def test_the_model_config_sets_no_deprecated_cuda_graph_scope(monkeypatch):
    from megatron.core import parallel_state

    from loggra_megatron.model.args import GPTModelArgs
    from loggra_megatron.model.build import transformer_config_from_args

    for name in ("tensor", "pipeline"):
        monkeypatch.setattr(parallel_state, f"get_{name}_model_parallel_world_size", lambda: 1)
    args = GPTModelArgs(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = transformer_config_from_args(args)
    assert not [w for w in caught if "cuda_graph_scope" in str(w.message)]
    assert config.cuda_graph_scope in ([], None)  # the whole layer (0.16: [], 0.19: None)

"""``convert.hf_config.gpt_args_from_hf`` (the converter's and the memory estimator's reader)
refuses a config whose sizes are not whole numbers in range, whose flags are not booleans,
whose heads do not split, or whose JSON names a key twice: one ``ValueError`` naming the
field, never a ``ZeroDivisionError`` or a silent misreading."""

import json

import pytest

from loggra_megatron.convert.hf_config import gpt_args_from_hf

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}


def test_a_sound_config_reads():
    args = gpt_args_from_hf(LLAMA)
    assert (args.hidden_size, args.num_query_groups, args.kv_channels) == (64, 2, 16)
    assert args.untie_embeddings_and_output_weights
    tied = gpt_args_from_hf({**LLAMA, "tie_word_embeddings": True})
    assert not tied.untie_embeddings_and_output_weights


@pytest.mark.parametrize(
    "patch, needle",
    [
        ({"num_attention_heads": 0}, "num_attention_heads=0 must be a whole number"),
        ({"hidden_size": "64"}, "hidden_size='64' must be a whole number"),
        ({"hidden_size": 1e30}, "hidden_size=1e+30 must be a whole number"),
        ({"hidden_size": 64.0}, "hidden_size=64.0 must be a whole number"),
        ({"num_hidden_layers": True}, "num_hidden_layers=True must be a whole number"),
        ({"vocab_size": -5}, "vocab_size=-5 must be a whole number"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' must be true or false"),
        ({"hidden_size": 66}, "hidden_size=66 is not divisible by num_attention_heads=4"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of"),
        ({"head_dim": 0}, "head_dim=0 must be a whole number"),
    ],
)
def test_garbage_fields_are_refused_naming_them(patch, needle):
    with pytest.raises(ValueError, match="HF config") as e:
        gpt_args_from_hf({**LLAMA, **patch})
    assert needle in str(e.value)


def test_a_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA)[:-1] + ', "hidden_size": 128}')
    with pytest.raises(ValueError, match="key 'hidden_size' appears twice"):
        gpt_args_from_hf(path)
    path.write_text(json.dumps(LLAMA))
    assert gpt_args_from_hf(path).hidden_size == 64

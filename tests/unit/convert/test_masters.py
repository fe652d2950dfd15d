"""``--export-masters`` refusals, from the checkpoint's metadata alone: Megatron's dense
distributed optimizer (flat buckets), no optimizer state, and an export at other TP/PP sizes
than the training's, each naming the fix; and the checkpoint keys of a LoGRA checkpoint's
masters matched to the model's weights."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loggra_megatron.convert.masters import check_masters, master_keys


def _checkpoint(path, *keys):
    dcp.save({k: torch.zeros(4) for k in keys}, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["decoder.w", "optimizer.distributed.dp_group_idx_0.param"], "without --bf16"),
        (["decoder.w"], "--no-save-optim"),
        (
            ["optimizer.loggra.pp0.tp1.chunk0.module.w.fp32_param"],
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1",
        ),
        (
            ["optimizer.loggra.pp1.tp0.chunk0.w.fp32_param", "optimizer.loggra_sketch.tp0.x"],
            "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2",
        ),
    ],
    ids=["dense-adam", "no-optimizer", "tp", "pp"],
)
def test_an_export_the_checkpoint_cannot_give_is_refused_naming_the_fix(tmp_path, keys, message):
    ckpt = _checkpoint(tmp_path / "ckpt", *keys)
    with pytest.raises(ValueError, match="--export-masters") as e:
        check_masters(ckpt, 1, 1)
    assert message in str(e.value)


def test_a_loggra_checkpoint_at_the_training_sizes_is_accepted(tmp_path):
    keys = ["optimizer.loggra.pp0.tp1.chunk0.w.fp32_param", "optimizer.loggra_sketch.tp1.x"]
    assert set(keys) <= check_masters(_checkpoint(tmp_path / "ckpt", *keys), 2, 1)


class _Layer(torch.nn.Module):
    """A TransformerLayer's shape as ``master_keys`` reads it: a layer number, an MLP."""

    def __init__(self, number):
        super().__init__()
        self.layer_number = number
        self.input_layernorm = torch.nn.LayerNorm(4)
        self.mlp = torch.nn.Module()
        self.mlp.linear_fc1 = torch.nn.Linear(4, 4, bias=False)
        self.mlp.linear_fc2 = torch.nn.Linear(4, 4, bias=False)


def test_master_keys_match_dense_and_sketched_weights_by_name():
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([_Layer(3), _Layer(4)])  # the second stage
    keys = {
        "optimizer.loggra.pp1.tp0.chunk0.module.module.decoder.layers.0.input_layernorm.weight"
        ".fp32_param",
        "optimizer.loggra.pp1.tp0.chunk0.module.decoder.layers.0.input_layernorm.weight.exp_avg",
        "optimizer.loggra_sketch.tp0.layer3.linear_fc1.fp32_param",
        "optimizer.loggra_sketch.tp0.layer4.linear_fc2.fp32_param",
        "optimizer.loggra_sketch.tp1.layer4.linear_fc1.fp32_param",  # another TP rank's
        "optimizer.loggra.pp0.tp0.chunk0.module.decoder.layers.0.mlp.linear_fc2.weight"
        ".fp32_param",  # another stage's
    }
    assert master_keys(model, keys, tp=0, pp=1) == {
        "decoder.layers.0.input_layernorm.weight": "optimizer.loggra.pp1.tp0.chunk0.module."
        "module.decoder.layers.0.input_layernorm.weight.fp32_param",
        "decoder.layers.0.mlp.linear_fc1.weight": "optimizer.loggra_sketch.tp0.layer3."
        "linear_fc1.fp32_param",
        "decoder.layers.1.mlp.linear_fc2.weight": "optimizer.loggra_sketch.tp0.layer4."
        "linear_fc2.fp32_param",
    }

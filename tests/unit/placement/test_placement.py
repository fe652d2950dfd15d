"""``placement``: the roles of the ranks, the flags' checks, and the weight sync's buckets
and digests (the processes themselves: ``tests/integration/test_generation_ranks.py``)."""

import pytest
import torch
from rl_runs import tiny_argv

from loggra_megatron.arguments import parse_args
from loggra_megatron.placement import Placement, Role
from loggra_megatron.placement.weights import TensorDict, digest, pack_buckets, unpack_buckets


def test_the_last_ranks_generate():
    roles = [Placement.of(2, {"WORLD_SIZE": "5", "RANK": str(r)}) for r in range(5)]
    assert [p.role for p in roles] == [Role.TRAINING] * 3 + [Role.GENERATION] * 2
    assert [(p.rank, p.size) for p in roles] == [(0, 3), (1, 3), (2, 3), (0, 2), (1, 2)]
    assert [p.leader for p in roles] == [True, False, False, True, False]
    assert roles[3].name == "generation rank 0 (global rank 3)"
    assert roles[0].peer_leader_name() == "the generation leader (global rank 3)"
    assert Placement.of(0, {"WORLD_SIZE": "2", "RANK": "1"}).role is Role.TRAINING


def test_data_parallel_size_counts_the_training_ranks_only(tokenizer):
    cfg = parse_args(tiny_argv(tokenizer, **{"generation-ranks": 1}), world_size=3)
    assert cfg.training_world_size == 2 and cfg.data_parallel_size == 2


@pytest.mark.parametrize(
    "flags, world, needle",
    [
        ({"generation-ranks": 2}, 2, "--generation-ranks: 2 of a world of 2 ranks leaves none"),
        ({"generation-ranks": -1}, 2, "--generation-ranks=-1: must be >= 0"),
        (
            {"generation-ranks": 1, "generation-tensor-model-parallel-size": 2},
            3,
            "--generation-tensor-model-parallel-size: 2 must divide --generation-ranks 1",
        ),
        (
            {"generation-ranks": 3, "generation-tensor-model-parallel-size": 3},
            4,
            "--generation-tensor-model-parallel-size: 3 must divide the attention heads (4)",
        ),
        ({"weight-sync-check-interval": 5}, 2, "--weight-sync-check-interval=5: applies with"),
        ({"max-policy-lag": 1}, 2, "--max-policy-lag=1: applies with --generation-ranks > 0"),
        (
            {"generation-ranks": 1, "weight-sync": "lowrank", "optimizer": "adam"},
            3,
            "--weight-sync: lowrank sends the backward sketch's row updates; it needs "
            "--optimizer loggra --loggra-sketch backward",
        ),
        (
            {"generation-ranks": 1, "weight-sync": "lowrank"},  # tiny_argv: the gradient sketch
            3,
            "--weight-sync: lowrank sends the backward sketch's row updates",
        ),
        (
            {"generation-ranks": 1, "max-policy-lag": 1},
            3,
            "--max-policy-lag: rollouts up to 1 steps old need the importance weights against "
            "the generating policy; add --tis-cap",
        ),
    ],
)
def test_bad_placements_are_refused_naming_the_flag(tokenizer, capsys, flags, world, needle):
    with pytest.raises(SystemExit) as e:
        parse_args(tiny_argv(tokenizer, **flags), world_size=world)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_the_training_ranks_must_split_over_tp_and_pp(tokenizer, capsys):
    flags = {"generation-ranks": 1, "generation-tensor-model-parallel-size": 1}
    argv = tiny_argv(tokenizer, **flags, **{"tensor-model-parallel-size": 2})
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=4)
    err = capsys.readouterr().err
    assert "must divide the 3 training ranks (torchrun --nproc-per-node less" in err, err


def test_buckets_carry_every_dtype_exactly_and_split_at_the_limit():
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("a", torch.randn(3, 5, generator=g).bfloat16()),
        ("b", torch.randn(7, generator=g)),
        ("c", torch.randint(0, 9, (2, 2), generator=g)),
        ("d", torch.randn(4, 4, generator=g).half()),
    ]
    buckets = list(pack_buckets(tensors, bucket_bytes=40))
    assert [len(specs) for specs, _ in buckets] == [1, 1, 1, 1]  # each above 40 bytes alone
    assert len(list(pack_buckets(tensors, bucket_bytes=2**20))) == 1
    out = {}
    for specs, raw in buckets:
        assert raw.dtype == torch.uint8
        out.update(unpack_buckets(specs, raw.clone()))
    for name, t in tensors:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
    assert digest(tensors) == digest(out.items())


def test_a_digest_changes_with_one_bit_a_name_or_the_order():
    t = torch.randn(4, 4).bfloat16()
    flipped = t.clone()
    flipped.view(torch.int16)[2, 3] ^= 1  # the last mantissa bit of one element
    base = digest([("w", t)])
    assert digest([("w", flipped)]) != base
    assert digest([("v", t)]) != base
    assert digest([("w", t), ("v", t)]) != digest([("v", t), ("w", t)])


def test_tensor_dict_reads_slices_as_the_converter_asks():
    t = torch.arange(24).view(4, 6)
    src = TensorDict({"x": t})
    assert src.shape("x") == (4, 6)
    assert torch.equal(src.read("x"), t)
    assert torch.equal(src.read("x", 1, 2, 5), t[:, 2:5])

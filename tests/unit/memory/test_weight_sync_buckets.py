"""The memory model's term of the backward sketch's DP weight sync follows its buckets
(``optim/megatron/backward_row_gather.py``): one bucket's buffer in the optimizer step, two when the
sync is pipelined (``--overlap-param-gather``)."""

from loggra_megatron.memory.backward_sketch import gather_buckets, step_bytes
from loggra_megatron.memory.params import ParamSpec
from loggra_megatron.optim.backward_sketch.sketch import ROW_GATHER_BUCKET_NUMEL


def _targets(*shapes):
    return [
        ParamSpec(f"decoder.layers.{i}.mlp.linear_fc1.weight", shape, "linear")
        for i, shape in enumerate(shapes)
    ]


def test_buckets_cut_at_the_cap_and_pad_rows_to_whole_segments():
    half = ROW_GATHER_BUCKET_NUMEL // 2  # a target of half the cap: 2 x 10000 rows x 1000
    targets = _targets((7, 10), (half // 1000, 1000), (half // 1000, 1000), (60000, 1000))
    assert gather_buckets(targets, 1) == []
    buckets = gather_buckets(targets, 2)
    assert buckets[0] == 2 * 4 * 10 + half  # 7 rows padded to 8 per segment; with the next
    assert buckets[1:] == [half, 3 * half]  # the cap reached; a larger target alone


def test_the_step_counts_one_bucket_or_two_pipelined():
    half = ROW_GATHER_BUCKET_NUMEL // 2
    targets = _targets((half // 1000, 1000), (half // 1000, 1000), (half // 1000, 1000))
    assert gather_buckets(targets, 4) == [2 * half, half]  # two fit a bucket, the third not
    # (at 4 segments a row block's update, 8 bytes per element of [k, n], is below them)
    assert step_bytes(targets, 4, 1, 2, 1) == 2 * 2 * half  # the larger bucket, bf16
    assert step_bytes(targets, 4, 1, 2, 1, pipelined=True) == 2 * 3 * half  # both buckets

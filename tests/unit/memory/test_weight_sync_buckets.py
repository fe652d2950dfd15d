"""The memory model's terms of the backward sketch's DP weight sync follow its buckets
(``optim/megatron/row_gather.py``): one bucket's buffer in the optimizer step, and with
``--overlap-param-gather`` every bucket's, held until the next forward."""

from types import SimpleNamespace

from loggra_megatron.memory.backward_sketch import (
    gather_buckets,
    step_bytes,
    sync_in_flight_bytes,
)
from loggra_megatron.memory.params import ParamSpec
from loggra_megatron.optim.backward_sketch import ROW_GATHER_BUCKET_NUMEL


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
    assert max(buckets[:2]) <= ROW_GATHER_BUCKET_NUMEL


def test_the_step_counts_one_bucket_and_overlap_holds_them_all():
    targets = _targets((7, 10), (5, 20))
    buckets = gather_buckets(targets, 2)
    assert buckets == [2 * 4 * 10 + 2 * 3 * 20]  # one bucket, padded rows
    assert step_bytes(targets, 2, 1, 2, 1) >= 2 * buckets[0]
    on, off = (SimpleNamespace(overlap_param_gather=v) for v in (True, False))
    assert sync_in_flight_bytes(targets, 2, 2, on) == 2 * buckets[0]
    assert sync_in_flight_bytes(targets, 2, 2, off) == 0
    assert sync_in_flight_bytes(targets, 1, 2, on) == 0  # no DP split: nothing gathered

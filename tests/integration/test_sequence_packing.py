"""Packed sequences (``--sequence-packing``, THD): each micro-batch fed as one row of
its rows laid end to end. The loss, the gradients, the update and the log-probs are those of
the padded micro-batches, to float round-off, at DP=2, PP=2 and TP=2 with sequence
parallelism, through Transformer Engine's THD contract as ``gpu_standins`` enforces it; and
the whole run on the simulated GPU with the 27B example's flags."""

import json

import pytest
import torch
from grpo_update_runs import SEQ, one_update
from rl_runs import tiny_argv
from test_gpu_standins import EXAMPLE_27B, _run

from loggra_megatron.config import ConfigError
from loggra_megatron.model.batching import LENGTHS, PaddingStats
from loggra_megatron.model.config import ModelConfig
from loggra_megatron.model.packing import PACKED, pack_micro_batch
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def test_pack_lays_rows_end_to_end_with_restarting_positions():
    tokens = torch.arange(1, 28).reshape(3, 9)  # rows of 8 fed positions
    packed = pack_micro_batch({"tokens": tokens}, torch.tensor([8, 3, 5]), 16)[PACKED]
    assert packed.input_ids.tolist() == [[*range(1, 9), 10, 11, 12, 19, 20, 21, 22, 23]]
    assert packed.position_ids.tolist() == [[*range(8), 0, 1, 2, 0, 1, 2, 3, 4]]
    assert packed.cu_seqlens.dtype == torch.int32  # Transformer Engine asserts int32
    assert packed.cu_seqlens.tolist() == [0, 8, 11, 16]
    assert (packed.max_seqlen, packed.num_real, packed.num_slots) == (8, 16, 16)
    # rounded up to the multiple: the padding extends the last row, its positions go on
    padded = pack_micro_batch({"tokens": tokens}, torch.tensor([8, 3, 4]), 8, width=17)[PACKED]
    assert padded.num_slots == 24 and padded.cu_seqlens.tolist() == [0, 8, 11, 24]
    assert padded.position_ids[0, 11:].tolist() == list(range(13))
    assert padded.input_ids[0, 15:].eq(0).all() and padded.max_seqlen == 13
    params = padded.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q is padded.cu_seqlens
    # back in the [b, s] layout: zeros past each row's length, gradients flow
    logits = torch.randn(1, 24, 5, requires_grad=True)
    rows = padded.unpack(logits)
    assert rows.shape == (3, 8, 5)
    assert torch.equal(rows[1, :3], logits[0, 8:11]) and rows[1, 3:].eq(0).all()
    assert torch.equal(rows[2, :4], logits[0, 11:15]) and rows[2, 4:].eq(0).all()
    rows.sum().backward()
    assert logits.grad[0, :15].eq(1).all() and logits.grad[0, 15:].eq(0).all()


def test_padding_stats_count_packed_slots():
    stats = PaddingStats()
    batch = {"tokens": torch.zeros(2, 9, dtype=torch.long), LENGTHS: torch.tensor([8, 2])}
    stats.count(pack_micro_batch(batch, batch[LENGTHS], 16))
    assert stats.fraction == pytest.approx(6 / 16)  # 10 real in 16 slots
    stats.count(pack_micro_batch(batch, batch[LENGTHS], 1))
    assert stats.fraction == pytest.approx(6 / 26)


def _assert_same_update(plain: dict, packed: dict) -> None:
    """Loss, gradient norm, every weight's update, log-probs and KL control's kept reference
    as in the padded micro-batches."""
    mp, mk = plain["metrics"], packed["metrics"]
    assert abs(mk["loss/total"] - mp["loss/total"]) < 1e-6
    assert abs(mk["grad/norm"] - mp["grad/norm"]) < 1e-6 * mp["grad/norm"]
    for name, ref in plain["delta"].items():
        assert ref.norm() > 0, name
        err = ((packed["delta"][name] - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"{name}: {err:.2e}"
    m = plain["mask"]
    assert (packed["log_probs"][m] - plain["log_probs"][m]).abs().max() < 1e-6
    rp, rk = plain["reference"], packed["reference"]
    assert rk.logits.shape == rp.logits.shape and rp.logits.shape[:2] == (3, SEQ)
    assert (rk.logits[rp.mask] - rp.logits[rp.mask]).abs().max() < 1e-5


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_packed_micro_batches_give_the_padded_update(aggregation):
    """DP=2, 8 rows per rank of 4 … 32 positions: the packed run feeds no padding at all
    (fp32, no alignment) and ran every attention as THD."""
    plain = run_distributed(one_update, 2, "plain", aggregation, te=True)
    packed = run_distributed(one_update, 2, "packed", aggregation, te=True)
    for p, k in zip(plain, packed, strict=True):
        _assert_same_update(p, k)
        assert p["metrics"]["throughput/padded_token_fraction"] > 0.4
        assert k["metrics"]["throughput/padded_token_fraction"] == 0.0
        assert k["record"]["thd_attention"] > 0 and "thd_attention" not in p["record"]


def test_packed_micro_batches_under_pipeline_parallelism():
    """PP=2: every packed row of a schedule call padded to the longest (one p2p shape)."""
    plain = run_distributed(one_update, 2, "plain", te=True, pp=2)
    packed = run_distributed(one_update, 2, "packed", te=True, pp=2)
    for p, k in zip(plain, packed, strict=True):
        for name, ref in p["delta"].items():
            err = ((k["delta"][name] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, f"{name}: {err:.2e}"
    _assert_same_update(plain[1], packed[1])  # the last stage has the loss and log-probs


def test_packed_micro_batches_with_sequence_parallelism():
    """TP=2 with sequence parallelism: the packed row split over the TP ranks along the
    sequence (its length rounded up to TP)."""
    config = dict(te=True, tp=2, sequence_parallel=True)
    plain = run_distributed(one_update, 2, "plain", **config)
    packed = run_distributed(one_update, 2, "packed", **config)
    for p, k in zip(plain, packed, strict=True):
        _assert_same_update(p, k)


def test_sequence_packing_flags_are_checked():
    with pytest.raises(
        ConfigError, match="--sequence-packing.*transformer-impl transformer_engine"
    ):
        ModelConfig(sequence_packing=True, bf16=True, transformer_impl="local")
    with pytest.raises(ConfigError, match="--sequence-packing.*--bf16"):
        ModelConfig(sequence_packing=True)


def test_thd_standin_enforces_transformer_engines_contract():
    """int64 ``cu_seqlens`` and fp32 inputs fail as TE fails them."""
    import gpu_standins
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = object.__new__(gpu_standins.ThdDotProductAttention)
    attention.softmax_scale = 0.5
    q = torch.randn(6, 2, 4, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    params = PackedSeqParams("thd", cu, cu, max_seqlen_q=4, max_seqlen_kv=4)
    out = attention.forward(q, q, q, None, packed_seq_params=params)
    assert out.shape == (6, 8)
    with pytest.raises(AssertionError, match="int32"):
        long = cu.long()
        attention.forward(q, q, q, None, packed_seq_params=PackedSeqParams("thd", long, long, 4, 4))
    with pytest.raises(ValueError, match="No dot product attention backend"):
        attention.forward(q.float(), q.float(), q.float(), None, packed_seq_params=params)


def test_27b_example_flags_with_packing_run_through_the_standins(tokenizer, tmp_path):
    """Two RL steps with the 27B example's flags and ``--sequence-packing`` on the simulated
    CUDA device (TP=2, sequence parallelism, FP8): ``cu_seqlens`` on the device, every FP8
    GEMM's local shard aligned, THD attention in the training and log-prob forwards, and
    the training forward's padding below the padded layout's."""
    out = tmp_path / "out"
    argv = tiny_argv(tokenizer, **EXAMPLE_27B, **{"sequence-packing": True, "output-dir": out})
    reports, _ = _run(tmp_path, argv)
    assert all(r["record"]["thd_attention"] > 0 for r in reports)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["throughput/padded_token_fraction"] < 0.5
        assert m["kl/predicted"] > 0 and 0 < m["kl/step_scale"] <= 1

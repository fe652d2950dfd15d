"""What the sketch keeps: ``loggra/captured_energy/<family>/{mean,min}`` (‖G·Q‖² / ‖G‖² of whole
matrices) against a dense reference on DP=2 with rows split between ranks, TP=2 and PP=2; the
identity projection keeps everything; the warning fires once."""

import pytest
import torch

from loggra_megatron.optim.megatron.gradient_energy import FAMILIES, energy_metrics, family_of
from loggra_megatron.train.reporting import EnergyWatch

pytestmark = pytest.mark.megatron  # the 2-rank tests run Megatron-Core


def test_family_of_megatron_names():
    assert family_of("chunk0.decoder.layers.3.self_attention.linear_qkv.weight") == "qkv"
    assert family_of("decoder.layers.0.self_attention.linear_proj.weight") == "proj"
    assert family_of("decoder.layers.0.mlp.linear_fc1.weight") == "fc1"
    assert family_of("decoder.layers.0.mlp.linear_fc2.weight") == "fc2"
    assert family_of("embedding.word_embeddings.weight") is None
    assert family_of("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") is None


def test_energy_metrics_mean_over_updates_then_mean_and_min_over_layers():
    total = torch.zeros(3, 2 * len(FAMILIES), 2, dtype=torch.float64)
    # layer 0 qkv: updates 0 and 1 at 0.5 and 0.7 (update 2 absent: skipped); layer 1 qkv: 0.9
    total[0, 0] = torch.tensor([1.0, 2.0])
    total[1, 0] = torch.tensor([7.0, 10.0])
    total[:2, 4] = torch.tensor([9.0, 10.0])
    total[0, 6] = torch.tensor([3.0, 4.0])  # layer 1 fc1 only
    got = energy_metrics(total)
    assert set(got) == {
        f"loggra/captured_energy/{f}/{s}" for f in ("qkv", "fc1") for s in ("mean", "min")
    }
    assert got["loggra/captured_energy/qkv/mean"] == pytest.approx((0.6 + 0.9) / 2)
    assert got["loggra/captured_energy/qkv/min"] == pytest.approx(0.6)
    assert got["loggra/captured_energy/fc1/mean"] == got["loggra/captured_energy/fc1/min"] == 0.75


def test_warns_once_after_patience_consecutive_low_steps():
    watch = EnergyWatch(0.5, patience=3)
    low, high = {"loggra/captured_energy/fc2/mean": 0.3}, {"loggra/captured_energy/fc2/mean": 0.8}
    assert [watch.update(m) for m in (low, low, high, low, low)] == [None] * 5  # reset by high
    message = watch.update({**low, "loggra/captured_energy/qkv/mean": 0.9})
    assert message is not None and "fc2 0.30" in message and "qkv" not in message
    assert all(watch.update(low) is None for _ in range(5))  # once per run
    assert all(EnergyWatch(0.0, patience=1).update(low) is None for _ in range(3))  # off


# ---------------------------------------------------------------- Megatron-Core, 2 ranks
def _energy_and_reference(rank, overlap=False, bf16=False, **loggra):
    """One LoGRA step; this rank's logged metrics and, per weight held here, the clipped fp32
    gradient slice and the basis the step sketched it with. ``bf16``: bf16 params and grad
    buffers handed to LoGRA uncopied, clipped (the clip scale is applied by LoGRA)."""
    from megatron.core import parallel_state as ps
    from megatron_optimizer_runs import TOKENS, build, build_bf16_clipped, local_batch

    from loggra_megatron.optim.megatron.gradient_energy import captured_energy
    from loggra_megatron.testing import train_step

    if bf16:
        ddp, opt = build_bf16_clipped(loggra_rank=3)
    else:
        ddp, opt = build("loggra", True, overlap, **loggra)
    opt = getattr(opt, "chained_optimizers", [opt])[0]
    inner = opt.optimizer
    seen, scales = {}, []
    project = inner._project

    def spy(w, layout, p, refresh, cache):
        out = project(w, layout, p, refresh, cache)
        if p is not None:
            seen[w] = (layout, inner._grad(p).view(-1).clone(), out[0][0].clone())
            scales.append(inner.model_grad_scale if p.grad is None else 1.0)
        return out

    inner._project = spy
    batch, micro = local_batch(TOKENS[:2])
    train_step(ddp, opt, batch, num_microbatches=micro)
    coords = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    return {
        "metrics": captured_energy(opt, 1, torch.device("cpu")),
        "seen": seen,
        "coords": coords,
        "dp_rank": inner._dp_rank,
        "scales": scales,
    }


def _reference(results) -> dict[str, float]:
    """The metrics computed densely: each weight's full gradient put together from its DP
    slices, ‖G Q‖² and ‖G‖² summed over TP shards and stages by slot."""
    sums = {}
    for coords in {r["coords"] for r in results}:
        ranks = [r for r in results if r["coords"] == coords]
        for w in {w for r in ranks for w in r["seen"]}:
            layout = next(r["seen"][w][0] for r in ranks if w in r["seen"])
            grad = torch.zeros(layout.shape[0] * layout.shape[1])
            bases = []
            for r in ranks:
                if w in r["seen"]:
                    start, end = layout.dp_ranges[r["dp_rank"]]
                    grad[start:end] = r["seen"][w][1]
                    bases.append(r["seen"][w][2])
            assert all(torch.equal(b, bases[0]) for b in bases)  # Q is shared over DP
            g, q = grad.view(layout.shape).double(), bases[0].double()
            torch.testing.assert_close(
                q.t() @ q, torch.eye(q.shape[1], dtype=q.dtype), atol=1e-5, rtol=0
            )
            num, den = sums.get(layout.energy_slot, (0.0, 0.0))
            sums[layout.energy_slot] = (num + (g @ q).square().sum(), den + g.square().sum())
    total = torch.zeros(1, max(sums) + 1, 2, dtype=torch.float64)
    for slot, (num, den) in sums.items():
        total[0, slot] = torch.tensor([num, den])
        assert num <= den * (1 + 1e-9)  # orthonormal columns: ‖G Q‖ ≤ ‖G‖
    return energy_metrics(total)


@pytest.mark.parametrize(
    ("tp", "pp", "bf16"),
    [(1, 1, False), (2, 1, False), (1, 2, False), (1, 1, True)],
    ids=["dp2", "tp2", "pp2", "dp2-bf16-grads-clipped"],
)
def test_logged_energy_equals_the_dense_reference(tp, pp, bf16):
    from loggra_megatron.testing import run_distributed

    # DP=2: 1000-element buckets split every weight between the ranks, mid-row for some
    dp2 = tp == pp == 1 and not bf16
    kw = {} if bf16 else {"loggra_rank": 3}
    results = run_distributed(_energy_and_reference, 2, dp2, bf16, tp=tp, pp=pp, **kw)
    if bf16:  # LoGRA scaled the bf16 gradients by the clip coefficient
        assert any(r["scales"] for r in results)
        assert all(0 < s < 1 for r in results for s in r["scales"])
    if dp2:
        layouts = [lay for r in results for lay, _, _ in r["seen"].values()]
        assert any(lay.split_rows() for lay in layouts)
    metrics = results[0]["metrics"]
    assert all(r["metrics"] == metrics for r in results)  # global: the same on every rank
    assert set(metrics) == {
        f"loggra/captured_energy/{f}/{s}" for f in FAMILIES for s in ("mean", "min")
    }
    expected = _reference(results)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5), key
        assert 0 < value < 1
    assert metrics["loggra/captured_energy/qkv/min"] < metrics["loggra/captured_energy/qkv/mean"]


def test_identity_projection_keeps_all_the_energy():
    from loggra_megatron.testing import run_distributed

    results = run_distributed(_energy_and_reference, 2, True, loggra_projection="identity")
    metrics = results[0]["metrics"]
    assert len(metrics) == 2 * len(FAMILIES)
    for key, value in metrics.items():
        assert value == pytest.approx(1.0, abs=1e-6), key


def test_a_run_warns_once_when_the_sketch_keeps_too_little(tokenizer, tmp_path):
    """Through pretrain_rl.py: a threshold of 1 (no sketch keeps everything) warns once, after
    10 RL steps; the keys are in metrics.jsonl."""
    from rl_runs import tiny_argv, torchrun

    from loggra_megatron.metrics import read_metrics

    out = tmp_path / "run"
    argv = tiny_argv(tokenizer, **{"output-dir": out, "train-iters": 11})
    proc = torchrun([*argv, "--loggra-energy-warn-threshold", "1"])
    assert proc.stdout.count("warning: LoGRA's sketch has kept less than 1") == 1, proc.stdout
    energy = [r.get("loggra/captured_energy/fc2/mean") for r in read_metrics(out)]
    assert sum(e is not None for e in energy) >= 10  # absent only on a step without gradient
    assert all(0 < e < 1 for e in energy if e is not None)

"""``pretrain_rl.py --generation-ranks`` in other layouts, and ahead of training.

* The weight sync reshards from training TP 1 to generation TP 2 (2 → 1:
  ``test_generation_ranks_lowrank.py``): the generation ranks' weights read back equal the
  trainer's at every sync.
* One step ahead (``--max-policy-lag 1``): lags of 0 then 1, the lag weighted by
  ``--tis-cap``'s importance weights (those of a lag-1 step equal a hand computation from
  the checkpoints of the generating and the trained weights), the data position of the last
  step trained in the checkpoint, and a resume on a different placement (colocated).
"""

import json
import math

import pytest
import torch
from convert_cli import export_hf
from rl_runs import tiny_argv, torchrun

from loggra_megatron.metrics import read_metrics

pytestmark = pytest.mark.megatron

BASE = {"loggra-sketch": None, "train-iters": 3, "bf16": True, "kl-coef": 0.01}


@pytest.mark.parametrize("train_tp, gen_tp, nproc", [(1, 2, 3)], ids=["tp1-to-tp2"])
def test_weight_sync_reshards_between_tp_sizes(tokenizer, tmp_path, train_tp, gen_tp, nproc):
    """Training TP 1 → generation TP 2 (TP 2 → 1: the low-rank test, which reshards its
    changed weights through the same path)."""
    gen_ranks = nproc - train_tp
    flags = {
        **BASE,
        "tensor-model-parallel-size": train_tp,
        "generation-ranks": gen_ranks,
        "generation-tensor-model-parallel-size": gen_tp,
        "weight-sync-check-interval": 1,  # a checksum at every sync
        "prompts-per-step": 2,
        "global-batch-size": 8,
        "micro-batch-size": 4 // (2 // train_tp),
        "save": tmp_path / "run",
    }
    torchrun(tiny_argv(tokenizer, **flags), nproc=nproc)
    rows = read_metrics(tmp_path / "run")
    assert [r["sync/checksum_ok"] for r in rows] == [1.0] * 3
    assert all(r["sync/bytes"] > 0 for r in rows)


def _log_probs(hf_dir, tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` log-probs of ``tokens[:, 1:]`` under the Hugging Face model in ``hf_dir``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(tokens[:, :-1]).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def _hand_importance_weights(run, records: list[dict], step: int, out) -> list[float]:
    """Per training rank, the logged token mean of ``min(π_prox / π_behav, 2)`` at RL step
    ``step`` (0-based) recomputed by hand: π_behav from the checkpoint of the weights that
    generated its rollouts (iteration ``step − 1``, one update behind), π_prox from that of
    the weights it trains (iteration ``step``), each a Hugging Face forward of the recorded
    tokens; checked against the engine's and the trainer's log-probs on the way."""
    policies = {}
    for it in (step - 1, step):
        export_hf(run, out / f"hf{it}", "--ckpt-step", it)
        policies[it] = out / f"hf{it}"
    means = []
    for rank_records in records:
        weights = []
        for r in (r for r in rank_records if r["step"] == step):
            m = r["mask"].bool()
            behav, prox = (_log_probs(policies[it], r["tokens"]) for it in (step - 1, step))
            torch.testing.assert_close(behav[m], r["rollout"][m], atol=2e-4, rtol=0)
            torch.testing.assert_close(prox[m], r["old"][m], atol=2e-4, rtol=0)
            assert (behav[m] - prox[m]).abs().max() > 1e-3  # the lag changed the policy
            w = (prox - behav).clamp(max=math.log(2)).exp()
            weights.append(float(w[m].mean()))
            assert weights[-1] == pytest.approx(r["tis"], abs=1e-4)
        means.append(sum(weights) / len(weights))  # the micro-batches' and updates' mean
    return means


def test_one_step_ahead_lags_by_one_and_resumes_on_another_placement(tokenizer, tmp_path):
    """fp32, a checkpoint every step; the loss's inputs recorded on the training ranks
    (``tests/helpers/record_importance.py``) for the hand computation of step 4's weights."""
    ahead = {
        **BASE,
        "bf16": None,
        "generation-ranks": 1,
        "max-policy-lag": 1,
        "tis-cap": 2,
        "train-iters": 4,
        "save-interval": 1,
        "save": tmp_path / "ahead",
    }
    argv = [str(tmp_path / "records"), "--", *tiny_argv(tokenizer, **ahead)]
    torchrun(argv, nproc=3, script="tests/helpers/record_importance.py")
    rows = read_metrics(tmp_path / "ahead")
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert rows[0]["tis/weight_mean"] == pytest.approx(1.0, abs=1e-5)  # its own weights
    assert all(abs(r["tis/weight_mean"] - 1) > 1e-4 for r in rows[1:])  # one update behind
    records = [torch.load(tmp_path / "records" / f"rank{r}.pt") for r in (0, 1)]
    by_rank = _hand_importance_weights(tmp_path / "ahead", records, 3, tmp_path)
    assert sum(by_rank) / 2 == pytest.approx(rows[3]["tis/weight_mean"], abs=1e-5)
    assert all(0 < r["time/generation_hidden_fraction"] <= 1 for r in rows[1:])
    # step 3's prompts were drawn during step 2; the checkpoint resumes before them
    with open(tmp_path / "ahead" / "iter_0000002" / "run_config.json") as f:
        assert json.load(f)["data"]["consumed_samples"] == 2 * 4
    colocated = {**ahead, "generation-ranks": None, "max-policy-lag": None, "train-iters": 6}
    colocated.update(save=tmp_path / "ahead", load=tmp_path / "ahead")
    torchrun(tiny_argv(tokenizer, **colocated), nproc=2)
    rows = read_metrics(tmp_path / "ahead")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all("rollout/policy_lag" not in r for r in rows[4:])


def test_a_pipeline_parallel_trainer_syncs_to_one_generation_stage(tokenizer, tmp_path):
    """Training PP 2 → one generation rank (PP 1), low-rank sync with remainders: every
    stage's weights reach it (each stage's tensors gathered to the leader, the row updates
    named by their global layers), its weights read back equal at every sync, and the run
    equals the colocated PP 2 run in every metric (but the KV cache's bytes, which one
    generation rank holds for every layer)."""
    flags = {**BASE, "pipeline-model-parallel-size": 2, "loggra-param-remainders": True}
    torchrun(tiny_argv(tokenizer, **flags, save=tmp_path / "colocated"), nproc=2)
    split = {"generation-ranks": 1, "weight-sync": "lowrank", "weight-sync-check-interval": 1}
    torchrun(tiny_argv(tokenizer, **flags, **split, save=tmp_path / "split"), nproc=3)
    colocated, rows = read_metrics(tmp_path / "colocated"), read_metrics(tmp_path / "split")
    assert [r["sync/checksum_ok"] for r in rows] == [1.0] * 3
    volatile = ("time/", "throughput/", "memory/peak", "memory/kv_cache_bytes")
    for a, b in zip(colocated, rows, strict=True):
        for key in a:
            if not key.startswith(volatile):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])

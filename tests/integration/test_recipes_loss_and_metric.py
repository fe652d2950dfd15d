"""The recipes of docs/architecture.md for a loss term and a metric, each tried by adding one
in a temporary module: an entropy bonus is a term class, its setting and its metric's
declaration, and changes the loss by exactly the bonus on a tiny model (at TP=1 and TP=2);
a metric is its declaration and the code that reports it, reduced as declared."""

import importlib.util
import sys
import textwrap

import pytest
import torch

from loggra_megatron.metric_keys import METRICS, markdown_table
from loggra_megatron.testing import run_distributed, tiny_gpt_model

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

VOCAB, SEQ, BATCH = 64, 8, 4

ENTROPY_BONUS = '''
"""An entropy bonus: in the repository its setting is a field of PolicyLossConfig and its
term one more line in PPOClipLoss.build_terms (rl/policy_loss.py), its metric a declaration
in metric_keys.py; here a subclass of each stands in for those edits."""

from dataclasses import dataclass

from loggra_megatron.metric_keys import LOSS_SHARE, Metric
from loggra_megatron.model.vocab_parallel import vocab_parallel_logsumexp, vocab_parallel_sum
from loggra_megatron.rl.policy_loss import PolicyLossConfig, PPOClipLoss

METRIC = Metric("loss/entropy", "−entropy_coef × the aggregated token entropy of π_θ", LOSS_SHARE)


@dataclass
class EntropyLossConfig(PolicyLossConfig):
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""


class EntropyBonus:
    """−c · the aggregated entropy H = lse(z) − Σ_v p_v z_v, over the TP vocabulary shards."""

    def __init__(self, coef):
        self.coef = coef

    def __call__(self, x):
        def entropy_of(z, tp_group):  # z [c, V/TP]: a chunk of this rank's logits
            lse = vocab_parallel_logsumexp(z, tp_group)
            p = (z - lse.unsqueeze(-1)).exp()
            return lse - vocab_parallel_sum((p * z).sum(-1), tp_group)

        entropy = x.output.per_token(entropy_of)
        bonus = -self.coef * x.aggregate(entropy, x.mask)
        return bonus, {"loss/entropy": bonus.detach()}


class PPOClipEntropyLoss(PPOClipLoss):
    def build_terms(self, settings, kl_coef):
        return [*super().build_terms(settings, kl_coef), EntropyBonus(settings.entropy_coef)]
'''

TRUNCATED_FRACTION = '''
"""A metric: its declaration (metric_keys.py) and the code that reports it (here: what
ExperienceMaker.make would add to its metrics)."""

from loggra_megatron.metric_keys import PER_RANK, Metric

METRIC = Metric(
    "response/truncated_fraction", "share of the responses cut at --max-new-tokens", PER_RANK
)


def measure(rollout):
    return {METRIC.key: rollout.truncated.float().mean().item()}
'''


def _import(path: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recipe(tmp_path):
    def write(source: str) -> str:
        path = tmp_path / f"recipe_{len(list(tmp_path.iterdir()))}.py"
        path.write_text(textwrap.dedent(source))
        return str(path)

    return write


# ---------------------------------------------------------------- a loss term
def _batch():
    gen = torch.Generator().manual_seed(7)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    mask[:, 3:] = True  # positions 0-2 are the prompt
    return {
        "tokens": torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen),
        "mask": mask,
        "old": -4.0 + 0.3 * torch.randn(BATCH, SEQ, generator=gen),
        "ref": -4.0 + 0.3 * torch.randn(BATCH, SEQ, generator=gen),
        "adv": torch.randn(BATCH, generator=gen),
    }


def _losses_with_and_without_the_bonus(rank, path):
    from megatron.core import parallel_state as ps

    from loggra_megatron.metric_keys import combine_micro_batches
    from loggra_megatron.model.forward import gpt_forward, last_hidden
    from loggra_megatron.rl.losses import AdaptiveKLCoefficient
    from loggra_megatron.rl.policy_loss import POLICY_LOSSES, PolicyLossConfig

    bonus = _import(path)
    POLICY_LOSSES["ppo_clip_entropy"] = bonus.PPOClipEntropyLoss  # the registry line
    METRICS[bonus.METRIC.key] = bonus.METRIC  # the declaration
    model = tiny_gpt_model(vocab=VOCAB, seq=SEQ, use_cpu_initialization=True)
    batch = _batch()
    with torch.no_grad():
        hidden = gpt_forward(model, batch)  # [b, s, h]
    out = last_hidden(model, batch, hidden)
    counts = (float(batch["mask"].sum()), float(BATCH))
    beta = AdaptiveKLCoefficient(0.1)
    settings = bonus.EntropyLossConfig(policy_loss="ppo_clip_entropy", entropy_coef=0.01)
    plain = POLICY_LOSSES["ppo_clip"](PolicyLossConfig(), SEQ, beta)
    with_bonus = POLICY_LOSSES[settings.policy_loss](settings, SEQ, beta)
    loss, metrics = plain(batch, out, counts)
    loss_b, metrics_b = with_bonus(batch, out, counts)
    halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    shares = [
        with_bonus(half, last_hidden(model, half, hidden[i : i + 2]), counts)[1]
        for i, half in zip((0, 2), halves, strict=True)
    ]
    return {
        "loss": loss,
        "loss_b": loss_b,
        "metrics": metrics,
        "metrics_b": metrics_b,
        "combined": combine_micro_batches(shares),
        "logits": _gathered(out.logits(), ps.get_tensor_model_parallel_group()),
        "mask": batch["mask"],
    }


def _gathered(logits, tp_group):
    """The whole ``[b, s, V]`` logits from each rank's ``[b, s, V/TP]`` shard."""
    import torch.distributed as dist

    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, logits.contiguous(), group=tp_group)
    return torch.cat(shards, dim=-1)


def test_an_entropy_bonus_is_a_term_its_setting_and_its_metric(recipe):
    path = recipe(ENTROPY_BONUS)
    (tp1,) = run_distributed(_losses_with_and_without_the_bonus, 1, path)
    bonus = tp1["metrics_b"]["loss/entropy"]
    assert bonus < 0  # a bonus: it lowers the loss
    assert torch.equal(tp1["loss_b"], tp1["loss"] + bonus)  # exactly the term, bit for bit
    for key, value in tp1["metrics"].items():
        if key != "loss/total":
            assert torch.equal(tp1["metrics_b"][key], value), key
    entropy = torch.distributions.Categorical(logits=tp1["logits"]).entropy()
    torch.testing.assert_close(bonus, -0.01 * entropy[tp1["mask"]].mean(), rtol=1e-5, atol=0)
    # the declared reduction (a share of the loss): the micro-batch shares add up to it
    torch.testing.assert_close(tp1["combined"]["loss/entropy"], bonus.item(), rtol=1e-6, atol=0)
    for tp2 in run_distributed(_losses_with_and_without_the_bonus, 2, path, tp=2):
        assert torch.equal(tp2["loss_b"], tp2["loss"] + tp2["metrics_b"]["loss/entropy"])
        torch.testing.assert_close(tp2["metrics_b"]["loss/entropy"], bonus, rtol=1e-5, atol=0)


# ---------------------------------------------------------------- a metric
def _reduced_over_two_dp_ranks(rank, path):
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from loggra_megatron.train.reporting import reduce_metrics

    metric = _import(path)
    METRICS[metric.METRIC.key] = metric.METRIC  # the declaration
    rollout = SimpleNamespace(truncated=torch.tensor([True, False, False, rank == 1]))
    local = {**metric.measure(rollout), "reward/mean": 0.5}
    pp, dp = ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()
    return reduce_metrics(local, pp, dp, torch.device("cpu"))


def test_a_metric_is_its_declaration_and_the_code_that_reports_it(recipe, monkeypatch):
    from loggra_megatron.train.reporting import reduce_metrics

    path = recipe(TRUNCATED_FRACTION)
    metric = _import(path)
    with pytest.raises(KeyError, match="declare it in loggra_megatron/metric_keys.py"):
        reduce_metrics({metric.METRIC.key: 0.25}, None, None, torch.device("cpu"))
    monkeypatch.setitem(METRICS, metric.METRIC.key, metric.METRIC)
    row = "| `response/truncated_fraction` | share of the responses cut at --max-new-tokens"
    assert f"{row} | mean over DP ranks |" in markdown_table()  # docs/metrics.md's new row
    for reduced in run_distributed(_reduced_over_two_dp_ranks, 2, path):  # DP = 2
        assert reduced == {"response/truncated_fraction": 0.375, "reward/mean": 0.5}

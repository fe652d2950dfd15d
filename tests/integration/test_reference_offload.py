"""``--reference-offload``: the reference model's weights on the host, streamed to the device
unit by unit (``loggra_megatron/model/offload.py``), on real Megatron-Core over 2 CPU/gloo
ranks: the same log-probs bit for bit, what is resident when, weights written into the host
copies, checkpoints either way, and a ``pretrain_rl.py`` run with the same ``kl/ref``.

The worker functions stay at module level (pickled by reference).
"""

from __future__ import annotations

import pytest
import torch
from rl_runs import refused, tiny_argv, torchrun

from loggra_megatron.metrics import read_metrics
from loggra_megatron.testing import run_distributed, tiny_gpt_model, wrap_ddp

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

VOCAB, SEQ, LAYERS = 64, 16, 4
CPU = torch.device("cpu")


def _frozen(model):
    return model.eval().requires_grad_(False)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (6, SEQ), generator=torch.Generator().manual_seed(0))


def _log_probs(model, tokens):
    from loggra_megatron.model.log_probs import compute_log_probs

    return compute_log_probs(model, tokens, micro_batch_size=2)  # 3 forwards


def _param_bytes(model) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _record_residency(model, offload) -> list:
    """``(unit, resident units, device bytes)`` each time a leaf module of a unit starts."""
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(model)
    parts = [("embedding", gpt.embedding)] if gpt.pre_process else []
    parts += [(f"layer {layer.layer_number}", layer) for layer in gpt.decoder.layers]
    if gpt.post_process:
        parts += [("output", gpt.decoder.final_layernorm), ("output", gpt.output_layer)]
    records = []
    for unit, part in parts:
        for leaf in (m for m in part.modules() if not list(m.children())):
            leaf.register_forward_pre_hook(
                lambda m, args, unit=unit: records.append(
                    (unit, offload.resident_units(), offload.device_bytes())
                )
            )
    return records


def _check_residency(records, offload) -> None:
    """While unit k computes, exactly units k and k + 1 are on the device."""
    names, sizes = list(offload.unit_bytes()), offload.unit_bytes()
    assert records
    for unit, resident, nbytes in records:
        k = names.index(unit)
        assert resident == names[k : k + 2], (unit, resident)
        assert nbytes == sum(sizes[name] for name in resident) <= 2 * max(sizes.values())


# ---------------------------------------------------------------- the offloaded forward
def _same_log_probs(rank, pp):
    from megatron.core import parallel_state as ps

    from loggra_megatron.model.offload import offload_to_host, release_device_weights

    with pytest.raises(ValueError, match="requires grad"):
        offload_to_host(tiny_gpt_model(num_layers=LAYERS, vocab=VOCAB, seq=SEQ), CPU)
    tokens, compared = _tokens(), 0
    for bf16 in (False, True):
        for tied in (False, True):
            shape = dict(num_layers=LAYERS, vocab=VOCAB, seq=SEQ, bf16=bf16, share_embeddings=tied)
            resident = _frozen(tiny_gpt_model(**shape))
            offloaded = _frozen(tiny_gpt_model(**shape))  # other weights: the RNG moved on
            assert not _same(_state(resident), _state(offloaded))
            offload = offload_to_host(offloaded, CPU)
            assert _param_bytes(offloaded) == 0 and offload.device_bytes() == 0
            offloaded.load_state_dict(resident.state_dict())  # into the host copies
            assert _param_bytes(offloaded) == 0
            records = _record_residency(offloaded, offload)
            expected, got = _log_probs(resident, tokens), _log_probs(offloaded, tokens)
            assert (expected is None) == (got is None)
            if got is not None:
                assert torch.equal(got, expected), (bf16, tied)
                compared += 1
            _check_residency(records, offload)
            last = ps.is_pipeline_last_stage()
            assert offload.resident_units() == (["output"] if last else [])  # read after
            release_device_weights(offloaded)
            assert _param_bytes(offloaded) == 0 and offload.device_bytes() == 0
            assert [n for n, _ in offloaded.named_parameters()] == [
                n for n, _ in resident.named_parameters()
            ]
    return compared


@pytest.mark.parametrize("pp", [1, 2])
def test_offloaded_reference_gives_the_same_log_probs_two_units_at_a_time(pp):
    """fp32 and bf16, tied and untied embeddings, 3 micro-batches: bitwise the resident
    model's log-probs; while a unit computes only it and the next are on the device, and
    between forwards (after the release) nothing is."""
    compared = run_distributed(_same_log_probs, 2, pp, pp=pp)
    assert compared == ([4, 4] if pp == 1 else [0, 4])


# ---------------------------------------------------------------- writes and checkpoints
def _copy_policy_then_forward(rank):
    from types import SimpleNamespace

    from loggra_megatron.model.offload import offload_to_host
    from loggra_megatron.train.trainer import RLTrainer

    shape = dict(num_layers=LAYERS, vocab=VOCAB, seq=SEQ, bf16=True)
    policy = wrap_ddp(tiny_gpt_model(**shape))
    reference = _frozen(tiny_gpt_model(**shape))
    offload_to_host(reference, CPU)
    tokens = _tokens()
    before, want = _log_probs(reference, tokens), _log_probs(policy, tokens)
    assert not torch.equal(before, want)
    RLTrainer._copy_policy_to_reference(SimpleNamespace(policy=policy, reference=reference))
    assert _param_bytes(reference) == 0
    assert torch.equal(_log_probs(reference, tokens), want)


def test_copy_policy_to_reference_writes_the_host_copies():
    run_distributed(_copy_policy_then_forward, 2)


def _checkpoint_round_trip(rank, root):
    from loggra_megatron.checkpointing import load_checkpoint, save_checkpoint
    from loggra_megatron.model.offload import offload_to_host

    shape = dict(num_layers=LAYERS, vocab=VOCAB, seq=SEQ)
    policy = wrap_ddp(tiny_gpt_model(**shape))

    def reference(offloaded: bool):
        model = _frozen(tiny_gpt_model(**shape))
        if offloaded:
            offload_to_host(model, CPU)
        return model

    tokens, saved = _tokens(), reference(offloaded=True)
    weights, want = _state(saved), _log_probs(saved, tokens)
    save_checkpoint(root, 1, [policy], None, {"step": 1}, {"reference": [saved]})
    plain, offloaded = reference(offloaded=False), reference(offloaded=True)
    for model in (plain, offloaded):
        assert not _same(_state(model), weights)
        load_checkpoint(root, [policy], None, iteration=1, extra_models={"reference": [model]})
        assert model is plain or _param_bytes(model) == 0  # loaded into the host copies
        assert _same(_state(model), weights)
        assert torch.equal(_log_probs(model, tokens), want)
    save_checkpoint(root, 2, [policy], None, {"step": 2}, {"reference": [plain]})
    again = reference(offloaded=True)
    load_checkpoint(root, [policy], None, iteration=2, extra_models={"reference": [again]})
    assert _same(_state(again), weights)
    assert torch.equal(_log_probs(again, tokens), want)


def test_checkpoint_of_an_offloaded_reference_loads_either_way(tmp_path):
    """Saved offloaded → loaded resident and offloaded; saved resident → loaded offloaded:
    the same weights and log-probs each time (the checkpoint holds the same tensors)."""
    run_distributed(_checkpoint_round_trip, 2, str(tmp_path))


# ---------------------------------------------------------------- pretrain_rl.py
def test_a_run_with_the_reference_offloaded_has_the_same_kl(tokenizer, tmp_path):
    runs = {}
    for name, offload in (("resident", False), ("offloaded", True)):
        flags = {"kl-coef": 0.05, "reference-offload": offload, "output-dir": tmp_path / name}
        torchrun(tiny_argv(tokenizer, **flags))
        runs[name] = read_metrics(tmp_path / name)
    assert len(runs["resident"]) == len(runs["offloaded"]) == 2
    assert any(row["kl/ref"] > 0 for row in runs["resident"])
    for a, b in zip(runs["resident"], runs["offloaded"], strict=True):
        for key in ("kl/ref", "loss/total", "reward/mean"):
            assert a[key] == b[key], (a["step"], key)


def test_reference_offload_without_a_reference_is_refused(tokenizer, capsys):
    from loggra_megatron.arguments import parse_args

    flags = {"kl-coef": 0.05, "reference-offload": True}
    assert parse_args(tiny_argv(tokenizer, **flags), world_size=2).grpo.reference_offload
    refused(tiny_argv(tokenizer, **{"reference-offload": True}), capsys, "--reference-offload")

"""``placement.lowrank``: a shadow that repeats RowAdam's recorded commits, from a copy of the
masters, holds the trainer's weights bit for bit, for every master storage (torch only; the
processes: ``tests/integration/test_generation_ranks_lowrank.py``)."""

import math

import pytest
import torch

from loggra_megatron.optim.backward_sketch.row_adam import RowAdam
from loggra_megatron.optim.backward_sketch.sketch import draw_signs
from loggra_megatron.placement.lowrank import RowMaster, RowUpdate, Shadows, TargetShadow

M, N, R = 10, 16, 4
LO, HI = 3, 9  # the rows a data-parallel rank owns


def _trainer(storage: str, w0: torch.Tensor):
    """``(weight, RowAdam over its rows, main)`` as the backward sketch's optimizer holds
    them: an fp32 weight (its own master), bf16 with an fp32 master, or bf16 + remainder."""
    weight = w0.clone() if storage == "weight" else w0.to(torch.bfloat16)
    rows = weight[LO:HI]
    main = rows.float() if storage == "master" else rows
    remainders = {main: torch.zeros_like(rows, dtype=torch.int16)} if storage == "remainder" else {}
    opt = RowAdam([main], lr=0.05, weight_decay=0.1, param_remainders=remainders)
    if storage == "remainder":
        opt.set_master(main, w0[LO:HI])
    opt.recorded = []
    return weight, opt, main


def _updates(opt, weight, main, steps: int, kind: str, refresh: int) -> list[RowUpdate]:
    """``steps`` commits of random sketches, the projection drawn in the weight's dtype and a
    separate master copied into the weight after each (as ``BackwardSketchOptimizer``
    does); their records as the trainer sends them."""
    gen, out = torch.Generator().manual_seed(5), []
    for _ in range(steps):
        draw = opt.num_steps // refresh
        signs = draw_signs(kind, 7, draw, "layer1.linear_qkv", R, N, "cpu", weight.dtype)
        opt.set_sketches({main: (torch.randn(HI - LO, R, generator=gen), signs)})
        opt.step()
        if main.data_ptr() != weight[LO:HI].data_ptr():
            weight[LO:HI].copy_(main)
    for _, direction, rate, wd, done in opt.recorded:
        out.append(
            RowUpdate(
                "w",
                0,
                LO,
                HI,
                direction.clone(),
                rate,
                wd,
                "layer1.linear_qkv",
                kind,
                7,
                done // refresh,
                R,
                N,
                0,
                N,
            )
        )
    return out


@pytest.mark.parametrize("storage", ["weight", "master", "remainder"])
@pytest.mark.parametrize("kind, refresh", [("rademacher", 1), ("gaussian", 2)])
def test_a_shadow_repeats_the_commits_bit_for_bit(storage, kind, refresh):
    w0 = torch.randn(M, N, generator=torch.Generator().manual_seed(1))
    weight, opt, main = _trainer(storage, w0)
    shadow = TargetShadow(weight.clone(), storage)  # the first sync: the weight ...
    shadow.set_master(LO, HI, opt.master_of(main).float().clone())  # ... and the master
    for update in _updates(opt, weight, main, steps=3, kind=kind, refresh=refresh):
        shadow.apply(update)
    assert torch.equal(shadow.weight, weight)
    assert torch.equal(shadow.master_rows(LO, HI).float(), opt.master_of(main).float())
    assert not torch.equal(weight[LO:HI].float(), w0[LO:HI])  # it trained


def test_a_wrong_draw_gives_other_weights():
    """The draw index is part of the update: a shadow that regenerated another projection
    would drift (the checksum's job to catch)."""
    w0 = torch.randn(M, N, generator=torch.Generator().manual_seed(1))
    weight, opt, main = _trainer("master", w0)
    shadow = TargetShadow(weight.clone(), "master")
    shadow.set_master(LO, HI, opt.master_of(main).float().clone())
    (update,) = _updates(opt, weight, main, steps=1, kind="rademacher", refresh=1)
    update.draw += 1
    shadow.apply(update)
    assert not torch.equal(shadow.weight, weight)


def test_shadows_start_from_the_sync_and_give_the_changed_weights():
    """``Shadows`` cuts each sketched weight's training-TP shards out of a full sync's
    Hugging Face tensors and returns the Hugging Face tensors of what an update changed."""
    from loggra_megatron.model.args import GPTModelArgs

    args = GPTModelArgs(
        num_layers=1,
        hidden_size=16,
        ffn_hidden_size=32,
        num_attention_heads=4,
        vocab_size=64,
        swiglu=True,
    )
    shape = (16, 16)
    o_proj = torch.randn(shape).to(torch.bfloat16)
    name, hf = (
        "decoder.layers.0.self_attention.linear_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
    )
    masters = [
        RowMaster(name, t, 0, 16, o_proj[:, 8 * t : 8 * t + 8].float(), "master") for t in (0, 1)
    ]
    shadows = Shadows(args, training_tp=2, device="cpu")
    shadows.start({hf: o_proj}, masters)
    assert torch.equal(shadows.shadows[(name, 1)].weight, o_proj[:, 8:])  # row-parallel: columns
    assert shadows.advance([]) == {}
    signs = draw_signs("rademacher", 0, 0, "layer1.linear_proj", 2, 16, "cpu", torch.float32)
    update = RowUpdate(
        name,
        1,
        0,
        16,
        torch.ones(16, 2),
        0.5,
        0.0,
        "layer1.linear_proj",
        "rademacher",
        0,
        0,
        2,
        16,
        8,
        8,
    )
    changed = shadows.advance([update])
    assert set(changed) == {hf} and torch.equal(changed[hf][:, :8], o_proj[:, :8])
    step = (torch.ones(16, 2) @ signs[:, 8:]) * (0.5 / math.sqrt(2))
    assert torch.equal(changed[hf][:, 8:], (o_proj[:, 8:].float() - step).to(torch.bfloat16))

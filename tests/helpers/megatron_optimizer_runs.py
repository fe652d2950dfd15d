"""Tiny GPT training runs on CPU/gloo ranks for the tests of LoGRA inside Megatron-Core's
optimizers: the model and optimizer, one rank's batch, and a run that returns what the tests
compare (params, losses, state bytes, LoGRA's layouts).

hidden=40 (rows of 40 and 80 floats) makes the DistributedOptimizer's DP shard boundary
fall in the middle of a row, which is the hard case for exact DP sharding.
"""

import torch

from loggra_megatron.testing import tiny_bf16_gpt_model, tiny_gpt_model, train_step, wrap_ddp

HIDDEN, HEADS, VOCAB, SEQ = 40, 4, 64, 8
TOKENS = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))


def bf16_model():
    """The tiny model in bf16 (norms included), wrapped in Megatron's Float16Module."""
    return tiny_bf16_gpt_model(num_layers=2, hidden_size=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ)


def build_bf16_clipped(**loggra):
    """``(ddp, optimizer)``: LoGRA on the bf16 model with bf16 grad buffers handed over
    uncopied and clipping active (``loggra``: the LoGRA settings that differ)."""
    from megatron.core.optimizer import OptimizerConfig

    from loggra_megatron.optim import LoGRAConfig, get_loggra_optimizer

    ddp = wrap_ddp(bf16_model(), grad_reduce_in_fp32=False)
    config = OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True, clip_grad=0.05
    )
    settings = LoGRAConfig(
        loggra_sketch="gradient", loggra_min_dim=1, loggra_oversample=2, **loggra
    )
    return ddp, get_loggra_optimizer(config, [ddp], settings)


def build(kind: str, use_dist: bool = True, overlap: bool = False, **loggra):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.optim import LoGRAConfig, get_loggra_optimizer

    model = tiny_gpt_model(
        num_layers=2,
        hidden_size=HIDDEN,
        heads=HEADS,
        vocab=VOCAB,
        seq=SEQ,
        use_cpu_initialization=True,
    )
    ddp_kw = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=1000)
    ddp = wrap_ddp(model, use_distributed_optimizer=use_dist, **(ddp_kw if overlap else {}))
    base = dict(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        use_distributed_optimizer=use_dist,
        clip_grad=1.0,
    )
    if kind == "dense":
        return ddp, get_megatron_optimizer(OptimizerConfig(**base), [ddp])
    loggra = {"loggra_min_dim": 1, "loggra_rank": 4, "loggra_oversample": 2, **loggra}
    return ddp, get_loggra_optimizer(
        OptimizerConfig(**base), [ddp], LoGRAConfig(**{"loggra_sketch": "gradient", **loggra})
    )


def local_batch(tokens):
    """This DP rank's rows of the global batch, and its number of microbatches."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    local = tokens[rank::dp]
    return local, local.shape[0]


def gathered_params(ddp):
    if ddp.ddp_config.overlap_param_gather:  # the last step's all-gather is still pending
        ddp.start_param_sync(force_sync=True)
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def train(
    rank, kind, steps, use_dist=True, overlap=False, tokens=TOKENS, save=None, load=None, **loggra
):
    from loggra_megatron.checkpointing import load_checkpoint, save_checkpoint
    from loggra_megatron.optim import state_bytes

    ddp, opt = build(kind, use_dist, overlap, **loggra)
    if load is not None:
        load_checkpoint(load, [ddp], opt)
    batch, micro = local_batch(tokens[:2])
    losses = []
    for step in range(steps):
        loss, (ok, _, _) = train_step(ddp, opt, batch, num_microbatches=micro)
        assert ok
        losses.append(loss)
        if save is not None and step + 1 == save[1]:
            save_checkpoint(save[0], step + 1, [ddp], opt, common={"step": step + 1})
    inner = opt.optimizer
    layout_of = getattr(inner, "layout_of", lambda p: None)
    layouts = [layout_of(p) for g in inner.param_groups for p in g["params"]]
    return {
        "params": gathered_params(ddp),
        "losses": losses,
        "state_bytes": state_bytes(opt),
        "layouts": [lay for lay in layouts if lay is not None],
        "all_layouts": getattr(inner, "_all_layouts", []),
        "dp_rank": getattr(inner, "_dp_rank", 0),
    }


def max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)

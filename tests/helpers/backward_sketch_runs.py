"""Rank functions of the backward-sketch tests (``tests/integration/test_backward_sketch.py``): a tiny GPT
with ``--loggra-sketch backward`` through Megatron's DDP, schedule and chained optimizer, and
the dense reference it is compared with (the same weights, targets trainable)."""

import torch

from loggra_megatron.optim.config import LoGRAConfig, OptimConfig
from loggra_megatron.testing import tiny_gpt_model, train_step, wrap_ddp

HIDDEN, HEADS, VOCAB, SEQ, RANK = 32, 4, 64, 16, 8
TOKENS = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))


def settings(**loggra):
    optim = OptimConfig(optimizer="loggra", lr=3e-2, weight_decay=0.1, clip_grad=0.5)
    base = dict(loggra_sketch="backward", loggra_rank=RANK, loggra_seed=7)
    return optim, LoGRAConfig(**{**base, **loggra})


def model(bf16=False, **overrides):
    """The tiny model with CPU initialization (the same weights at any TP size); under
    sequence parallelism or with ``fused_norm`` (TE's ``LayerNormLinear``) with the stand-in
    Transformer Engine layers (``gpu_standins``: the local spec's norm refuses SP)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(1234)  # the same weights at every build in a process
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    kw = dict(use_cpu_initialization=True, **overrides)
    fused_norm = kw.pop("fused_norm", False)
    if kw.get("sequence_parallel") or fused_norm or kw.get("sequence_packing"):
        import gpu_standins

        gpu_standins.install_transformer_engine(fused_norm=fused_norm)
        gpu_standins.ThdDotProductAttention.dtype_rule = kw.get("bf16", bf16)
        kw["use_te"] = True
    if bf16:
        kw.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    shape = dict(hidden_size=kw.pop("hidden_size", HIDDEN), heads=kw.pop("heads", HEADS))
    shape["kv_channels"] = kw.pop("kv_channels", None)
    m = tiny_gpt_model(num_layers=2, vocab=VOCAB, seq=SEQ, **shape, **kw)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        m = Float16Module(m.config, m.bfloat16())
    return m


def build_sketched(optim, loggra, bf16=False, grad_reduce_in_fp32=True, state=None, **overrides):
    """``(ddp, chained optimizer)`` with the backward sketch on the targets (the weights of
    ``state`` when given)."""
    from loggra_megatron.optim.megatron.backward_sites import prepare_model
    from loggra_megatron.optim.megatron.factory import build_loggra

    m = model(bf16, **overrides)
    if state is not None:
        m.load_state_dict(state)
    sites = prepare_model(m, optim, loggra)
    ddp = wrap_ddp(
        m,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
    )
    return ddp, build_loggra(optim, loggra, [ddp], [sites])


def local_batch(tokens):
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    local = tokens[parallel_state.get_data_parallel_rank() :: dp]
    return local, local.shape[0]


LENGTHS = torch.tensor([16, 9, 12, 5])
"""Fed positions of each row of ``TOKENS`` in the packed runs."""


def _packed_step(data_iterator, model):
    """A masked token-mean loss on the log-probs of a packed (THD) micro-batch."""
    from megatron.core import parallel_state

    from loggra_megatron.model.batching import LENGTHS as KEY
    from loggra_megatron.model.forward import gpt_forward, last_hidden

    batch = next(data_iterator)
    hidden = gpt_forward(model, batch)

    def loss_func(out):
        if not parallel_state.is_pipeline_last_stage():
            return out.float().sum() * 0, {}
        log_probs = last_hidden(model, batch, out).log_probs()
        positions = torch.arange(log_probs.shape[1]).unsqueeze(0)
        mask = (positions < batch[KEY].unsqueeze(1)).float()
        return -(log_probs * mask).sum() / mask.sum(), {}

    return hidden, loss_func


def _backward(ddp, tokens, packed=False):
    from loggra_megatron.model.batching import LENGTHS as KEY
    from loggra_megatron.model.forward import run_schedule
    from loggra_megatron.testing import _gpt_forward_step

    batch, micro = local_batch(tokens)
    lengths, _ = local_batch(LENGTHS)
    mbs = batch.shape[0] // micro
    micro_batches = [
        {"tokens": batch[i : i + mbs], **({KEY: lengths[i : i + mbs]} if packed else {})}
        for i in range(0, batch.shape[0], mbs)
    ]
    from loggra_megatron.model.forward import packs_sequences

    assert packs_sequences(ddp) == packed
    ddp.zero_grad_buffer()
    step = _packed_step if packed else _gpt_forward_step
    run_schedule(ddp, step, micro_batches, forward_only=False)


def sketch_vs_dense(rank, recompute=False, reduce="step", **overrides):
    """Max relative error of each target's reduced ``S`` (this rank's rows) against
    ``G Aᵀ`` in float64, ``G`` the dense gradient of the same weights and batch
    (``sequence_packing``: THD micro-batches of rows of ``LENGTHS``; ``reduce``:
    ``--loggra-sketch-reduce``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    extra = dict(overrides)
    if recompute:
        extra.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    optim, loggra = settings(loggra_sketch_reduce=reduce)
    dense = model(**extra)
    ddp_dense = wrap_ddp(dense, use_distributed_optimizer=False)
    packed = bool(overrides.get("sequence_packing"))
    _backward(ddp_dense, TOKENS, packed)
    grads = {n: p.main_grad.double() for n, p in dense.named_parameters()}
    ddp, opt = build_sketched(optim, loggra, state=dense.state_dict(), **extra)
    leaf = opt.chained_optimizers[-1]
    leaf.zero_grad()
    _backward(ddp, TOKENS, packed)
    leaf.prepare_grads()
    (sites,) = leaf.sites
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    errors, not_frozen = {}, []
    for site in sites:
        name = names[id(site.weight)]
        if (
            site.weight.requires_grad
            or hasattr(site.weight, "main_grad")
            or site.weight.grad is not None
        ):
            not_frozen.append(name)
        a = sites.signs(site, torch.float64) / RANK**0.5
        ref = grads[name] @ a.t()  # [m, n] x [n, r]
        if not site.column_parallel and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(ref, group=tp_group)
        lo, hi = site.owned_rows(leaf.segment)
        got = sites.rows_view(site, leaf.segment).double()
        errors[site.name] = float((got - ref[lo:hi]).norm() / ref[lo:hi].norm())
    grad_buffer_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers)
    dense_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp_dense.buffers)
    in_buffers = [s.name for s in sites for b in ddp.buffers if s.weight in b.param_index_map]
    return {
        "errors": errors,
        "not_frozen": not_frozen + in_buffers,
        "grad_buffer_bytes": grad_buffer_bytes,
        "dense_grad_buffer_bytes": dense_bytes,
        "target_numel": sum(s.weight.numel() for s in sites),
        "target_rows": sum(s.rows for s in sites),
        "sketch_buffer_numel": sites.buffer.numel(),
    }


def train(rank, steps=3, save=None, load=None, bf16=False, **kw):
    """``steps`` updates with the backward sketch; the gathered weights and what the tests
    compare (grad norms, state bytes, the projection of layer 1's qkv)."""
    from loggra_megatron.checkpointing import load_checkpoint, save_checkpoint
    from loggra_megatron.optim import state_bytes

    shape = ("sequence_parallel", "hidden_size", "heads", "kv_channels")
    overrides = {k: kw.pop(k) for k in list(kw) if k in shape}
    optim, loggra = settings(**kw)
    ddp, opt = build_sketched(optim, loggra, bf16=bf16, **overrides)
    if load is not None:
        load_checkpoint(load, [ddp], opt)
    batch, micro = local_batch(TOKENS)
    norms = []
    for step in range(steps):
        _, (ok, norm, _) = train_step(ddp, opt, batch, num_microbatches=micro)
        assert ok
        norms.append(float(norm))
        if save is not None and step + 1 == save[1]:
            save_checkpoint(save[0], step + 1, [ddp], opt, common={"step": step + 1})
    ddp.start_param_sync(force_sync=True)
    leaf = opt.chained_optimizers[-1]
    (sites,) = leaf.sites
    return {
        "params": full_params(ddp),
        "norms": norms,
        "state_bytes": state_bytes(opt),
        "sketch_state_bytes": state_bytes(leaf.optimizer),
        "rows": sum(hi - lo for _, _, lo, hi in leaf.rows_of.values()),
        "signs": sites.signs(sites.sites[0], torch.float32),
    }


def full_params(ddp):
    """Every parameter, gathered over TP to its full shape (``[m, n]`` as at TP=1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    out = {}
    for name, p in ddp.module.named_parameters():
        t = p.detach().float().clone()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
            if name.endswith("linear_fc1.weight"):  # SwiGLU: [gate_k; up_k] per rank
                halves = [x.chunk(2) for x in parts]
                t = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        out[name] = t
    return out


def resume(rank, root, bf16=False, **kw):
    """4 updates straight, and 2 + save → a fresh build that loads → 2 more: both results,
    and the checkpoint's optimizer keys of this rank."""
    straight = train(rank, steps=4, bf16=bf16, **kw)
    train(rank, steps=2, save=(root, 2), bf16=bf16, **kw)
    resumed = train(rank, steps=2, load=root, bf16=bf16, **kw)
    return {"straight": straight, "resumed": resumed}


def kl_trial(rank, scale=0.5, **recipe):
    """bf16 weights, bf16 grads, remainders: through ``MegatronStepper`` the trial at η is the
    commit at η bit for bit, and a trial that is not committed restores θ bit for bit."""
    from loggra_megatron.optim.megatron.stepper import MegatronStepper

    optim = OptimConfig(
        optimizer="loggra", lr=3e-2, weight_decay=0.1, clip_grad=0.5, grad_reduce_in_bf16=True
    )
    loggra = LoGRAConfig(
        loggra_sketch="backward",
        loggra_rank=RANK,
        loggra_seed=7,
        loggra_param_remainders=True,
        **recipe,
    )
    ddp, opt = build_sketched(optim, loggra, bf16=True, grad_reduce_in_fp32=False)
    stepper = MegatronStepper(opt)
    assert stepper.trials_are_commits
    out = {}
    for step in range(2):
        opt.zero_grad()
        _backward(ddp, TOKENS)
        prepared = stepper.prepare()
        assert prepared.ok
        theta = full_params(ddp)
        with stepper.try_candidate(1.0):
            full = full_params(ddp)
        stepper.restore_model_weights()
        restored = full_params(ddp)
        with stepper.try_candidate(scale):
            half = full_params(ddp)
        sq_norm = stepper.update_sq_norm()
        stepper.commit(scale)
        committed = full_params(ddp)
        out[step] = {
            "restored_equal": all(torch.equal(restored[k], theta[k]) for k in theta),
            "commit_equals_trial": all(torch.equal(committed[k], half[k]) for k in half),
            "full_moved": sum(float((full[k] - theta[k]).norm()) for k in theta),
            "sq_norm": sq_norm,
        }
    return out


def nonfinite_skip(rank):
    """A NaN in one rank's sketch: the step is skipped and changes nothing."""
    from loggra_megatron.optim.megatron.stepper import MegatronStepper

    optim, loggra = settings()
    ddp, opt = build_sketched(optim, loggra)
    stepper = MegatronStepper(opt)
    opt.zero_grad()
    _backward(ddp, TOKENS)
    before = full_params(ddp)
    leaf = opt.chained_optimizers[-1]
    if rank == 0:
        leaf.sites[0].buffer.view(-1)[3] = float("nan")
    prepared = stepper.step()
    after = full_params(ddp)
    return {
        "ok": prepared.ok,
        "unchanged": all(torch.equal(after[k], before[k]) for k in before),
        "num_steps": leaf.optimizer.num_steps,
        "state": leaf.optimizer.state_dict()["state"],
    }


def mismatched_projection(rank):
    """Rank 1 draws its projections from another generator stream (as another torch build
    or device type would): building the backward sketch must fail on every rank."""
    from loggra_megatron.optim.megatron import backward_sites

    if rank == 1:
        draw = backward_sites.draw_signs
        backward_sites.draw_signs = lambda *a, **k: -draw(*a, **k)
    build_sketched(*settings())

"""Bytes communicated per training step over data parallelism, and step time: dense Adam vs
LoGRA's gradient sketch vs LoGRA's backward sketch, on the same model and ranks.

Run with torchrun (CPU/gloo here, NCCL on GPUs)::

    torchrun --nproc-per-node 2 benchmarks/dp_traffic.py
    torchrun --nproc-per-node 2 benchmarks/dp_traffic.py --grad-reduce-in-bf16

Every ``torch.distributed`` collective is counted at its call, as the bytes a ring sends per
rank: ``(n−1)/n`` of the reduce-scattered input or all-gathered output, ``2(n−1)/n`` of an
all-reduced tensor (``n``: the group's size). A step is Megatron's schedule over
``--micro-batches`` micro-batches (forward, backward, the grad reduce-scatter) and
``optimizer.step()`` (the norm all-reduce, the update, the param all-gather). Dense Adam and
the gradient sketch reduce-scatter every gradient and all-gather every bf16 weight; the
backward sketch reduce-scatters ``S`` (``Σ m·r`` fp32) instead of its targets' gradients
(``m·n``) and all-gathers their bf16 rows (docs/optimizer.md#the-backward-sketch); with
``--loggra-sketch-reduce microbatch`` it reduce-scatters each layer's ``S`` in every
micro-batch's backward (``--micro-batches`` times the bytes).

The backward sketch's weight sync alone is timed after that table (rank 0's medians over
``--sync-repeats``, the paths taking turns, a barrier before each): one all-gather per target
weight (the former path, ``row_gather.gather_rows_per_weight``) against the bucketed sync
(``BackwardSketchOptimizer.sync_weights``: one bucket for this model's targets under the
40M-element cap) and against buckets of ``--sync-bucket-numel`` gathered elements, one after
the other and pipelined (the ``--overlap-param-gather`` path: the next bucket's gather in
flight while one is copied back), their bytes and collectives counted as above.
``--weight-sync-only`` prints that part only::

    torchrun --nproc-per-node 2 benchmarks/dp_traffic.py --weight-sync-only
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist

KINDS = ("dense", "gradient", "backward", "backward/microbatch")
"""``backward/microbatch``: the backward sketch with ``--loggra-sketch-reduce microbatch``."""


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--rank", type=int, default=None, help="LoGRA rank (default hidden/8)")
    ap.add_argument("--grad-reduce-in-bf16", action="store_true", help="bf16 grad buffers")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after 1 warm-up)")
    ap.add_argument("--sync-repeats", type=int, default=20, help="timed weight syncs per path")
    ap.add_argument(
        "--sync-bucket-numel",
        type=int,
        default=4_000_000,
        help="gathered elements per bucket of the capped weight sync (DDP's bucket_size)",
    )
    ap.add_argument(
        "--weight-sync-only", action="store_true", help="only the backward sketch's weight sync"
    )
    return ap.parse_args()


class TrafficCounter:
    """Ring bytes per rank of every collective called while it is active, by kind."""

    def __init__(self):
        self.bytes = Counter()
        self.calls = Counter()
        self._saved = {}

    @staticmethod
    def _nbytes(t) -> int:
        return t.numel() * t.element_size()

    def _wrap(self, owner, attr, name, size_of):
        original = getattr(owner, attr)

        def counted(*args, **kwargs):
            groups = [a for a in args if isinstance(a, dist.ProcessGroup)]
            group = kwargs.get("group", groups[0] if groups else None)
            n = dist.get_world_size(group)
            if n > 1:
                self.bytes[name] += size_of(*args) * (n - 1) / n
                self.calls[name] += 1
            return original(*args, **kwargs)

        self._saved[(owner, attr)] = original
        setattr(owner, attr, counted)

    def __enter__(self):
        from megatron.core.distributed import param_and_grad_buffer as buffers

        scatter = lambda out, inp, *a, **k: self._nbytes(inp)  # noqa: E731
        gather = lambda out, inp, *a, **k: self._nbytes(out)  # noqa: E731
        self._wrap(dist, "all_reduce", "all_reduce", lambda t, *a, **k: 2 * self._nbytes(t))
        self._wrap(dist, "reduce_scatter_tensor", "reduce_scatter", scatter)
        self._wrap(dist, "all_gather_into_tensor", "all_gather", gather)
        # Megatron's DDP calls them through module-level aliases
        self._wrap(buffers, "dist_reduce_scatter_func", "reduce_scatter", scatter)
        self._wrap(buffers, "dist_all_gather_func", "all_gather", gather)
        return self

    def __exit__(self, *exc):
        for (owner, attr), original in self._saved.items():
            setattr(owner, attr, original)


def build(args, kind: str):
    from loggra_megatron.optim.config import LoGRAConfig, OptimConfig
    from loggra_megatron.optim.megatron.factory import build_dense_adam, build_loggra, prepare_model
    from loggra_megatron.testing import tiny_bf16_gpt_model, wrap_ddp

    torch.manual_seed(0)
    model = tiny_bf16_gpt_model(
        num_layers=args.layers,
        hidden_size=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        ffn_hidden_size=args.ffn,
    )
    optim = OptimConfig(optimizer="adam" if kind == "dense" else "loggra", lr=1e-4)
    backward = kind.startswith("backward")
    loggra = LoGRAConfig(
        loggra_sketch="backward" if backward else "gradient",
        loggra_rank=args.rank or args.hidden // 8,
        **({"loggra_sketch_reduce": kind.partition("/")[2]} if "/" in kind else {}),
    )
    sites = prepare_model(model, optim, loggra)  # backward: targets frozen before DDP
    ddp = wrap_ddp(model, grad_reduce_in_fp32=not args.grad_reduce_in_bf16)
    build_optimizer = build_dense_adam if kind == "dense" else build_loggra
    return ddp, build_optimizer(optim, loggra, [ddp], [sites])


def run(args, kind: str) -> dict:
    from loggra_megatron.testing import train_step

    ddp, opt = build(args, kind)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.micro_batches, args.seq + 1), generator=gen)
    train_step(ddp, opt, tokens, num_microbatches=args.micro_batches)  # allocates the state
    times = []
    with TrafficCounter() as traffic:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            train_step(ddp, opt, tokens, num_microbatches=args.micro_batches)
            times.append(time.perf_counter() - t0)
    return {
        "bytes": {k: v / args.steps for k, v in traffic.bytes.items()},
        "step_s": statistics.median(times),
    }


def _interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions taking turns (a barrier before each
    call), so that load from outside the run weighs on all of them alike."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def weight_sync(args) -> dict:
    """The backward sketch's weight sync per weight, bucketed, and in buckets of
    ``--sync-bucket-numel`` one after the other and pipelined: ring bytes, all-gathers and
    seconds of one sync."""
    from loggra_megatron.optim.megatron.backward_row_gather import (
        gather_rows_per_weight,
        row_gathers,
        sync_buckets,
    )
    from loggra_megatron.testing import train_step

    ddp, opt = build(args, "backward")
    leaf = opt.chained_optimizers[-1]
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.micro_batches, args.seq + 1), generator=gen)
    train_step(ddp, opt, tokens, num_microbatches=args.micro_batches)  # rows differ by rank
    capped = [
        gather
        for sites in leaf.sites
        for gather in row_gathers(sites, leaf.segment, leaf.dp_group, args.sync_bucket_numel)
    ]

    def per_weight():
        for sites in leaf.sites:
            gather_rows_per_weight(sites, leaf.segment, leaf.dp_group)

    syncs = {
        "per weight": per_weight,
        "bucketed (the default cap)": leaf.sync_weights,
        f"buckets of {args.sync_bucket_numel} elements": lambda: sync_buckets(capped, False),
        f"buckets of {args.sync_bucket_numel}, pipelined": lambda: sync_buckets(capped, True),
    }
    out = {}
    for name, fn in syncs.items():
        fn()
        with TrafficCounter() as traffic:
            fn()
        out[name] = {"bytes": traffic.bytes["all_gather"], "calls": traffic.calls["all_gather"]}
    for name, seconds in _interleaved_medians(syncs, args.sync_repeats).items():
        out[name]["s"] = seconds
    return out


def print_weight_sync(sync: dict) -> None:
    base = sync["per weight"]
    print(
        "\n| backward sketch weight sync | all-gathers | bytes (MiB) | / per weight | time (ms) "
        "| / per weight |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in sync.items():
        print(
            f"| {name} | {r['calls']} | {r['bytes'] / 2**20:.3f} | "
            f"{r['bytes'] / base['bytes']:.3f} | {r['s'] * 1e3:.2f} | "
            f"{r['s'] / base['s']:.2f} |"
        )


def main() -> None:
    args = parse_args()
    from loggra_megatron.parallel import initialize_megatron

    initialize_megatron(device="cpu")
    kinds = () if args.weight_sync_only else KINDS
    results = {kind: run(args, kind) for kind in kinds}
    sync = weight_sync(args)
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    mib = 2**20
    print(
        f"# dp_traffic: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, vocab "
        f"{args.vocab}, {args.micro_batches} x {args.seq} tokens per rank, DP="
        f"{dist.get_world_size()}, bf16 weights, {'bf16' if args.grad_reduce_in_bf16 else 'fp32'}"
        f" grads, LoGRA rank {args.rank or args.hidden // 8}; rank 0's ring bytes per step"
    )
    if results:
        names = sorted({k for r in results.values() for k in r["bytes"]})
        print(f"\n| optimizer | {' | '.join(names)} | total (MiB) | / dense | step (s) | / dense |")
        print("|---|" + "---:|" * (len(names) + 4))
        dense = results["dense"]
        dense_total = sum(dense["bytes"].values())
        for kind, r in results.items():
            total = sum(r["bytes"].values())
            cells = " | ".join(f"{r['bytes'].get(n, 0) / mib:.2f}" for n in names)
            print(
                f"| {kind} | {cells} | {total / mib:.2f} | {total / dense_total:.3f} | "
                f"{r['step_s']:.3f} | {r['step_s'] / dense['step_s']:.2f} |"
            )
    print_weight_sync(sync)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

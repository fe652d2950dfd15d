"""Megatron DistributedOptimizer: dense Adam vs LoGRA on the same model and ranks.

Run with torchrun (CPU/gloo here, NCCL on GPUs)::

    torchrun --nproc-per-node 2 benchmarks/bench_distributed_optimizer.py
    torchrun --nproc-per-node 2 benchmarks/bench_distributed_optimizer.py --tp 2
    torchrun --nproc-per-node 8 benchmarks/bench_distributed_optimizer.py --device cuda

Prints, for each optimizer, the per-rank optimizer-state bytes (``state_bytes``: Adam's
moments / LoGRA's sketches and bases, not the fp32 master params both keep) and the
median time of ``optimizer.step()`` and of a whole training step (forward, backward,
reduce-scatter, step, all-gather), then the LoGRA / dense ratios. The model is
Llama-shaped (RMSNorm, SwiGLU, RoPE, GQA); LoGRA's rank defaults to hidden/8. The
default vocabulary keeps the (densely updated) embedding + output layer at ~4 % of the
parameters, their share in Llama-2-7B; their share sets a floor under the state ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-groups", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=None, help="LoGRA rank (default hidden/8)")
    ap.add_argument("--update-interval", type=int, default=200)
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after 2 warm-up)")
    ap.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda (NCCL) when a GPU is visible, else cpu (gloo)",
    )
    return ap.parse_args()


def _sync(device: torch.device) -> None:
    """Wait for the GPU, so that host timers measure its work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args, kind: str, device: torch.device) -> dict:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.optim import LoGRAConfig, get_loggra_optimizer, state_bytes
    from loggra_megatron.testing import tiny_gpt_model, train_step, wrap_ddp

    torch.manual_seed(0)
    model = tiny_gpt_model(
        num_layers=args.layers,
        hidden_size=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        query_groups=args.kv_groups,
        ffn_hidden_size=args.ffn,
    )
    ddp = wrap_ddp(model)
    base = dict(optimizer="adam", lr=1e-4, use_distributed_optimizer=True, clip_grad=1.0)
    if kind == "dense":
        opt = get_megatron_optimizer(OptimizerConfig(**base), [ddp])
    else:
        loggra = LoGRAConfig(
            loggra_sketch="gradient",
            loggra_rank=args.rank,
            loggra_update_interval=args.update_interval,
        )
        opt = get_loggra_optimizer(OptimizerConfig(**base), [ddp], loggra)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
    tokens = tokens.to(device)  # the same ids on every device
    step_times, opt_times = [], []
    inner_step = opt.optimizer.step

    def timed_inner_step(*a, **kw):
        _sync(device)
        t0 = time.perf_counter()
        out = inner_step(*a, **kw)
        _sync(device)
        opt_times.append(time.perf_counter() - t0)
        return out

    opt.optimizer.step = timed_inner_step
    for i in range(2 + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        train_step(ddp, opt, tokens)
        _sync(device)
        if i >= 2:
            step_times.append(time.perf_counter() - t0)
    return {
        "state_bytes": state_bytes(opt),
        "opt_s": statistics.median(opt_times[2:]),
        "step_s": statistics.median(step_times),
        "params": sum(p.numel() for p in ddp.module.parameters()),
    }


def main() -> None:
    args = parse_args()
    from megatron.core import parallel_state

    from loggra_megatron.parallel import initialize_megatron

    # CPU mode + gloo on CPU, NCCL on GPU; the model is built on the returned device
    device = initialize_megatron(tensor_model_parallel_size=args.tp, device=args.device)
    results = {kind: run(args, kind, device) for kind in ("dense", "loggra")}
    rows = [results[k] for k in ("dense", "loggra")]
    all_rows = [None] * dist.get_world_size()
    dist.all_gather_object(all_rows, rows)
    if dist.get_rank() == 0:
        dp = parallel_state.get_data_parallel_world_size()
        print(
            f"# bench_distributed_optimizer: {args.layers} layers, hidden {args.hidden}, "
            f"ffn {args.ffn}, heads {args.heads}/{args.kv_groups} kv, vocab {args.vocab}, "
            f"rank {args.rank or args.hidden // 8}, world {dist.get_world_size()} "
            f"(TP={args.tp}, DP={dp}), {rows[0]['params'] / 1e6:.1f}M params per TP rank, "
            f"{device.type}"
        )
        print(
            "\n| rank | dense state (MiB) | LoGRA state (MiB) | state ratio | "
            "opt.step dense (ms) | opt.step LoGRA (ms) | ratio | train step ratio |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r, (dense, loggra) in enumerate(all_rows):
            print(
                f"| {r} | {dense['state_bytes'] / 2**20:.2f} | {loggra['state_bytes'] / 2**20:.2f} "
                f"| {loggra['state_bytes'] / dense['state_bytes']:.3f} "
                f"| {1e3 * dense['opt_s']:.1f} | {1e3 * loggra['opt_s']:.1f} "
                f"| {loggra['opt_s'] / dense['opt_s']:.2f} "
                f"| {loggra['step_s'] / dense['step_s']:.2f} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

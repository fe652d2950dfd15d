"""Optimizer micro-benchmark: LoGRA-AdamW vs torch AdamW (foreach) on Llama-shaped layers.

Measured in one run, on one machine, side by side:

* optimizer-state bytes, LoGRA / AdamW (all matrices here are sketched);
* median step time on non-refresh steps, and amortised over ``update_interval`` steps
  with one refresh: ``((T-1)·t_step + t_refresh_step) / T``;
* basis refresh time: range finder / full SVD (GaLore's basis) on the same gradients.

Shapes (megatron-core layout, ``[out, in]``) of one Llama decoder layer with hidden h,
FFN f, head dim d and g KV groups: ``linear_qkv [h + 2·g·d, h]``, ``linear_proj [h, h]``,
``linear_fc1 [2f, h]`` (SwiGLU gate+up fused), ``linear_fc2 [h, f]``.

    python benchmarks/bench_optimizer.py                      # Llama-1B-shaped, 1 layer
    python benchmarks/bench_optimizer.py --hidden 1024 --ffn 2816 --kv-groups 4 --layers 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from loggra_megatron.optim import LoGRAAdamW, state_bytes
from loggra_megatron.optim.gradient_sketch.projection import (
    gaussian_test_matrix,
    range_finder_basis,
    svd_basis,
)


def layer_shapes(hidden: int, ffn: int, heads: int, kv_groups: int) -> list[tuple[int, int]]:
    head_dim = hidden // heads
    return [
        (hidden + 2 * kv_groups * head_dim, hidden),  # linear_qkv
        (hidden, hidden),  # linear_proj
        (2 * ffn, hidden),  # linear_fc1
        (hidden, ffn),  # linear_fc2
    ]


def _time_steps(opt, params, grads, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-groups", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--rank", type=int, default=None, help="default: hidden/8")
    ap.add_argument("--update-interval", type=int, default=200)
    ap.add_argument("--steps", type=int, default=10, help="timed non-refresh steps")
    ap.add_argument("--refresh-steps", type=int, default=3, help="timed refresh steps")
    return ap.parse_args()


def time_adam(shapes, grads, steps: int):
    """torch AdamW (foreach): the optimizer and its step times after a warm-up."""
    adam_params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    adam = torch.optim.AdamW(adam_params, lr=1e-4, foreach=True)
    _time_steps(adam, adam_params, grads, 2)  # warm-up, allocates state
    return adam, _time_steps(adam, adam_params, grads, steps)


def time_loggra(args, shapes, grads, rank: int):
    """LoGRA-AdamW: the optimizer, its refresh-step times and its non-refresh step times."""
    loggra_params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    loggra = LoGRAAdamW(loggra_params, lr=1e-4, rank=rank, update_interval=args.update_interval)
    refresh_times = []
    for _ in range(args.refresh_steps):  # each of these steps recomputes the bases
        for group in loggra.param_groups:
            group["update_interval"] = 1
        refresh_times += _time_steps(loggra, loggra_params, grads, 1)
    for group in loggra.param_groups:
        group["update_interval"] = 10**9
    return loggra, refresh_times, _time_steps(loggra, loggra_params, grads, args.steps)


def time_bases(grads, rank: int) -> tuple[float, float]:
    """Seconds to compute one layer's bases: range finder, full SVD (best of 2 each)."""

    def best_of(fn, repeats=2) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    rf_times, svd_times = [], []
    for g in grads[:4]:
        omega = gaussian_test_matrix(g.shape[0], rank + 8, 0, g.device, torch.float32)
        rf_times.append(best_of(lambda g=g, omega=omega: range_finder_basis(g, rank, 8, 1, omega)))
        svd_times.append(best_of(lambda g=g: svd_basis(g, rank)))
    return sum(rf_times), sum(svd_times)


def main() -> None:
    args = parse_args()
    rank = args.rank or args.hidden // 8
    torch.manual_seed(0)
    shapes = layer_shapes(args.hidden, args.ffn, args.heads, args.kv_groups) * args.layers
    grads = [torch.randn(s) * 1e-3 for s in shapes]
    numel = sum(m * n for m, n in shapes)
    print(
        f"# bench_optimizer: {args.layers} layer(s) {shapes[:4]}, {numel / 1e6:.1f}M params, "
        f"rank={rank}, threads={torch.get_num_threads()}, {platform.processor() or platform.machine()}"
    )
    adam, adam_times = time_adam(shapes, grads, args.steps)
    loggra, refresh_times, step_times = time_loggra(args, shapes, grads, rank)

    t_adam = statistics.median(adam_times)
    t_step = statistics.median(step_times)
    t_refresh_step = statistics.median(refresh_times)
    interval = args.update_interval
    t_amortised = ((interval - 1) * t_step + t_refresh_step) / interval
    rf, svd = time_bases(grads, rank)

    s_adam, s_loggra = state_bytes(adam), state_bytes(loggra)
    rows = [
        ("optimizer state (MiB)", s_adam / 2**20, s_loggra / 2**20, s_loggra / s_adam, "<= 0.20"),
        ("step, non-refresh (ms)", 1e3 * t_adam, 1e3 * t_step, t_step / t_adam, ""),
        (
            f"step, amortised T={interval} (ms)",
            1e3 * t_adam,
            1e3 * t_amortised,
            t_amortised / t_adam,
            "<= 1.5",
        ),
        ("refresh step (ms)", 1e3 * t_adam, 1e3 * t_refresh_step, t_refresh_step / t_adam, ""),
    ]
    print("\n| quantity | torch AdamW | LoGRA | LoGRA / AdamW | target |")
    print("|---|---:|---:|---:|---|")
    for name, a, b, ratio, target in rows:
        print(f"| {name} | {a:.2f} | {b:.2f} | {ratio:.3f} | {target} |")
    print(
        "\n| basis refresh, one layer | range finder (q=1, p=8) | full SVD (GaLore) | SVD / RF | target |"
    )
    print("|---|---:|---:|---:|---|")
    print(f"| time (ms) | {1e3 * rf:.1f} | {1e3 * svd:.1f} | {svd / rf:.1f}x | >= 5x |")


if __name__ == "__main__":
    main()

"""Peak memory of one RL training step, dense Adam vs LoGRA, measured side by side.

    python benchmarks/memory_rl.py                 # CPU: tensor accounting (below)
    python benchmarks/memory_rl.py --device cuda   # GPU: torch.cuda.max_memory_allocated

One GRPO step of the same bf16 Megatron GPT policy (fp32 master weights and Megatron's
distributed optimizer, DP = 1), a frozen bf16 reference model, and one micro-batch of
forward + backward + optimizer step; the optimizer is the only difference.

Accounting on CPU (no allocator statistics there): the peak of a step is taken as the
persistent tensors (policy weights, grad buffers, fp32 masters, optimizer state, reference
weights; each storage counted once) plus the activations autograd saves for backward
during the step (``saved_tensors_hooks``), which are all alive at the end of the forward.
Transients of the optimizer step and of the no-grad reference forward, and allocator
caching, are not included; the GPU path uses the allocator's own peak instead.

Shape: a Llama-style model (hidden 512, 8 layers, short sequences, micro-batch 1), so that,
as for a 27B policy with recompute at TP=8, the persistent per-parameter state dominates
the step rather than activations; rank = hidden/8.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Records every tensor autograd saves for backward (the activations a step holds)."""

    def __init__(self):
        self.saved = []
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t):
        self.saved.append(t)
        return t


def build(kind: str, args):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.optim import LoGRAOptimizerConfig, get_loggra_optimizer
    from loggra_megatron.testing import tiny_gpt_model, wrap_ddp

    torch.manual_seed(0)
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, heads=args.heads,
                 vocab=args.vocab, seq=args.seq, ffn_hidden_size=args.ffn, bf16=True)  # fmt: skip
    policy = wrap_ddp(tiny_gpt_model(**shape), grad_reduce_in_fp32=not args.bf16_grads)
    reference = tiny_gpt_model(**shape).eval().requires_grad_(False)
    base = dict(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True)
    if kind == "dense":
        return policy, reference, get_megatron_optimizer(OptimizerConfig(**base), [policy])
    config = LoGRAOptimizerConfig(**base, loggra_rank=args.hidden // 8)
    return policy, reference, get_loggra_optimizer(config, [policy])


def one_rl_step(policy, reference, optimizer, tokens) -> None:
    """Reference log-probs, then forward + backward of the policy and the optimizer step."""
    from loggra_megatron.rollout import compute_log_probs
    from loggra_megatron.testing import train_step

    compute_log_probs(reference, tokens)
    train_step(policy, optimizer, tokens)


def persistent_tensors(policy, reference, optimizer):
    """Weights, grad buffers, fp32 masters, optimizer state and the reference model."""
    yield from policy.parameters()
    yield from reference.parameters()
    for buffer in policy.buffers:
        yield buffer.grad_data
        if buffer.param_data is not None:
            yield buffer.param_data
    for group in optimizer.optimizer.param_groups:
        yield from group["params"]
    for state in optimizer.optimizer.state.values():
        yield from state.values()


def measure(kind: str, args) -> dict:
    from loggra_megatron.optim import state_bytes

    policy, reference, optimizer = build(kind, args)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=gen).to(args.device)
    one_rl_step(policy, reference, optimizer, tokens)  # allocate the optimizer state
    times = []
    for _ in range(args.timed_steps):
        t0 = time.perf_counter()
        one_rl_step(policy, reference, optimizer, tokens)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    result = {"state": state_bytes(optimizer), "step_s": statistics.median(times)}
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        one_rl_step(policy, reference, optimizer, tokens)
        return {**result, "peak": torch.cuda.max_memory_allocated()}
    activations = SavedActivations()
    with activations:
        one_rl_step(policy, reference, optimizer, tokens)
    persistent = storage_bytes(persistent_tensors(policy, reference, optimizer))
    saved = storage_bytes(activations.saved)
    return {**result, "activations": saved, "peak": persistent + saved}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bf16-grads", action="store_true", help="bf16 grad buffers")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--timed-steps", type=int, default=3)
    args = ap.parse_args()
    from loggra_megatron.trainer import initialize_megatron

    initialize_megatron(device=args.device)
    dense, loggra = measure("dense", args), measure("loggra", args)
    gib = 2**30
    print(f"# memory_rl: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, vocab "
          f"{args.vocab}, seq {args.seq}, micro-batch 1, bf16 + fp32 masters, "
          f"{'bf16' if args.bf16_grads else 'fp32'} grads, reference model, {args.device}")  # fmt: skip
    print("\n| GiB | dense Adam | LoGRA | LoGRA / dense | saved |")
    print("|---|---:|---:|---:|---:|")
    rows = (("state", "optimizer state"), ("activations", "saved activations"),
            ("peak", "peak step memory"))  # fmt: skip
    for key, name in rows:
        if key in dense:
            d, g = dense[key] / gib, loggra[key] / gib
            print(f"| {name} | {d:.3f} | {g:.3f} | {g / d:.3f} | {100 * (1 - g / d):.1f} % |")
    d, g = dense["step_s"], loggra["step_s"]
    print(
        f"\nstep time (s, median of {args.timed_steps}): dense {d:.3f}, LoGRA {g:.3f}, "
        f"ratio {g / d:.2f}"
    )


if __name__ == "__main__":
    main()

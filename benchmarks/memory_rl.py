"""Peak memory of one RL training step, dense Adam vs LoGRA, measured side by side.

    python benchmarks/memory_rl.py                 # CPU: tensor accounting (below)
    python benchmarks/memory_rl.py --device cuda   # GPU: torch.cuda.max_memory_allocated
    python benchmarks/memory_rl.py --device cuda --fp8 hybrid   # + Transformer Engine FP8

One GRPO step of the same bf16 Megatron GPT policy (fp32 master weights and Megatron's
distributed optimizer, DP = 1) and one micro-batch of forward + backward + optimizer
step; the optimizer is the only difference. Four settings are measured, because they
decide how large a share of the step the optimizer state is: grad buffers in fp32
(Megatron's default) or bf16, and a frozen bf16 reference model resident (GRPO/PPO with
a KL-to-reference term) or absent (``--kl-coef 0``, as in DAPO and Dr. GRPO).

Accounting on CPU (no allocator statistics there): the peak of a step is taken as the
persistent tensors (policy weights, grad buffers, fp32 masters, optimizer state, reference
weights; each storage counted once) plus the activations autograd saves for backward
during the step (``saved_tensors_hooks``; storages already counted, such as the weights
that linear layers save, are not counted again), all alive at the end of the forward,
or, if larger, the fp32 main-param gradients that Megatron's optimizer creates when it
steps (copies of bf16 grad buffers; free with fp32 buffers, which they view; LoGRA
converts bf16 shards one weight at a time, so it counts its largest conversion). Other
transients (inside the optimizer step, of the no-grad reference forward) and allocator
caching are not included; the GPU path uses the allocator's own peak instead.

Shape: a Llama-style model (hidden 512, 8 layers, short sequences, micro-batch 1), so that,
as for a 27B policy with recompute at TP=8, the persistent per-parameter state dominates
the step rather than activations; rank = hidden/8.
"""

from __future__ import annotations

import argparse
import gc
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


class MainGrads:
    """Records the fp32 main-param gradients the inner optimizer steps on. Megatron makes
    them when the step starts (``.float()`` copies of bf16 grad buffers; views of fp32
    ones), so with bf16 grads they are the optimizer phase's extra memory. LoGRA gets the
    bf16 shards instead (``model_grads``) and converts one at a time: ``largest_converted``
    is the largest such fp32 conversion, in bytes."""

    def __init__(self, optimizer):
        self.inner, self.grads, self.largest_converted = optimizer.optimizer, [], 0

    def __enter__(self):
        inner_step = self.inner.step

        def capture_then_step(*args, **kwargs):
            groups = self.inner.param_groups
            self.grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
            shards = getattr(self.inner, "model_grads", {}).values()
            self.largest_converted = 4 * max((g.numel() for g in shards), default=0)
            return inner_step(*args, **kwargs)

        self.inner.step = capture_then_step
        return self

    def __exit__(self, *exc):
        del self.inner.step  # back to the class's method


def build(kind: str, args, bf16_grads: bool, with_reference: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.optim import LoGRAOptimizerConfig, get_loggra_optimizer
    from loggra_megatron.testing import tiny_gpt_model, wrap_ddp

    torch.manual_seed(0)
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, heads=args.heads,
                 vocab=args.vocab, seq=args.seq, ffn_hidden_size=args.ffn, bf16=True)  # fmt: skip
    if args.fp8:  # Transformer Engine layers; FP8 GEMMs inside Megatron's fp8 context
        shape.update(use_te=True, fp8=args.fp8, fp8_recipe="delayed")
    policy = wrap_ddp(tiny_gpt_model(**shape), grad_reduce_in_fp32=not bf16_grads)
    reference = tiny_gpt_model(**shape).eval().requires_grad_(False) if with_reference else None
    base = dict(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True)
    if kind == "dense":
        return policy, reference, get_megatron_optimizer(OptimizerConfig(**base), [policy])
    config = LoGRAOptimizerConfig(
        **base, loggra_rank=args.hidden // 8, loggra_fp32_grad_copy=args.loggra_fp32_grad_copy
    )
    return policy, reference, get_loggra_optimizer(config, [policy])


def one_rl_step(policy, reference, optimizer, tokens) -> None:
    """Reference log-probs, then forward + backward of the policy and the optimizer step."""
    from loggra_megatron.rollout import compute_log_probs
    from loggra_megatron.testing import train_step

    if reference is not None:
        compute_log_probs(reference, tokens)
    train_step(policy, optimizer, tokens)


def persistent_tensors(policy, reference, optimizer):
    """Weights, grad buffers, fp32 masters, optimizer state and the reference model."""
    yield from policy.parameters()
    yield from reference.parameters() if reference is not None else ()
    for buffer in policy.buffers:
        yield buffer.grad_data
        if buffer.param_data is not None:
            yield buffer.param_data
    for group in optimizer.optimizer.param_groups:
        yield from group["params"]
    for state in optimizer.optimizer.state.values():
        yield from state.values()


def measure(kind: str, args, bf16_grads: bool, with_reference: bool) -> dict:
    """Build, measure, and free (so that the next measurement starts from nothing)."""
    try:
        return _measure(kind, args, bf16_grads, with_reference)
    finally:
        gc.collect()  # Megatron's DDP hooks form reference cycles
        if args.device == "cuda":
            torch.cuda.empty_cache()


def _measure(kind: str, args, bf16_grads: bool, with_reference: bool) -> dict:
    from loggra_megatron.optim import state_bytes

    policy, reference, optimizer = build(kind, args, bf16_grads, with_reference)
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
    activations, main_grads = SavedActivations(), MainGrads(optimizer)
    with activations, main_grads:
        one_rl_step(policy, reference, optimizer, tokens)
    persistent = list(persistent_tensors(policy, reference, optimizer))
    base = storage_bytes(persistent)
    saved = storage_bytes(persistent + activations.saved) - base  # weights are saved too
    step_grads = storage_bytes(persistent + main_grads.grads) - base
    step_grads += main_grads.largest_converted
    return {**result, "activations": saved, "step_grads": step_grads,
            "peak": base + max(saved, step_grads)}  # fmt: skip


SETTINGS = (  # (grad buffers in bf16, frozen reference model resident)
    (False, True),  # Megatron's default fp32 grads; GRPO/PPO with a KL-to-reference term
    (True, True),  # bf16 grad buffers (pretrain_rl.py --grad-reduce-in-bf16)
    (False, False),  # --kl-coef 0 (DAPO / Dr. GRPO): no reference model at all
    (True, False),
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--loggra-fp32-grad-copy", action="store_true",
                    help="ablation: let Megatron copy bf16 grads to fp32 for LoGRA too")  # fmt: skip
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--fp8", choices=["hybrid", "e4m3"],
                    help="Transformer Engine FP8 (Hopper GPU with transformer_engine only)")  # fmt: skip
    ap.add_argument("--timed-steps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.fp8 and args.device != "cuda":
        ap.error("--fp8 needs --device cuda (a Hopper GPU with Transformer Engine)")
    return args


def main() -> None:
    args = parse_args()
    from loggra_megatron.parallel import initialize_megatron

    initialize_megatron(device=args.device)
    gib = 2**30
    print(f"# memory_rl: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, vocab "
          f"{args.vocab}, seq {args.seq}, micro-batch 1, bf16 + fp32 masters, LoGRA rank "
          f"{args.hidden // 8}, "
          f"{f'FP8 {args.fp8}, ' if args.fp8 else ''}"
          f"{'LoGRA with fp32 grad copies, ' if args.loggra_fp32_grad_copy else ''}{args.device}")  # fmt: skip
    print("\n| grads | reference | GiB | dense Adam | LoGRA | LoGRA / dense | saved |")
    print("|---|---|---|---:|---:|---:|---:|")
    for bf16_grads, with_reference in SETTINGS:
        dense = measure("dense", args, bf16_grads, with_reference)
        loggra = measure("loggra", args, bf16_grads, with_reference)
        setting = f"| {'bf16' if bf16_grads else 'fp32'} | {'yes' if with_reference else 'no'} "
        rows = (("state", "optimizer state"), ("activations", "saved activations"),
                ("step_grads", "fp32 main grads (optimizer phase)"),
                ("peak", "**peak step memory**"))  # fmt: skip
        for key, name in rows:
            if key in dense:
                d, g = dense[key] / gib, loggra[key] / gib
                ratio = f"{g / d:.3f} | {100 * (1 - g / d):.1f} %" if d else "– | –"
                print(f"{setting}| {name} | {d:.3f} | {g:.3f} | {ratio} |")
        d, g = dense["step_s"], loggra["step_s"]  # median of --timed-steps
        print(f"{setting}| step time (s) | {d:.3f} | {g:.3f} | {g / d:.2f} | – |")


if __name__ == "__main__":
    main()

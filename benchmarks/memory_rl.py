"""Peak memory of one RL step, dense Adam vs LoGRA (``--loggra-sketch gradient`` and
``backward``), each in its best setting, side by side.

    python benchmarks/memory_rl.py                 # CPU: tensor accounting + allocation events
    python benchmarks/memory_rl.py --device cuda   # GPU: torch.cuda.max_memory_allocated
    python benchmarks/memory_rl.py --device cuda --fp8 hybrid   # + Transformer Engine FP8

Accounting on CPU: the persistent tensors plus the largest phase transient (rollout,
reference log-probs, training), each from the CPU allocator's own events; on GPU the
allocator's own peak. The step, the settings swept, the accounting in full and the shape:
``docs/benchmarks.md``, "Memory at scale". Dense Adam and the backward sketch are measured
first (``--optimizers``), and each row is printed as soon as it is measured, so a run stopped
by a timeout keeps the comparison that matters most.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import tempfile
import time

import torch

from loggra_megatron.optim.backward_sketch.sketch import SKETCH_REDUCTIONS


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class MainGrads:
    """Records the fp32 main-param gradients the inner optimizer steps on. Megatron makes
    them when the step starts (``.float()`` copies of bf16 grad buffers; views of fp32
    ones), so with bf16 grads they are the optimizer phase's extra memory. LoGRA gets the
    bf16 shards instead (``model_grads``) and converts a sketched weight's shard, or a piece
    of a dense one, at a time: ``largest_converted`` is the largest such fp32 conversion
    its ``_fp32`` made, in bytes."""

    def __init__(self, optimizer):
        first = getattr(optimizer, "chained_optimizers", [optimizer])[0]  # the dense leaf
        self.inner, self.grads, self.largest_converted = first.optimizer, [], 0

    def __enter__(self):
        inner_step = self.inner.step

        def capture_then_step(*args, **kwargs):
            groups = self.inner.param_groups
            self.grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
            return inner_step(*args, **kwargs)

        self.inner.step = capture_then_step
        convert = getattr(self.inner, "_fp32", None)
        if convert is not None:  # LoGRA's AdamW

            def recorded(p, piece):
                out = convert(p, piece)
                if piece.dtype != torch.float32:
                    self.largest_converted = max(self.largest_converted, out.nbytes)
                return out

            self.inner._fp32 = recorded
        return self

    def __exit__(self, *exc):
        del self.inner.step  # back to the class's methods
        self.inner.__dict__.pop("_fp32", None)


class AllocationPeak:
    """Peak bytes allocated and not yet freed during the block, from the CPU allocator's
    events (``torch.profiler`` with ``profile_memory=True``: every allocation and free, with
    its address and time). Blocks allocated inside a collective are left out, with their
    frees: gloo's CPU reduce-scatter clones the whole grad buffer, which NCCL does not; so
    are frees of blocks allocated before the block."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self.profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profile.__enter__()
        return self

    def __exit__(self, *exc):
        self.profile.__exit__(*exc)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            self.profile.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        collectives = [
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e.get("ph") == "X" and e.get("name", "").startswith(("c10d::", "gloo:"))
        ]
        memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
        live = self.peak = 0
        seen, left_out = set(), set()
        for e in memory:
            nbytes, addr = e["args"]["Bytes"], e["args"]["Addr"]
            if nbytes > 0 and any(lo <= e["ts"] <= hi for lo, hi in collectives):
                left_out.add(addr)
            elif nbytes > 0:
                seen.add(addr)
                live += nbytes
                self.peak = max(self.peak, live)
            elif addr in seen:
                seen.discard(addr)
                live += nbytes
            else:
                left_out.discard(addr)


def build(kind: str, args, bf16_grads: bool, with_reference: bool, remainders: bool = False):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.optim import LoGRAConfig, get_loggra_optimizer
    from loggra_megatron.testing import tiny_gpt_model, wrap_ddp

    torch.manual_seed(0)
    shape = dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        ffn_hidden_size=args.ffn,
        bf16=True,
    )
    if args.fp8:  # Transformer Engine layers; FP8 GEMMs inside Megatron's fp8 context
        shape.update(use_te=True, fp8=args.fp8, fp8_recipe="delayed")
    model = tiny_gpt_model(**shape, log_prob_chunk_size=args.log_prob_chunk_size)
    if kind == "backward":  # targets frozen and hooked before DDP: no grad buffer for them
        from loggra_megatron.optim.config import OptimConfig
        from loggra_megatron.optim.megatron.backward_sites import prepare_model
        from loggra_megatron.optim.megatron.factory import build_loggra

        optim = OptimConfig(optimizer="loggra", lr=1e-4)
        loggra = LoGRAConfig(
            loggra_sketch="backward",
            loggra_fp32_grad_copy=args.loggra_fp32_grad_copy,
            loggra_param_remainders=remainders,
            loggra_sketch_reduce=args.loggra_sketch_reduce,
        )
        sites = prepare_model(model, optim, loggra)
    policy = wrap_ddp(model, grad_reduce_in_fp32=not bf16_grads)
    reference = None
    if with_reference:
        reference = tiny_gpt_model(**shape, log_prob_chunk_size=args.log_prob_chunk_size)
        reference.eval().requires_grad_(False)
        if args.reference_offload:  # its weights on the host, streamed unit by unit
            from loggra_megatron.model.offload import offload_to_host

            offload_to_host(reference, torch.device(args.device))
    if kind == "backward":
        return policy, reference, build_loggra(optim, loggra, [policy], [sites])
    base = dict(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True)
    if kind == "dense":
        return policy, reference, get_megatron_optimizer(OptimizerConfig(**base), [policy])
    loggra = LoGRAConfig(
        loggra_sketch="gradient",
        loggra_fp32_grad_copy=args.loggra_fp32_grad_copy,
        loggra_param_remainders=remainders,
    )
    return policy, reference, get_loggra_optimizer(OptimizerConfig(**base), [policy], loggra)


PHASES = ("rollout", "log_probs", "training")


def one_rl_step(policy, reference, optimizer, prompts, tokens, phase=contextlib.nullcontext):
    """Rollout (KV-cached sampling), the reference's log-probs, then forward + backward of
    the policy (one micro-batch at a time, the actor's own schedule and chunked log-probs)
    and the optimizer step. ``phase(name)`` wraps each phase."""
    from loggra_megatron.model.log_probs import compute_log_probs
    from loggra_megatron.model.offload import release_device_weights
    from loggra_megatron.rl.actor import forward_backward, sft_loss_fn
    from loggra_megatron.rollout import RolloutRequest, generate_rollout

    with phase("rollout"):
        generate_rollout(
            policy, prompts, RolloutRequest(max_new_tokens=tokens.shape[1] - 1 - prompts.shape[1])
        )
    with phase("log_probs"):
        if reference is not None:
            compute_log_probs(reference, tokens, micro_batch_size=1)
            release_device_weights(reference)  # an offloaded one's last unit (else no-op)
    with phase("training"):
        mask = torch.ones(1, tokens.shape[1] - 1, dtype=torch.bool, device=tokens.device)
        micro = [{"tokens": row.unsqueeze(0), "mask": mask} for row in tokens]
        forward_backward(policy, optimizer, micro, sft_loss_fn(float(tokens[:, 1:].numel())), 1)
        optimizer.step()


def persistent_tensors(policy, reference, optimizer):
    """Weights, grad buffers, fp32 masters (or remainders), optimizer state, reference, and
    the backward sketch's buffer ``S``."""
    from loggra_megatron.optim.megatron.backward_optimizer import sketch_sites_of

    yield from policy.parameters()
    yield from reference.parameters() if reference is not None else ()
    for buffer in policy.buffers:
        yield buffer.grad_data
        if buffer.param_data is not None:
            yield buffer.param_data
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in leaf.optimizer.param_groups:
            yield from group["params"]
        for state in leaf.optimizer.state.values():
            yield from state.values()
        yield from getattr(leaf.optimizer, "param_remainders", {}).values()
    yield from (sites.buffer for sites in sketch_sites_of(optimizer))


def measure(kind: str, args, bf16_grads: bool, with_reference: bool, remainders=False) -> dict:
    """Build, measure, and free (so that the next measurement starts from nothing)."""
    try:
        return _measure(kind, args, bf16_grads, with_reference, remainders)
    finally:
        gc.collect()  # Megatron's DDP hooks form reference cycles
        if args.device == "cuda":
            torch.cuda.empty_cache()


def _measure(kind: str, args, bf16_grads: bool, with_reference: bool, remainders: bool) -> dict:
    from loggra_megatron.optim import state_bytes

    policy, reference, optimizer = build(kind, args, bf16_grads, with_reference, remainders)
    gen = torch.Generator().manual_seed(1)
    rows, prompt = args.rollout_rows, args.seq - args.new_tokens
    tokens = torch.randint(0, args.vocab, (rows, args.seq + 1), generator=gen)
    g = args.num_generations  # GRPO groups: their rows share a prompt (and its prefill)
    tokens[:, :prompt] = tokens[::g, :prompt].repeat_interleave(g, dim=0)
    tokens = tokens.to(args.device)
    prompts = tokens[:, :prompt]
    step = lambda **kw: one_rl_step(policy, reference, optimizer, prompts, tokens, **kw)  # noqa: E731
    step()  # allocate the optimizer state
    times = []
    for _ in range(args.timed_steps):
        t0 = time.perf_counter()
        step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    result = {"state": state_bytes(optimizer), "step_s": statistics.median(times)}
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step()
        return {**result, "peak": torch.cuda.max_memory_allocated()}
    peaks = {}

    @contextlib.contextmanager
    def phase(name):
        gc.collect()
        with AllocationPeak() as allocated:
            yield
        peaks[name] = allocated.peak

    main_grads = MainGrads(optimizer)
    with main_grads:
        step(phase=phase)
    persistent = list(persistent_tensors(policy, reference, optimizer))
    base = storage_bytes(persistent)
    step_grads = storage_bytes(persistent + main_grads.grads) - base
    step_grads += main_grads.largest_converted
    return {
        **result,
        "persistent": base,
        **peaks,
        "step_grads": step_grads,
        "peak": base + max(peaks.values()),
    }


SETTINGS = {  # optimizer: its legal settings, (grad buffers in bf16, masters as remainders)
    "dense": ((False, False), (True, False)),
    "loggra": ((False, False), (True, False), (False, True), (True, True)),
    "backward": ((False, False), (True, False), (False, True), (True, True)),
}
"""``loggra``: ``--loggra-sketch gradient``; ``backward``: ``--loggra-sketch backward`` (its
targets have no grad buffer: the grad dtype applies to the dense rest)."""


ORDER = ("dense", "backward", "loggra")
"""``--optimizers``' default: dense Adam and the backward sketch (LoGRA's default) first."""


def setting_name(kind: str, bf16_grads: bool, remainders: bool) -> str:
    name = f"{'bf16' if bf16_grads else 'fp32'} grads"
    return name + (", remainders" if remainders else (", fp32 masters" if kind != "dense" else ""))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64, help="prompt + response tokens")
    ap.add_argument("--new-tokens", type=int, help="response tokens (default: seq/2)")
    ap.add_argument(
        "--rollout-rows",
        type=int,
        default=8,
        help="sequences sampled at once (the KV cache) and trained on",
    )
    ap.add_argument(
        "--num-generations",
        type=int,
        default=2,
        help="rollout rows that share a prompt (a GRPO group; it divides --rollout-rows)",
    )
    ap.add_argument(
        "--reference",
        choices=["both", "yes", "no"],
        default="both",
        help="settings with the frozen reference model resident, absent, or both",
    )
    ap.add_argument(
        "--loggra-fp32-grad-copy",
        action="store_true",
        help="ablation: let Megatron copy bf16 grads to fp32 for LoGRA too",
    )
    ap.add_argument(
        "--loggra-sketch-reduce",
        choices=SKETCH_REDUCTIONS,
        default="step",
        help="the backward sketch's DP reduce-scatter of S (as pretrain_rl.py's flag)",
    )
    ap.add_argument(
        "--optimizers",
        nargs="+",
        choices=list(SETTINGS),
        default=list(ORDER),
        help="the optimizers measured, in this order, each in all its settings (default: "
        "dense Adam, then the backward sketch, then the gradient sketch: the comparison that "
        "matters most first; every row is printed as it finishes)",
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--fp8",
        choices=["hybrid", "e4m3"],
        help="Transformer Engine FP8 (Hopper GPU with transformer_engine only)",
    )
    ap.add_argument("--timed-steps", type=int, default=2)
    ap.add_argument(
        "--log-prob-chunk-size", type=int, help="as pretrain_rl.py's flag (default: its default)"
    )
    ap.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    ap.add_argument(
        "--reference-offload",
        action="store_true",
        help="the reference's weights on the host, streamed per layer (as pretrain_rl.py's)",
    )
    args = ap.parse_args(argv)
    if args.fp8 and args.device != "cuda":
        ap.error("--fp8 needs --device cuda (a Hopper GPU with Transformer Engine)")
    args.new_tokens = args.new_tokens or args.seq // 2
    if not 0 < args.new_tokens < args.seq:
        ap.error(f"--new-tokens: must be in [1, --seq {args.seq})")
    if args.num_generations < 1 or args.rollout_rows % args.num_generations:
        ap.error(f"--num-generations: must divide --rollout-rows ({args.rollout_rows})")
    return args


def main() -> None:
    args = parse_args()
    from loggra_megatron.parallel import initialize_megatron

    initialize_megatron(device=args.device)
    gib = 2**30
    print(
        f"# memory_rl: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, vocab "
        f"{args.vocab}, rollout {args.rollout_rows} x ({args.seq - args.new_tokens} + {args.new_tokens})"
        f" tokens, micro-batch 1, bf16, LoGRA rank {args.hidden // 8}, "
        f"{f'FP8 {args.fp8}, ' if args.fp8 else ''}"
        f"{'LoGRA with fp32 grad copies, ' if args.loggra_fp32_grad_copy else ''}"
        f"{'reference offloaded, ' if args.reference_offload else ''}"
        f"{'S reduce-scattered per micro-batch, ' if args.loggra_sketch_reduce != 'step' else ''}"
        f"log-prob chunks of {args.log_prob_chunk_size or 'the default size'}, {args.device}",
        flush=True,
    )
    columns = [
        ("state", "optimizer state"),
        ("persistent", "persistent"),
        *((p, f"{p} phase") for p in PHASES),
        ("step_grads", "fp32 main grads"),
        ("peak", "**peak**"),
    ]
    if args.device == "cuda":
        columns = [("state", "optimizer state"), ("peak", "**peak**")]
    print(f"\n| optimizer | setting | reference | {' | '.join(n for _, n in columns)} | step (s) |")
    print("|---|---|---|" + "---:|" * (len(columns) + 1), flush=True)
    best, rows = {}, []
    references = {"both": (True, False), "yes": (True,), "no": (False,)}[args.reference]
    for with_reference in references:
        for kind in args.optimizers:
            for bf16_grads, remainders in SETTINGS[kind]:
                r = measure(kind, args, bf16_grads, with_reference, remainders)
                name = setting_name(kind, bf16_grads, remainders)
                rows.append({"optimizer": kind, "setting": name, "reference": with_reference, **r})
                cells = " | ".join(f"{r[key] / gib:.3f}" for key, _ in columns)
                print(
                    f"| {kind} | {name} | {'yes' if with_reference else 'no'} | {cells} | "
                    f"{r['step_s']:.3f} |",
                    flush=True,
                )
                key = (kind, with_reference)
                if key not in best or r["peak"] < best[key][1]["peak"]:
                    best[key] = (name, r)
    print(
        "\n| reference | LoGRA sketch | dense Adam's best (GiB) | LoGRA's best (GiB) | "
        "LoGRA / dense | saved |"
    )
    print("|---|---|---|---|---:|---:|")
    modes = {"backward": "backward", "loggra": "gradient"}
    for with_reference in references:
        for kind in args.optimizers:
            if kind not in modes or ("dense", with_reference) not in best:
                continue
            mode = modes[kind]
            (dn, d), (gn, g) = best[("dense", with_reference)], best[(kind, with_reference)]
            ratio = g["peak"] / d["peak"]
            print(
                f"| {'yes' if with_reference else 'no'} | {mode} | {d['peak'] / gib:.3f} ({dn}) "
                f"| {g['peak'] / gib:.3f} ({gn}) | {ratio:.3f} | {100 * (1 - ratio):.1f} % |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "measurements": rows}, f, indent=1)


if __name__ == "__main__":
    main()

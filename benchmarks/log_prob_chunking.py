"""Chunked log-probs vs the unchunked logits, side by side in one run: the memory a log-prob
forward and a training forward + backward add over the model's own (the output head's
transient), and the tokens/s of each.

    python benchmarks/log_prob_chunking.py                       # the 32k-vocabulary CPU shape
    python benchmarks/log_prob_chunking.py --device cuda --seq 2048 --hidden 2048 ...

*Unchunked* is the path before ``--log-prob-chunk-size``: the whole micro-batch's
``[b, s, V/TP]`` logits in the model's dtype, then the fp32 vocab-parallel log-softmax of
them (``model.vocab_parallel.vocab_parallel_log_probs``). *Chunked* is
``model.output_head`` at ``--log-prob-chunk-size``. The transient is the peak of the phase
above what was allocated before it (CPU: the allocator's events, ``memory_rl.AllocationPeak``;
GPU: ``torch.cuda.max_memory_allocated``). Results: docs/memory.md#chunked-log-probs.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from loggra_megatron.model.config import log_prob_chunk_tokens


def build(args):
    from loggra_megatron.testing import tiny_gpt_model

    torch.manual_seed(0)
    model = tiny_gpt_model(
        num_layers=args.layers,
        hidden_size=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        ffn_hidden_size=args.ffn,
        bf16=True,
        log_prob_chunk_size=args.log_prob_chunk_size,
    )
    return model.to(args.device)


def log_probs(out, chunked: bool) -> torch.Tensor:
    """``[b, s]`` log-probs of a micro-batch's ``LastHidden``, chunked or unchunked."""
    from loggra_megatron.model.vocab_parallel import vocab_parallel_log_probs

    if chunked:
        return out.log_probs()
    return vocab_parallel_log_probs(out.logits(), out.targets(), out.tp_group)


def forward_only(model, tokens, chunked: bool):
    """The old/reference log-prob phase: one row per micro-batch, no grad."""
    from loggra_megatron.model.forward import forward_map

    micro = [{"tokens": tokens[i : i + 1]} for i in range(len(tokens))]
    return forward_map(model, micro, lambda b, out: log_probs(out, chunked))


def training(model, tokens, chunked: bool):
    """Forward + backward of a token-mean NLL, one row per micro-batch (the grads exist)."""
    from loggra_megatron.model.forward import gpt_forward, last_hidden

    for i in range(len(tokens)):
        batch = {"tokens": tokens[i : i + 1]}
        out = last_hidden(model, batch, gpt_forward(model, batch))
        (-log_probs(out, chunked).mean()).backward()


def peak_of(fn, device: str) -> int:
    """Bytes the call adds at its peak over what was allocated before it."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from memory_rl import AllocationPeak

    with AllocationPeak() as allocated:
        fn()
    return allocated.peak


def seconds(fn, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=8, help="sequences (one per micro-batch)")
    ap.add_argument("--log-prob-chunk-size", type=int, help="default: pretrain_rl.py's default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return ap.parse_args(argv)


def measure(args) -> dict[str, dict[str, float]]:
    """``{phase/chunked|unchunked: {transient_bytes, tokens_per_s}}`` (Megatron initialized)."""
    model = build(args)
    for p in model.parameters():  # the grads exist before the phases: not a transient
        p.grad = torch.zeros_like(p)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.rows, args.seq + 1), generator=gen)
    tokens = tokens.to(args.device)
    phases = {"log_probs": forward_only, "training": training}
    results = {}
    for phase, fn in phases.items():
        for chunked in (False, True):
            call = lambda fn=fn, chunked=chunked: fn(model, tokens, chunked)  # noqa: E731
            call()  # warm-up
            name = "chunked" if chunked else "unchunked"
            results[f"{phase}/{name}"] = {
                "transient_bytes": peak_of(call, args.device),
                "tokens_per_s": args.rows * args.seq / seconds(call, args.device, args.repeats),
            }
    return results


def main() -> None:
    args = parse_args()
    from loggra_megatron.parallel import initialize_megatron

    initialize_megatron(device=args.device)
    results = measure(args)
    phases = ("log_probs", "training")
    mib = 2**20
    print(
        f"# log_prob_chunking: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
        f"{args.rows} rows x {args.seq} tokens (1 row per micro-batch), bf16, chunk "
        f"{log_prob_chunk_tokens(args.log_prob_chunk_size, args.vocab)} tokens, {args.device}\n"
    )
    print("| phase | unchunked (MiB) | chunked (MiB) | chunked / unchunked | tokens/s ratio |")
    print("|---|---:|---:|---:|---:|")
    for phase in phases:
        u, c = results[f"{phase}/unchunked"], results[f"{phase}/chunked"]
        print(
            f"| {phase} | {u['transient_bytes'] / mib:.1f} | {c['transient_bytes'] / mib:.1f} | "
            f"{c['transient_bytes'] / u['transient_bytes']:.3f} | "
            f"{c['tokens_per_s'] / u['tokens_per_s']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

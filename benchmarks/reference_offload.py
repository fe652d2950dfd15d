"""One reference log-prob pass of a frozen model, resident vs ``--reference-offload``
(``loggra_megatron/model/offload.py``): the device bytes its weights hold outside and during
the pass, and the time ratio.

    python benchmarks/reference_offload.py                  # CPU: the device is the host
    python benchmarks/reference_offload.py --device cuda    # GPU: pinned host, copy stream

The pass is ``compute_log_probs`` of ``--rows`` sequences of ``--seq-length`` tokens in
micro-batches of ``--micro-batch-size`` (each micro-batch one forward, so the offloaded
model copies all its weights host → device once per micro-batch). Device bytes of the
weights: the resident model's parameter storages; the offloaded model's
``HostOffload.device_bytes()`` (installed and prefetched units), read outside the pass
(after ``release_device_weights``, as the trainer does) and at the start of every leaf
module inside it (the most seen is printed). On CUDA also the allocator's peak during the
pass above its start (weights, activations, logits chunks). Time: the median over
``--repeats`` passes of each model, alternating, after one warm-up pass each. On CPU a "copy" is a memory copy, so the ratio
prices the mechanism (hooks, copies, allocation), not a PCIe transfer; the time of one copy
of all the weights, alone, is printed as well (on CUDA: the host link's cost per forward
that the prefetch has to hide).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--bf16", action="store_true", help="bf16 weights (Float16Module)")
    ap.add_argument("--repeats", type=int, default=3)
    return ap.parse_args(argv)


def build_reference(args: argparse.Namespace):
    """A frozen GPTModel of the benchmark's shape (Megatron-Core's local spec)."""
    from megatron.core.transformer.module import Float16Module

    from loggra_megatron.model.args import GPTModelArgs
    from loggra_megatron.model.build import build_gpt_model

    shape = GPTModelArgs(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        make_vocab_size_divisible_by=1,
        max_position_embeddings=args.seq_length,
        params_dtype="bfloat16" if args.bf16 else "float32",
    )
    model = build_gpt_model(shape, use_cpu_initialization=args.device == "cpu")
    if args.bf16:
        model = Float16Module(model.config, model)
    return model.eval().requires_grad_(False)


def weight_bytes(model, offload) -> int:
    """Device bytes the model's weights hold now."""
    if offload is not None:
        return offload.device_bytes()
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


class Pass:
    """Timed reference log-prob passes of one model, recording the device bytes its weights
    hold at the start of every leaf module (and, on CUDA, the allocator's peak above the
    pass's start)."""

    def __init__(self, model, offload, tokens, args: argparse.Namespace):
        from megatron.core.utils import unwrap_model

        self.model, self.offload, self.tokens, self.args = model, offload, tokens, args
        self.during, self.times, self.peaks = [], [], []
        for leaf in unwrap_model(model).modules():
            if not list(leaf.children()):
                leaf.register_forward_pre_hook(lambda m, a: self.during.append(self.bytes()))

    def bytes(self) -> int:
        return weight_bytes(self.model, self.offload)

    def run(self) -> None:
        from loggra_megatron.model.log_probs import compute_log_probs
        from loggra_megatron.model.offload import release_device_weights

        cuda = self.args.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        compute_log_probs(self.model, self.tokens, micro_batch_size=self.args.micro_batch_size)
        release_device_weights(self.model)  # as the trainer does after the experience
        if cuda:
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated() - base)
        self.times.append(time.perf_counter() - start)


def copy_time(offloaded, device, repeats: int) -> float:
    """Median seconds of copying all the offloaded model's host copies (what its
    ``state_dict`` returns) to ``device`` alone: the cost a pass hides behind compute."""
    hosts = [t for t in offloaded.state_dict().values() if isinstance(t, torch.Tensor)]
    times = []
    for _ in range(repeats + 1):  # the first: warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        copies = [t.to(device, non_blocking=True, copy=True) for t in hosts]
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del copies
    return statistics.median(times[1:])


def main() -> None:
    args = parse_args()
    from loggra_megatron.model.offload import offload_to_host
    from loggra_megatron.parallel import initialize_megatron

    device = initialize_megatron(device=args.device)
    resident = build_reference(args)
    offloaded = build_reference(args)
    offloaded.load_state_dict(resident.state_dict())
    offload = offload_to_host(offloaded, device)
    tokens = torch.randint(
        0, args.vocab, (args.rows, args.seq_length), generator=torch.Generator().manual_seed(0)
    )
    mib = 2**20
    units = offload.unit_bytes()
    total = sum(units.values())
    forwards = -(-args.rows // args.micro_batch_size)
    print(
        f"# reference_offload: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
        f"vocab {args.vocab}, {'bf16' if args.bf16 else 'fp32'} on {device}; {args.rows} rows "
        f"x {args.seq_length} tokens, micro-batch {args.micro_batch_size} "
        f"({forwards} forwards), median of {args.repeats}"
    )
    print(
        f"weights {total / mib:.2f} MiB in {len(units)} units, largest "
        f"{max(units.values()) / mib:.2f} MiB ({max(units, key=units.get)})"
    )
    passes = {
        "resident": Pass(resident, None, tokens, args),
        "offloaded": Pass(offloaded, offload, tokens, args),
    }
    for p in passes.values():  # warm-up
        p.run()
        p.times.clear()
        p.peaks.clear()
    for _ in range(args.repeats):  # alternating: a load change on the machine hits both
        for p in passes.values():
            p.run()
    for name, p in passes.items():
        peak = f", allocator peak above start {max(p.peaks) / mib:.2f} MiB" if p.peaks else ""
        print(
            f"{name:9s} device bytes of the weights outside / during the pass: "
            f"{p.bytes() / mib:.2f} / {max(p.during) / mib:.2f} MiB{peak}; pass "
            f"{statistics.median(p.times) * 1e3:.1f} ms"
        )
    copy = copy_time(offloaded, device, args.repeats)
    print(
        f"copied host -> device per offloaded pass: {forwards} x {total / mib:.2f} MiB; "
        f"one copy of all the weights alone: {copy * 1e3:.1f} ms"
    )
    ratio = statistics.median(passes["offloaded"].times) / statistics.median(
        passes["resident"].times
    )
    print(f"time ratio offloaded / resident (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()

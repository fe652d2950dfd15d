"""Milliseconds per decode step of the static engine against the memory-bandwidth floor.

    python benchmarks/decode_step.py                                  # CPU, a small model
    python benchmarks/decode_step.py --device cuda --bf16 --layers 20 --hidden 2048 \\
        --ffn 5632 --heads 16 --groups 4 --vocab 32000 --batches 8 64   # h200_check's decode

A decode step reads every weight of the model once and the KV cache of every row up to its
position, so its time is bounded below by ``(weight bytes + KV bytes read) / bandwidth``
(``--bandwidth-gbs``: an H200's HBM3e 4800 GB/s by default; 3350 for an H100 SXM). For each
batch size the static engine (``rollout/static/generate.py``) generates ``--new-tokens`` tokens after
prompts of ``--prompt-tokens``, twice: with its decode steps in CUDA graphs (on CPU the graph
stand-in, the same static buffers run eagerly) and eagerly (``cuda_graphs=False``), from the
same prompts and seed. The decode steps are timed after the prefill (one device sync before,
one after) less the steps that captured a graph (each width's first: warm-up and capture,
timed apart as "capture ms"). Printed: ms per decode step in both arms and their ratio, the
floor and the ratio to it, generated tokens/s, the forwards and host syncs of the loop, the KV
cache's bytes *measured* on the decoder's buffers beside the formula
(``rollout.static.chunking.kv_cache_bytes``), whether both arms sampled the same tokens, and the aten
ops per decode-loop forward of a profiled rollout: all of them, and those a GPU still launches
from the host when the step is a graph (outside the replays, plus one per replay). Each batch
size's row is printed (and ``--json`` rewritten) as soon as it is measured, so a run stopped
by a timeout keeps the rows it finished.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from loggra_megatron.rollout.static import generate


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 weights (Float16Module)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, help="default: 4 × hidden")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, help="KV groups (GQA; default: heads)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="memory GB/s")
    ap.add_argument("--json", help="also write the results here")
    return ap.parse_args(argv)


class _Recorder:
    """Wraps the static engine's decoder (``rollout/static/decoder.py``): the time after the prefill
    (at its first decode step, after a device sync), the time spent capturing step graphs
    (each width's first step: warm-up and capture), and the decoders made (their KV
    buffers)."""

    def __init__(self, device: torch.device):
        self.device, self.decoder_class = device, generate.StaticDecoder
        self.after_prefill, self.capture_s, self.captures, self.decoders = None, 0.0, 0, []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        recorder = self

        class Decoder(self.decoder_class):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                recorder.decoders.append(self)

            def decode(self, *a, **kw):
                if recorder.after_prefill is None:
                    recorder._sync()
                    recorder.after_prefill = time.perf_counter()
                before = self.graphs.captures if self.graphs else 0
                t0 = time.perf_counter()
                out = super().decode(*a, **kw)
                if self.graphs and self.graphs.captures > before:
                    recorder._sync()
                    recorder.capture_s += time.perf_counter() - t0
                    recorder.captures += 1
                return out

        generate.StaticDecoder = Decoder
        return self

    def __exit__(self, *exc):
        generate.StaticDecoder = self.decoder_class

    def kv_bytes(self) -> int:
        """Bytes of the KV buffers the last rollout's decoder allocated."""
        return self.decoders[-1].kv_bytes()


def _one(model, prompts, args, device, cuda_graphs: bool) -> dict:
    from loggra_megatron.rollout import RolloutRequest, generate_rollout

    with _Recorder(device) as rec:
        rollout = generate_rollout(
            model,
            prompts,
            RolloutRequest(
                max_new_tokens=args.new_tokens, temperature=1.0, seed=1, cuda_graphs=cuda_graphs
            ),
        )
        rec._sync()
        end = time.perf_counter()
    steps = rollout.decode_steps - 1  # after the prefill
    replayed = max(steps - rec.captures, 1)
    return {
        "ms_per_step": 1e3 * (end - rec.after_prefill - rec.capture_s) / replayed,
        "capture_ms": 1e3 * rec.capture_s,
        "steps": rollout.decode_steps,
        "host_syncs_per_step": rollout.host_syncs / rollout.decode_steps,
        "generated": int(rollout.response_lengths.sum()),
        "kv_bytes": rec.kv_bytes(),
        "tokens": rollout.tokens,
    }


def _ops_per_step(model, prompts, args) -> tuple[float, float]:
    """aten ops per decode-loop forward in a profiled rollout: all of them (as eager steps
    dispatch them), and those a GPU still dispatches from the host when the step is a graph
    (the ops outside the step-graph replays; a replay counts one)."""
    from loggra_megatron.rollout import RolloutRequest, generate_rollout
    from loggra_megatron.rollout.static.step_graph import GRAPH_RANGE

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rollout = generate_rollout(
            model, prompts, RolloutRequest(max_new_tokens=args.new_tokens, seed=1)
        )
    events = prof.events()
    inside = set()
    for e in events:
        if e.name == GRAPH_RANGE:
            inside.update(id(c) for c in _descendants(e))
    ops = [e for e in events if e.name.startswith("aten::")]
    replays = sum(1 for e in events if e.name == GRAPH_RANGE)
    host = sum(1 for e in ops if id(e) not in inside) + replays
    return len(ops) / rollout.decode_steps, host / rollout.decode_steps


def _descendants(event):
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def measure(args, device: torch.device) -> list[dict]:
    """One row per ``--batches`` entry (Megatron initialised on ``device``)."""
    return list(measure_rows(args, device))


def measure_rows(args, device: torch.device):
    """Yields the row of each ``--batches`` entry as soon as it is measured (Megatron
    initialised on ``device``), so that a caller can print it before the next one runs."""
    from loggra_megatron.rollout.static.chunking import kv_cache_bytes
    from loggra_megatron.testing import tiny_gpt_model

    seq = args.prompt_tokens + args.new_tokens
    model = tiny_gpt_model(
        args.layers,
        args.hidden,
        args.heads,
        args.vocab,
        seq,
        query_groups=args.groups,
        ffn_hidden_size=args.ffn or 4 * args.hidden,
        bf16=args.bf16,
    ).to(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token_kv = kv_cache_bytes(model, 1, 1)
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, args.vocab, (batch, args.prompt_tokens), generator=gen)
        prompts = prompts.to(device)
        arms = {}
        for graphs in (True, False):  # step graphs (the stand-in on CPU), then eager
            _one(model, prompts, args, device, graphs)  # warm-up
            arms[graphs] = [_one(model, prompts, args, device, graphs) for _ in range(args.repeats)]
        ms = statistics.median(r["ms_per_step"] for r in arms[True])
        eager_ms = statistics.median(r["ms_per_step"] for r in arms[False])
        mean_len = args.prompt_tokens + args.new_tokens / 2  # KV read per step, on average
        floor_bytes = weight_bytes + batch * mean_len * per_token_kv
        floor_ms = 1e3 * floor_bytes / (args.bandwidth_gbs * 1e9)
        first = arms[True][0]
        ops, host_ops = _ops_per_step(model, prompts, args)
        yield {
            "batch": batch,
            "ms_per_step": ms,
            "eager_ms_per_step": eager_ms,
            "capture_ms": statistics.median(r["capture_ms"] for r in arms[True]),
            "floor_ms": floor_ms,
            "over_floor": ms / floor_ms,
            "tokens_per_s": batch / (ms / 1e3),
            "steps": first["steps"],
            "host_syncs_per_step": first["host_syncs_per_step"],
            "kv_bytes_measured": first["kv_bytes"],
            "kv_bytes_formula": kv_cache_bytes(model, batch, seq),
            "same_tokens": torch.equal(first["tokens"], arms[False][0]["tokens"]),
            "ops_per_step": ops,
            "host_ops_per_step": host_ops,
        }


def format_row(r: dict) -> str:
    return (
        f"| {r['batch']} | {r['ms_per_step']:.3f} | {r['eager_ms_per_step']:.3f} | "
        f"{r['eager_ms_per_step'] / r['ms_per_step']:.2f} | {r['capture_ms']:.1f} | "
        f"{r['floor_ms']:.4f} | {r['over_floor']:.1f} | {r['tokens_per_s']:.0f} | "
        f"{r['steps']} | {r['host_syncs_per_step']:.3f} | {r['kv_bytes_measured']} | "
        f"{r['kv_bytes_formula']} | {r['same_tokens']} | {r['ops_per_step']:.0f} | "
        f"{r['host_ops_per_step']:.0f} |"
    )


def main() -> None:
    from loggra_megatron.parallel import initialize_megatron

    args = parse_args()
    print(
        f"decode steps of the static engine: {args.layers} layers, hidden {args.hidden}, "
        f"{'bf16' if args.bf16 else 'fp32'}, {args.device}, prompts of {args.prompt_tokens} "
        f"+ {args.new_tokens} new tokens; floor at {args.bandwidth_gbs:g} GB/s; medians of "
        f"{args.repeats}",
        flush=True,
    )
    device = initialize_megatron(device=args.device)
    # the table's head first, then each batch size's row as soon as it is measured: a run
    # stopped by a timeout keeps the rows it finished
    print(
        "\n| batch | ms / step | eager ms / step | eager / graphs | capture ms | floor ms "
        "| × floor | tokens/s | forwards | host syncs / step | KV bytes measured "
        "| KV bytes formula | same tokens | aten ops / step | host-launched with graphs |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|", flush=True)
    rows = []
    for r in measure_rows(args, device):
        rows.append(r)
        print(format_row(r), flush=True)
        if args.json:  # rewritten after each row, for the same reason
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Milliseconds per decode step of the static engine against the memory-bandwidth floor.

    python benchmarks/decode_step.py                                  # CPU, a small model
    python benchmarks/decode_step.py --device cuda --bf16 --layers 20 --hidden 2048 \\
        --ffn 5632 --heads 16 --groups 4 --vocab 32000 --batches 8 64   # h200_check's decode

A decode step reads every weight of the model once and the KV cache of every row up to its
position, so its time is bounded below by ``(weight bytes + KV bytes read) / bandwidth``
(``--bandwidth-gbs``: an H200's HBM3e 4800 GB/s by default; 3350 for an H100 SXM). For each
batch size the static engine (``rollout/generate.py``) generates ``--new-tokens`` tokens after
prompts of ``--prompt-tokens``; the decode steps are timed after the prefill (one device sync
before, one after), and printed are: ms per decode step, the floor, their ratio, generated
tokens/s, the forwards and host syncs of the loop, and the KV cache's bytes *measured* on the
engine's buffers (Megatron's ``StaticInferenceContext``) beside the formula
(``rollout.engine.kv_cache_bytes``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


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
    """Wraps the decode loop's stage forward and Megatron's static context: the time after
    the prefill, and the context (its KV buffers)."""

    def __init__(self, device: torch.device):
        from megatron.core.inference.contexts import static_context

        from loggra_megatron.rollout import generate

        self.device, self.generate, self.static_context = device, generate, static_context
        self.forward, self.context_class = (
            generate._stage_forward,
            static_context.StaticInferenceContext,
        )
        self.after_prefill, self.contexts = None, []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        recorder = self

        def forward(*a, **kw):
            out = recorder.forward(*a, **kw)
            if recorder.after_prefill is None:
                recorder._sync()
                recorder.after_prefill = time.perf_counter()
            return out

        class Context(self.context_class):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                recorder.contexts.append(self)

        self.generate._stage_forward = forward
        self.static_context.StaticInferenceContext = Context
        return self

    def __exit__(self, *exc):
        self.generate._stage_forward = self.forward
        self.static_context.StaticInferenceContext = self.context_class

    def kv_bytes(self) -> int:
        """Bytes of the KV buffers the last rollout's context allocated."""
        memory = self.contexts[-1].key_value_memory_dict
        return sum(t.untyped_storage().nbytes() for kv in memory.values() for t in kv)


def _one(model, prompts, args, device) -> dict:
    from loggra_megatron.rollout import generate_rollout

    with _Recorder(device) as rec:
        rollout = generate_rollout(
            model, prompts, max_new_tokens=args.new_tokens, temperature=1.0, seed=1
        )
        rec._sync()
        end = time.perf_counter()
    steps = rollout.decode_steps - 1  # after the prefill
    return {
        "ms_per_step": 1e3 * (end - rec.after_prefill) / max(steps, 1),
        "steps": rollout.decode_steps,
        "host_syncs_per_step": rollout.host_syncs / rollout.decode_steps,
        "generated": int(rollout.response_lengths.sum()),
        "kv_bytes": rec.kv_bytes(),
    }


def measure(args, device: torch.device) -> list[dict]:
    """One row per ``--batches`` entry (Megatron initialised on ``device``)."""
    from loggra_megatron.rollout.engine import kv_cache_bytes
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
    rows = []
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, args.vocab, (batch, args.prompt_tokens), generator=gen)
        _one(model, prompts.to(device), args, device)  # warm-up
        runs = [_one(model, prompts.to(device), args, device) for _ in range(args.repeats)]
        ms = statistics.median(r["ms_per_step"] for r in runs)
        mean_len = args.prompt_tokens + args.new_tokens / 2  # KV read per step, on average
        floor_bytes = weight_bytes + batch * mean_len * per_token_kv
        floor_ms = 1e3 * floor_bytes / (args.bandwidth_gbs * 1e9)
        rows.append(
            {
                "batch": batch,
                "ms_per_step": ms,
                "floor_ms": floor_ms,
                "over_floor": ms / floor_ms,
                "tokens_per_s": batch / (ms / 1e3),
                "steps": runs[0]["steps"],
                "host_syncs_per_step": runs[0]["host_syncs_per_step"],
                "kv_bytes_measured": runs[0]["kv_bytes"],
                "kv_bytes_formula": kv_cache_bytes(model, batch, seq),
            }
        )
    return rows


def main() -> None:
    from loggra_megatron.parallel import initialize_megatron

    args = parse_args()
    print(
        f"decode steps of the static engine: {args.layers} layers, hidden {args.hidden}, "
        f"{'bf16' if args.bf16 else 'fp32'}, {args.device}, prompts of {args.prompt_tokens} "
        f"+ {args.new_tokens} new tokens; floor at {args.bandwidth_gbs:g} GB/s; medians of "
        f"{args.repeats}"
    )
    rows = measure(args, initialize_megatron(device=args.device))
    print(
        "\n| batch | ms / step | floor ms | × floor | tokens/s | forwards | host syncs / step "
        "| KV bytes measured | KV bytes formula |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['ms_per_step']:.3f} | {r['floor_ms']:.4f} | "
            f"{r['over_floor']:.1f} | {r['tokens_per_s']:.0f} | {r['steps']} | "
            f"{r['host_syncs_per_step']:.3f} | {r['kv_bytes_measured']} | "
            f"{r['kv_bytes_formula']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

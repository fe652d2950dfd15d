"""Rollout generation on CPU: the old whole-batch KV-cached loop vs the bounded chunked one.

    python benchmarks/bench_rollout.py --model tiny           # 4 layers, hidden 128
    python benchmarks/bench_rollout.py --model h512           # 8 layers, hidden 512
    python benchmarks/bench_rollout.py --model h512 --bf16 --json runs/bench_rollout.json

Issue 14: the rollout KV cache must be bounded by a flag (``--inference-max-tokens``).
The same rollout batch is generated three ways (all in one run of this script):

* **old**: :func:`~loggra_megatron.rollout.generate.generate_rollout` on the whole batch, a
  static KV cache of ``rows × (longest prompt + max_new_tokens)`` tokens;
* **new 1/k**: :func:`~loggra_megatron.rollout.engine.generate_chunked` with
  ``max_tokens`` = 1/k of the whole batch's KV tokens (``--fractions``, default 1/4 and 1/16),
  i.e. chunks of ``rows / k`` rows generated one after another.

The batch is like one rank's share of the RL loop's rollout (the tiny example generates
16 prompts × 8 = 128 rows on 2 ranks: 64 per rank): ``--rows`` prompts of random tokens,
lengths uniform in ``[--prompt-min, --prompt-max]`` (seeded), a randomly initialised
Llama-style Megatron GPT (local spec, as the trainer builds it on CPU, fp32 or ``--bf16``
in Megatron's ``Float16Module``), single process. No stop token by default, so every row
generates exactly ``--max-new-tokens`` tokens (the worst case, and the same work for every
variant); ``--stop-id ID`` adds one. Each variant is measured at temperature 1 (sampling,
seeded) and greedy (``--modes``).

Each (mode, variant) runs in a fresh subprocess (this script with ``--worker``): build the
model, warm it up on a tiny batch (2 rows, 2 new tokens), ``gc.collect()`` and
``malloc_trim(0)`` (freed heap pages back to the OS, so that the generation cannot hide in
them), reset the peak RSS (``/proc/self/clear_refs``; where that is impossible the
process's ``ru_maxrss`` is used, which also covers the model build), read the RSS, then
generate the batch ``--repeats`` times. Reported:

* **tokens/s**: generated tokens / wall seconds, the median over the repeats (the first
  repeat is the batch's first run, page faults included) and the best repeat (less
  sensitive to other processes on a shared machine);
* **KV cache**: the static cache's bytes (``kv_bytes`` of ``generate_chunked``: the largest
  chunk's; ``kv_cache_bytes`` of the whole batch for the old loop);
* **peak memory**: the peak RSS during generation minus the RSS right before it, so the
  generation's own peak (KV cache, activations, logits, the rollout itself), not the model.
  With ``--bf16`` it also counts what oneDNN keeps per matmul shape (every decode step's
  attention has a new shape): ``--no-onednn`` turns oneDNN off (slower bf16 matmuls).

Ratios are against the old loop of the same run and mode. Greedy tokens of every chunked
variant are compared with the old loop's (they must be identical; log-probs to round-off).
The JSON also has every repeat's wall and CPU seconds and the load average before and
after each worker (other processes on the machine slow single repeats down).

Models (random init, ``ModelConfig`` defaults otherwise: tied embeddings, SwiGLU FFN of
8/3·hidden rounded up to 64, RoPE, RMSNorm; ``seq_length`` at least prompt + response):

* ``--model tiny``: ``examples/tiny_cpu/run.sh``'s policy: 4 layers, hidden 128, 4 heads,
  FFN 384, vocab 256 (its tokenizer); default prompts 16..64 tokens, 64 new tokens;
* ``--model h512``: 8 layers, hidden 512, 8 heads, FFN 1408, vocab 8192; default prompts
  16..32 tokens, 32 new tokens.

Both with 64 rows, sizes chosen so that a run (2 modes × 3 variants × warm-up + 3 repeats,
six interpreter starts) takes a few minutes on 2 CPU cores: measured about RUNTIME_TINY
(tiny) and RUNTIME_H512 (h512, fp32). The 1/16 budget runs 16 chunks one after another,
each a full decode loop: on CPU its time is mostly per-step overhead, not arithmetic.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {  # shape, seq_length of its example, default prompt lengths and new tokens
    "tiny": dict(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        vocab=256,
        seq=64,
        prompts=(16, 64),
        new=64,
    ),
    "h512": dict(
        num_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        vocab=8192,
        seq=256,
        prompts=(16, 32),
        new=32,
    ),
}
MODES = {"sample": 1.0, "greedy": 0.0}
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--bf16", action="store_true", help="bf16 weights (Float16Module)")
    ap.add_argument("--rows", type=int, default=64, help="prompts in the rollout batch")
    ap.add_argument("--prompt-min", type=int, help="default: 16")
    ap.add_argument("--prompt-max", type=int, help="default: 64 (tiny), 32 (h512)")
    ap.add_argument("--max-new-tokens", type=int, help="default: 64 (tiny), 32 (h512)")
    ap.add_argument(
        "--fractions",
        default="4,16",
        help="KV budgets of the new loop, as 1/k of the whole batch's KV tokens",
    )
    ap.add_argument("--modes", default="sample,greedy", help=f"of {', '.join(MODES)}")
    ap.add_argument("--stop-id", type=int, help="a stop token id (default: none)")
    ap.add_argument(
        "--no-onednn",
        action="store_true",
        help="torch.backends.mkldnn off: with --bf16, oneDNN keeps per-shape "
        "matmul state that the RSS peak would count",
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed generations per variant")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one measurement
    args = ap.parse_args(argv)
    spec = MODELS[args.model]
    if args.prompt_min is None:
        args.prompt_min = spec["prompts"][0]
    if args.prompt_max is None:
        args.prompt_max = max(args.prompt_min, spec["prompts"][1])
    if args.max_new_tokens is None:
        args.max_new_tokens = spec["new"]
    args.fractions = [int(k) for k in str(args.fractions).split(",") if k]
    args.modes = [m for m in str(args.modes).split(",") if m]
    if any(m not in MODES for m in args.modes) or any(k < 1 for k in args.fractions):
        ap.error("--modes: sample and/or greedy; --fractions: integers >= 1")
    if not 1 <= args.prompt_min <= args.prompt_max or args.rows < 1 or args.repeats < 1:
        ap.error("need 1 <= --prompt-min <= --prompt-max, --rows >= 1, --repeats >= 1")
    return args


# ---------------------------------------------------------------- worker (one subprocess)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS (VmHWM) of this process; False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmHWM") is not None
    except OSError:
        return False


def _rss() -> int:
    kib = _status_kib("VmRSS")
    return 1024 * (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _peak_rss(hwm_reset: bool) -> int:
    kib = _status_kib("VmHWM") if hwm_reset else None
    return 1024 * (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _trim_heap() -> None:
    """Return the heap's free memory to the OS (glibc ``malloc_trim``), so that the
    generation's allocations show in the RSS instead of reusing pages freed earlier."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def build_model(args):
    """The model of ``--model``, as the trainer builds it on CPU (``pretrain_rl.py``)."""
    import torch
    from megatron.core.transformer.module import Float16Module

    from loggra_megatron.model.build import build_gpt_model
    from loggra_megatron.model.config import ModelConfig

    spec = MODELS[args.model]
    seq = max(spec["seq"], args.prompt_max + args.max_new_tokens)
    cfg = ModelConfig(
        num_layers=spec["num_layers"],
        hidden_size=spec["hidden_size"],
        num_attention_heads=spec["num_attention_heads"],
        seq_length=seq,
        bf16=args.bf16,
    )
    torch.manual_seed(args.seed)
    model = build_gpt_model(cfg.model_args(spec["vocab"]), use_cpu_initialization=True)
    if args.bf16:
        model = Float16Module(model.config, model)
    return model.eval().requires_grad_(False), cfg


def make_prompts(args, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.rows,), generator=gen)
    return [torch.randint(1, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def run_worker(args) -> None:
    """One (mode, variant): build, warm up, then time and measure ``--repeats`` rollouts."""
    import torch

    spec = json.loads(args.worker)
    torch.set_num_threads(args.threads)
    if args.no_onednn:
        torch.backends.mkldnn.enabled = False
    load_before = os.getloadavg()[0]
    from loggra_megatron.parallel import initialize_megatron
    from loggra_megatron.rollout import generate_rollout
    from loggra_megatron.rollout.engine import chunk_rows, generate_chunked, kv_cache_bytes

    initialize_megatron(seed=args.seed, device="cpu")
    model, _ = build_model(args)
    vocab = MODELS[args.model]["vocab"]
    prompts = make_prompts(args, vocab)
    sampling = dict(
        temperature=MODES[spec["mode"]],
        eos_id=args.stop_id,
        pad_id=0,
        seed=args.seed,
        vocab_size=vocab,
    )
    new, budget = args.max_new_tokens, spec["max_tokens"]
    width = max(map(len, prompts)) + new

    def generate(batch, max_new_tokens):
        if budget is None:  # the old loop: one static batch of every row
            rollout = generate_rollout(model, batch, max_new_tokens=max_new_tokens, **sampling)
            return rollout, kv_cache_bytes(model, len(batch), max(map(len, batch)) + max_new_tokens)
        return generate_chunked(
            model, batch, max_new_tokens=max_new_tokens, max_tokens=budget, **sampling
        )

    generate(prompts[:2], 2)  # warm-up on a tiny batch
    gc.collect()
    _trim_heap()
    hwm_reset = _reset_peak_rss()
    rss_before = _rss()  # after the reset: the peak can only be above it
    times, cpu_times, first = [], [], None
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), _cpu_seconds()
        rollout, kv_bytes = generate(prompts, new)
        times.append(time.perf_counter() - t0)
        cpu_times.append(_cpu_seconds() - c0)
        first = first or rollout
        tokens = int(rollout.response_lengths.sum())
        del rollout
    peak = _peak_rss(hwm_reset) - rss_before
    seconds = statistics.median(times)
    torch.save(
        {
            "tokens": first.tokens,
            "log_probs": first.log_probs,
            "response_mask": first.response_mask,
        },
        spec["tokens_path"],
    )
    result = dict(
        mode=spec["mode"],
        variant=spec["variant"],
        max_tokens=budget,
        rows_per_chunk=chunk_rows(len(prompts), width, budget),
        generated_tokens=tokens,
        seconds=times,
        median_seconds=seconds,
        tokens_per_s=tokens / seconds,
        best_tokens_per_s=tokens / min(times),
        cpu_seconds=cpu_times,
        median_cpu_seconds=statistics.median(cpu_times),
        kv_bytes=kv_bytes,
        peak_bytes=peak,
        rss_before_bytes=rss_before,
        peak_method="VmHWM reset" if hwm_reset else "ru_maxrss",
        load_before=load_before,
        load_after=os.getloadavg()[0],
    )
    with open(spec["out"], "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------- driver


def worker_env() -> dict:
    """This process's environment without a torchrun world (the worker is one process)."""
    skip = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in skip}


def measure(argv: list[str], spec: dict, tmp: str) -> dict:
    name = f"{spec['mode']}_{spec['variant'].replace('/', '_')}"
    spec = {
        **spec,
        "out": os.path.join(tmp, name + ".json"),
        "tokens_path": os.path.join(tmp, name + ".pt"),
    }
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", json.dumps(spec)]
    done = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"worker {name} failed:\n{done.stderr[-4000:]}")
    with open(spec["out"]) as f:
        return {**json.load(f), "tokens_path": spec["tokens_path"]}


def compare_tokens(result: dict, old: dict) -> dict:
    """Whether a variant's rollout equals the old loop's (tokens, masks; log-prob gap)."""
    import torch

    a = torch.load(result["tokens_path"], weights_only=True)
    b = torch.load(old["tokens_path"], weights_only=True)
    same = a["tokens"].shape == b["tokens"].shape and torch.equal(a["tokens"], b["tokens"])
    same = same and torch.equal(a["response_mask"], b["response_mask"])
    gap = (a["log_probs"] - b["log_probs"]).abs().max().item() if same else None
    return {"tokens_identical_to_old": bool(same), "log_prob_max_abs_diff": gap}


def header(args) -> str:
    spec = MODELS[args.model]
    return (
        f"# bench_rollout: {args.model} ({spec['num_layers']} layers, hidden "
        f"{spec['hidden_size']}, {spec['num_attention_heads']} heads, vocab {spec['vocab']}), "
        f"{'bf16' if args.bf16 else 'fp32'}, {args.rows} rows, prompts "
        f"{args.prompt_min}..{args.prompt_max}, {args.max_new_tokens} new tokens, stop id "
        f"{args.stop_id}, {args.repeats} repeats, {args.threads} threads"
        f"{', oneDNN off' if args.no_onednn else ''}"
    )


def print_table(args, results: list[dict]) -> None:
    print(header(args))
    print(
        "\n| mode | variant | KV budget (tokens) | rows / chunk | KV cache (MiB) | "
        "peak gen. memory (MiB) | peak / old | tokens/s | tokens/s / old | best tokens/s "
        "| best / old |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        budget = "–" if r["max_tokens"] is None else r["max_tokens"]
        print(
            f"| {r['mode']} | {r['variant']} | {budget} | {r['rows_per_chunk']} | "
            f"{r['kv_bytes'] / MIB:.2f} | {r['peak_bytes'] / MIB:.1f} | "
            f"{r['peak_ratio']:.3f} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_ratio']:.3f} | "
            f"{r['best_tokens_per_s']:.0f} | {r['best_tokens_per_s_ratio']:.3f} |"
        )
    for r in results:
        if r["mode"] == "greedy" and r["variant"] != "old":
            ok = "identical" if r["tokens_identical_to_old"] else "DIFFERENT"
            gap = r["log_prob_max_abs_diff"]
            print(
                f"\ngreedy {r['variant']}: tokens {ok} to the old loop's"
                + (f", log-probs max |diff| {gap:.2e}" if gap is not None else "")
            )
    busy = [
        f"{r['mode']} {r['variant']}"
        for r in results
        if max(r["load_before"], r["load_after"]) > args.threads + 0.5
    ]
    if busy:
        print(
            f"\nload average above {args.threads} threads around: {', '.join(busy)} "
            "(other processes: those timings are pessimistic)"
        )


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    lengths = [len(p) for p in make_prompts(args, MODELS[args.model]["vocab"])]
    whole = args.rows * (max(lengths) + args.max_new_tokens)  # KV tokens of the old loop
    variants = [("old", None)] + [(f"new 1/{k}", max(1, whole // k)) for k in args.fractions]
    results, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        for mode in args.modes:
            old = None
            for variant, budget in variants:
                r = measure(argv, {"mode": mode, "variant": variant, "max_tokens": budget}, tmp)
                old = old or r
                for key in ("tokens_per_s", "best_tokens_per_s"):
                    r[key + "_ratio"] = r[key] / old[key]
                r["peak_ratio"] = r["peak_bytes"] / old["peak_bytes"] if old["peak_bytes"] else 0.0
                r["kv_ratio"] = r["kv_bytes"] / old["kv_bytes"]
                r.update(compare_tokens(r, old))
                results.append(r)
                print(
                    f"# {mode} {variant}: {r['tokens_per_s']:.0f} tokens/s, peak "
                    f"{r['peak_bytes'] / MIB:.1f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
    for r in results:
        r.pop("tokens_path")
    print_table(args, results)
    print(f"\n(whole batch: {whole} KV tokens; total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("worker", "json")}
        with open(args.json, "w") as f:
            json.dump(
                {"config": config, "model": MODELS[args.model], "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()

"""Saved-tensor bytes and forward+backward time of Megatron's local core attention vs
SDPAttention, for the core attention alone and for one whole GPT layer, on CPU (fp32).

python benchmarks/attention_memory.py [--batch 2 --seq 1024 --hidden 256 --heads 8 --repeats 5]
"""

import argparse
import statistics
import time

import torch


def saved_bytes(fn):
    """Bytes of the distinct storages autograd saves while ``fn()`` runs its forward."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        out.float().sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from loggra_megatron.model.args import GPTModelArgs
    from loggra_megatron.model.build import build_gpt_model
    from loggra_megatron.parallel import initialize_megatron

    initialize_megatron(1, 1, device="cpu")
    args = GPTModelArgs(
        num_layers=1,
        hidden_size=a.hidden,
        ffn_hidden_size=4 * a.hidden,
        num_attention_heads=a.heads,
        vocab_size=128,
        max_position_embeddings=a.seq,
    )
    model = build_gpt_model(args, use_cpu_initialization=True)
    layer = model.decoder.layers[0]
    sdpa = layer.self_attention.core_attention
    local = DotProductAttention(
        config=sdpa.config,
        layer_number=sdpa.layer_number,
        attn_mask_type=sdpa.attn_mask_type,
        attention_type=sdpa.attention_type,
        softmax_scale=sdpa.config.softmax_scale,
    )
    d = a.hidden // a.heads
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(a.seq, a.batch, a.heads, d, generator=gen).requires_grad_() for _ in range(3)
    )
    hidden = torch.randn(a.seq, a.batch, a.hidden, generator=gen).requires_grad_()
    rope = model.rotary_pos_emb(a.seq)
    print(
        f"shape: b={a.batch} s={a.seq} hidden={a.hidden} heads={a.heads} (d={d}), fp32, "
        f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    mib = 2.0**20
    for name, core in (("local DotProductAttention", local), ("SDPAttention", sdpa)):
        ps.get_global_memory_buffer().buffer.clear()
        layer.self_attention.core_attention = core

        def attention(core=core):
            return core(q, k, v, None)

        def whole_layer():
            return layer(hidden, attention_mask=None, rotary_pos_emb=rope)[0]

        _, attn_bytes = saved_bytes(attention)
        _, layer_bytes = saved_bytes(whole_layer)
        buffer = sum(
            t.numel() * t.element_size() for t in ps.get_global_memory_buffer().buffer.values()
        )
        t_attn = timed(attention, a.repeats)
        t_layer = timed(whole_layer, a.repeats)
        print(
            f"{name:26s} saved: core attention {attn_bytes / mib:8.2f} MiB, whole layer "
            f"{layer_bytes / mib:8.2f} MiB; global memory buffer {buffer / mib:7.2f} MiB; "
            f"fwd+bwd median of {a.repeats}: core attention {t_attn * 1e3:7.1f} ms, "
            f"layer {t_layer * 1e3:7.1f} ms"
        )


if __name__ == "__main__":
    main()

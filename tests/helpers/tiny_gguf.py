"""A tiny Llama GGUF file, written as llama.cpp writes one from a Hugging Face model: a random
``LlamaForCausalLM`` (GQA, tied embeddings), its q/k rows permuted to llama.cpp's rotary
layout, the projections quantized (Q8_0 and Q4_1, as a 4-bit file mixes types) and norms
in F32, with a byte-level BPE vocabulary, ChatML special tokens and a chat template."""

from __future__ import annotations

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 96, 2, 4, 2
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("W", "h"), ("Wh", "at"), ("a", "t"), ("Ġ", "+"), ("i", "s"), ("Ġ", "is")]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUANTIZED = {"attn_q": "Q8_0", "attn_k": "Q8_0", "ffn_up": "Q4_1", "ffn_down": "Q4_1"}
"""Weights written quantized (by their GGUF name); the rest are F32."""


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens (the 256 byte-level symbols, the merged pieces, the special tokens) and their
    GGUF token types (1 normal, 3 control)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = sorted(bytes_to_unicode().values(), key=ord)
    tokens += ["".join(m) for m in MERGES if "".join(m) not in tokens]
    return tokens + SPECIAL, [1] * len(tokens) + [3] * len(SPECIAL)


def reference_model(vocab_size: int, seed: int = 0):
    """The random HF model the file is written from (norms away from 1, so they matter)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def to_rotary_halves(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of q/k rows: each head's two rotary halves interleaved pairwise."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"]}
    out["output_norm.weight"] = sd["model.norm.weight"]
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(LAYERS):
        for gguf_name, hf_name in names.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                w = to_rotary_halves(w, HEADS if gguf_name == "attn_q" else KV_HEADS)
            out[f"blk.{i}.{gguf_name}.weight"] = w
    return out


def write_tiny_gguf(path, seed: int = 0):
    """Write the file; returns the HF model it was made from."""
    import gguf

    tokens, types = vocabulary()
    model = reference_model(len(tokens), seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, array in _gguf_tensors(model).items():
        qtype = QUANTIZED.get(name.split(".")[-2])
        if qtype is None:
            w.add_tensor(name, array.astype(np.float32))
        else:
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model

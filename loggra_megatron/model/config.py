"""The policy model's settings (``--num-layers`` ... ``--transformer-impl``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from loggra_megatron.config import applies, at_least, check_fields, one_of, positive, reject

FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")  # Megatron's Fp8Recipe, less custom
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "rotary_base",
    "untie_embeddings_and_output_weights",
)
"""Fields a checkpoint fixes; ``GPTModelArgs`` has them too,
under the same names (a converted model's other fields are only in its args file)."""


def _full_recompute(s: dict) -> bool:
    return s["recompute_granularity"] == "full"


MAX_LOG_PROB_CHUNK = 256
"""The default ``--log-prob-chunk-size`` where the vocabulary shard is small."""
CHUNK_LOGITS_NUMEL = 1 << 22
"""Logits of one chunk by default (``[tokens, V/TP]``): 16 MiB in fp32."""


def log_prob_chunk_tokens(setting: int | None, local_vocab: int) -> int:
    """Tokens per log-prob chunk: ``setting`` (``--log-prob-chunk-size``) when given, else
    the largest power of two up to ``MAX_LOG_PROB_CHUNK`` (at least 16) whose chunk
    holds at most ``CHUNK_LOGITS_NUMEL`` logits of ``local_vocab`` (``V/TP``) entries."""
    if setting is not None:
        return setting
    tokens = MAX_LOG_PROB_CHUNK
    while tokens > 16 and tokens * local_vocab > CHUNK_LOGITS_NUMEL:
        tokens //= 2
    return tokens


@dataclass
class ModelConfig:
    """The architecture of a model made from scratch, its precision and layer implementation."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Hidden size."""
    ffn_hidden_size: int | None = None
    """SwiGLU FFN size (default: 8/3 · hidden, rounded up to a multiple of 64)."""
    num_attention_heads: int = 4
    """Attention heads."""
    num_query_groups: int | None = None
    """KV heads for grouped-query attention (default: one per head)."""
    seq_length: int = 128
    """Maximum tokens per sequence (prompt + response)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer instead of reusing the word embeddings."""
    rotary_base: float = 10000.0
    """RoPE base."""
    init_method_std: float = 0.02
    """Std of the initial weights (models made from scratch)."""
    bf16: bool = False
    """bf16 weights and activations with fp32 master weights."""
    fp8_format: str | None = None
    """FP8 on Hopper via Transformer Engine: hybrid | e4m3."""
    fp8_recipe: str = applies(
        "tensorwise", "with --fp8-format", lambda s: s["fp8_format"] is not None
    )
    """Transformer Engine FP8 recipe: tensorwise (current scaling, the RL default:
    docs/rollouts.md) | delayed | mxfp8 (Blackwell) | blockwise (not with the dynamic engine)."""
    transformer_impl: str = "auto"
    """local (plain PyTorch) | transformer_engine | auto (TE on GPU when installed)."""
    recompute_granularity: str | None = None
    """Activation recompute: full (whole layers, with --recompute-method) | selective (the
    core attention only, Megatron's default module list)."""
    recompute_method: str | None = applies(
        None, "with --recompute-granularity full", _full_recompute
    )
    """With full recompute: uniform (every --recompute-num-layers layers as one checkpoint)
    | block (the first --recompute-num-layers layers of each pipeline stage)."""
    recompute_num_layers: int | None = applies(
        None, "with --recompute-granularity full", _full_recompute
    )
    """Layers per checkpoint (uniform) or recomputed layers per stage (block)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism: norms, dropout and residuals split over TP ranks
    along the sequence (needs --tensor-model-parallel-size > 1)."""
    sequence_packing: bool = False
    """Feed each training and log-prob micro-batch as one packed row, no padding between its
    rows (THD, Megatron's ``PackedSeqParams``; docs/benchmarks.md): Transformer Engine's
    attention only, bf16."""
    log_prob_chunk_size: int | None = None
    """Tokens per chunk of every log-prob forward (training loss, old/reference log-probs,
    KL probe): the output layer and the vocab-parallel log-softmax run per chunk and are
    recomputed in the backward, so no ``[tokens, V/TP]`` logits of a whole micro-batch exist
    (docs/memory.md#chunked-log-probs). Default: the largest power of two up to 256 whose
    chunk holds at most 2^22 logits of this rank's vocabulary shard (16 MiB in fp32; 256 up
    to 16384 entries per rank, 128 at a 32k vocabulary on one rank). Larger: fewer, bigger
    GEMMs; smaller: less memory."""

    @property
    def ffn_size(self) -> int:
        """--ffn-hidden-size, or its default 8/3 · hidden rounded up to a multiple of 64."""
        return self.ffn_hidden_size or 64 * math.ceil(8 * self.hidden_size / 3 / 64)

    def __post_init__(self):
        check_fields(
            self,
            [
                ("num_layers", positive, ">= 1"),
                ("hidden_size", positive, ">= 1"),
                ("ffn_hidden_size", positive, ">= 1"),
                ("num_attention_heads", positive, ">= 1"),
                ("num_query_groups", positive, ">= 1"),
                ("seq_length", at_least(2), ">= 2"),
                ("rotary_base", positive, "> 0"),
                ("init_method_std", positive, "> 0"),
                ("fp8_format", one_of(*FP8_FORMATS), f"one of {', '.join(FP8_FORMATS)}"),
                ("fp8_recipe", one_of(*FP8_RECIPES), f"one of {', '.join(FP8_RECIPES)}"),
                (
                    "transformer_impl",
                    one_of(*TRANSFORMER_IMPLS),
                    f"one of {', '.join(TRANSFORMER_IMPLS)}",
                ),
                (
                    "recompute_granularity",
                    one_of(*RECOMPUTE_GRANULARITIES),
                    f"one of {', '.join(RECOMPUTE_GRANULARITIES)}",
                ),
                (
                    "recompute_method",
                    one_of(*RECOMPUTE_METHODS),
                    f"one of {', '.join(RECOMPUTE_METHODS)}",
                ),
                ("recompute_num_layers", positive, ">= 1"),
                ("log_prob_chunk_size", positive, ">= 1"),
            ],
        )
        self._check_recompute()
        if self.hidden_size % self.num_attention_heads:
            reject(
                "hidden_size",
                self.hidden_size,
                f"must be divisible by --num-attention-heads {self.num_attention_heads}",
            )
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            reject(
                "num_query_groups",
                self.num_query_groups,
                f"must divide --num-attention-heads {self.num_attention_heads}",
            )
        if self.fp8_format is not None and self.transformer_impl == "local":
            reject(
                "fp8_format",
                self.fp8_format,
                "FP8 runs in Transformer Engine layers; use "
                "--transformer-impl transformer_engine (or auto), not local",
            )
        if self.sequence_packing and self.transformer_impl == "local":
            reject(
                "sequence_packing",
                True,
                "packed sequences run in Transformer Engine's attention (Megatron-Core's local "
                "DotProductAttention refuses them); use --transformer-impl transformer_engine",
            )
        if self.sequence_packing and not self.bf16:
            reject(
                "sequence_packing",
                True,
                "needs --bf16: Transformer Engine's packed-sequence kernels (flash, cuDNN "
                "fused) take fp16/bf16 only",
            )
        if self.fp8_format is not None and not self.bf16:
            reject("fp8_format", self.fp8_format, "FP8 training needs --bf16")

    def _check_recompute(self) -> None:
        """Megatron-LM's rule: full recompute needs a method and a layer count (selective
        takes neither: the fields declare it)."""
        full = self.recompute_granularity == "full"
        if full and (self.recompute_method is None or self.recompute_num_layers is None):
            reject(
                "recompute_granularity",
                "full",
                "needs --recompute-method {uniform,block} "
                "and --recompute-num-layers N (e.g. uniform 1: every layer)",
            )

    def transformer_overrides(self) -> dict:
        """The ``TransformerConfig`` fields these settings set beyond the architecture:
        FP8, activation recompute and sequence parallelism."""
        out: dict = dict(sequence_parallel=self.sequence_parallel)
        if self.fp8_format:
            out.update(fp8=self.fp8_format, fp8_recipe=self.fp8_recipe)
        if self.recompute_granularity:
            out.update(
                recompute_granularity=self.recompute_granularity,
                recompute_method=self.recompute_method,
                recompute_num_layers=self.recompute_num_layers,
            )
        return out

    def model_args(self, vocab_size: int):
        """The ``GPTModelArgs`` of a model made from scratch."""
        from loggra_megatron.model.args import GPTModelArgs

        return GPTModelArgs(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            vocab_size=vocab_size,
            max_position_embeddings=self.seq_length,
            rotary_base=self.rotary_base,
            untie_embeddings_and_output_weights=self.untie_embeddings_and_output_weights,
            params_dtype=self.params_dtype,
            init_method_std=self.init_method_std,
            make_vocab_size_divisible_by=64,
        )

    @property
    def params_dtype(self) -> str:
        return "bfloat16" if self.bf16 else "float32"

"""CPU stand-ins that enforce what Transformer Engine and flash-attn enforce on a GPU, so that
a GPU-only failure has a CPU test that fails first (neither library has a CPU build). What
each enforces, as the TE 2.9-2.12 and flash-attn sources behave: docs/rollouts.md, "CPU
stand-ins for Transformer Engine and flash-attn".

* ``FP8ColumnParallelLinear`` / ``FP8RowParallelLinear``: TE's FP8 GEMM shape rule
  (``assert_dim_for_fp8_exec``) on the input the module really receives (the local SP
  shard); FP8 meta made lazily at the first FP8 forward (``init_fp8_meta_tensors``: inference
  tensors under ``torch.inference_mode``); under delayed scaling, the in-place copy of the
  stashed meta in the recompute (``get_old_fp8_meta_tensors_for_recompute``); TE's
  ``is_first_microbatch``, which Megatron's TE wrappers clear after any forward, FP8 or not.
* ``te_checkpoint``, ``SequenceParallelNorm``, ``prepare_model_for_fp8_inference``;
  ``ThdDotProductAttention``: TE's contract for packed sequences (THD).
* flash-attn's paged kernels (``varlen_attention``, ``kvcache_attention``) with its
  fp16/bf16 rule, and the CPU redirects Megatron-Core's dynamic engine needs.

``python tests/helpers/gpu_standins.py REPORT_DIR -- <pretrain_rl.py flags>`` (under torchrun) runs
``pretrain_rl.py --device cuda`` on the simulated CUDA device of ``tests/helpers/device_audit.py``
(capability 9.0) and writes ``REPORT_DIR/rank<N>.json``: exit code, violations, record.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import importlib.machinery
import math
import sys
import threading
import types
import weakref

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention

FLASH_DTYPE_ERROR = "FlashAttention only support fp16 and bf16 data type"
_phase = threading.local()  # .name: None | "checkpoint_forward" | "recompute"
RECORD: dict[str, int] = collections.Counter()
"""What the stand-ins saw: FP8 forwards checked, meta states created, recompute copies."""


# ---------------------------------------------------------------- Transformer Engine


def assert_dim_for_fp8_exec(*tensors: torch.Tensor) -> None:
    """TE's rule for FP8 GEMM operands (``transformer_engine.pytorch.utils``)."""
    for tensor in tensors:
        assert math.prod(tensor.shape[:-1]) % 8 == 0 and tensor.shape[-1] % 16 == 0, (
            "FP8 execution requires the product of all dimensions except the last to be "
            "divisible by 8 and the last dimension to be divisible by 16, but got tensor with "
            f"dims={list(tensor.size())}"
        )


@contextlib.contextmanager
def _in_phase(name: str | None):
    before = getattr(_phase, "name", None)
    _phase.name = name
    try:
        yield
    finally:
        _phase.name = before


def te_checkpoint(
    forward_func, distribute_saved_activations, get_rng_state_tracker, tp_group, *args, **kwargs
):
    """Megatron's ``te_checkpoint``: its ``CheckpointFunction`` runs the first pass under
    ``no_grad`` and the recompute in the backward with grad on; the linears see which."""

    def phased(*inputs):
        name = "recompute" if torch.is_grad_enabled() else "checkpoint_forward"
        with _in_phase(name):
            return forward_func(*inputs)

    return tensor_parallel.checkpoint(phased, distribute_saved_activations, *args, **kwargs)


class CurrentScalingQuantizer:
    """The fields of TE's ``Float8CurrentScalingQuantizer`` that its linears' quantizer rule
    sets (``with_amax_reduction``, ``amax_reduction_group``)."""

    def __init__(self):
        self.with_amax_reduction, self.amax_reduction_group = False, None


class _FP8Module:
    """What the FP8 linears share (see the module docstring)."""

    is_first_microbatch = True
    parallel_mode: str  # TE's "column" | "row"

    def _make_quantizers(self, tensorwise: bool) -> None:
        """TE's ``set_meta_tensor`` at the first FP8 forward: under current scaling the
        forward quantizers, the input's with an amax all-reduce over TP where the module is
        column-parallel with sequence parallelism on *then* (TE 2.9-2.12,
        ``Linear._customize_quantizers_float8_current_scaling``); never revisited."""
        forward = [CurrentScalingQuantizer() if tensorwise else object() for _ in range(3)]
        if tensorwise and self.sequence_parallel and self.parallel_mode == "column":
            forward[0].with_amax_reduction = True
            forward[0].amax_reduction_group = self.tp_group
        self.quantizers = {"scaling_fwd": forward, "scaling_bwd": []}

    def _quantize_input(self, inp: torch.Tensor, tensorwise: bool) -> None:
        """TE's current scaling: the input's amax, all-reduced over TP where the quantizer
        says so. Counted: the reductions, those run without sequence parallelism (each TP
        rank holds the whole input: wasted), and forwards with sequence parallelism that the
        rule would reduce but whose quantizer does not (ranks scale their shards apart)."""
        if not tensorwise:
            return
        quantizer = self.quantizers["scaling_fwd"][0]
        if quantizer.with_amax_reduction:
            amax = inp.detach().abs().amax().float()
            torch.distributed.all_reduce(
                amax, op=torch.distributed.ReduceOp.MAX, group=quantizer.amax_reduction_group
            )
            RECORD["amax_allreduces"] += 1
            RECORD["amax_allreduces_without_sp"] += int(not self.sequence_parallel)
        elif self.sequence_parallel and self.parallel_mode == "column":
            RECORD["sp_forwards_without_amax_reduction"] += 1

    def _fp8_prologue(self, inp: torch.Tensor) -> None:
        if not self.config.fp8:
            return
        assert_dim_for_fp8_exec(inp, self.weight)
        RECORD["fp8_forwards"] += 1
        RECORD["fp8_forwards_in_inference_mode"] += int(torch.is_inference_mode_enabled())
        tensorwise = str(self.config.fp8_recipe).endswith("tensorwise")
        meta = self.__dict__.get("fp8_meta")
        if meta is None:  # TE: init_fp8_meta_tensors at the first FP8 forward
            device = self.weight.device
            meta = {
                "scale": torch.ones(3, device=device),
                "amax_history": torch.zeros(16, 3, device=device),
                "stash": collections.deque(),
            }
            self.__dict__["fp8_meta"] = meta
            self._make_quantizers(tensorwise)
            RECORD["fp8_meta_created"] += 1
            RECORD["fp8_meta_created_in_inference_mode"] += int(torch.is_inference_mode_enabled())
        self._quantize_input(inp, tensorwise)
        delayed = str(self.config.fp8_recipe).endswith("delayed")
        phase = getattr(_phase, "name", None)
        if delayed and phase == "checkpoint_forward":  # copy_fp8_meta_tensors_for_recompute
            meta["stash"].append((meta["amax_history"].clone(), meta["scale"].clone()))
        elif delayed and phase == "recompute":  # get_old_fp8_meta_tensors_for_recompute
            amax, scale = meta["stash"].popleft()
            meta["amax_history"].copy_(amax)
            meta["scale"].copy_(scale)
            RECORD["recompute_meta_copies"] += 1

    @contextlib.contextmanager
    def _fp8_weight(self, first: bool):
        """TE's FP8 weight cache: a linear given ``is_first_microbatch`` casts its weight at
        the first micro-batch and computes the later ones with that cast, until Megatron's
        ``set_is_first_microbatch`` asks for a new one. Modelled by computing the forward
        with the weight's value at the last first micro-batch, so that a forward after an
        optimizer step without ``set_is_first_microbatch`` (a rollout sampling the old
        weights) computes what TE would: the old weights."""
        if not self.config.fp8:
            yield
            return
        cached = self.__dict__.get("fp8_weight_cache")
        if first or cached is None:
            cached = self.__dict__["fp8_weight_cache"] = self.weight.detach().clone()
        current, self.weight.data = self.weight.data, cached
        try:
            yield
        finally:
            self.weight.data = current


class FP8ColumnParallelLinear(_FP8Module, tensor_parallel.ColumnParallelLinear):
    parallel_mode = "column"

    def forward(self, input_, *args, **kwargs):
        first, self.is_first_microbatch = self.is_first_microbatch, False  # after any forward
        self._fp8_prologue(input_)  # the local SP shard: TE checks before its all-gather
        with self._fp8_weight(first):
            return super().forward(input_, *args, **kwargs)


class FP8RowParallelLinear(_FP8Module, tensor_parallel.RowParallelLinear):
    parallel_mode = "row"

    def forward(self, input_, *args, **kwargs):
        first, self.is_first_microbatch = self.is_first_microbatch, False  # after any forward
        self._fp8_prologue(input_)
        with self._fp8_weight(first):
            return super().forward(input_, *args, **kwargs)


class FusedNormColumnParallelLinear(FP8ColumnParallelLinear):
    """TE's ``LayerNormLinear`` as Megatron's TE spec uses it for ``linear_qkv`` and
    ``linear_fc1`` (``TELayerNormColumnParallelLinear``; the layer's own norm is an
    ``IdentityOp``): the module receives the *un-normalized* input and owns the norm's
    ``layer_norm_weight`` (``layer_norm_bias`` for LayerNorm), ``normalization``,
    ``zero_centered_gamma`` and ``eps``. The norm runs on the local SP shard in fp32 and
    returns the activation dtype, as TE's ``_apply_normalization``; the normalized input is
    then all-gathered under SP by the linear."""

    def __init__(self, input_size, output_size, *args, config, **kwargs):
        super().__init__(input_size, output_size, *args, config=config, **kwargs)
        self.normalization = config.normalization
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.eps = config.layernorm_epsilon
        init = 0.0 if self.zero_centered_gamma else 1.0
        dtype = config.params_dtype
        self.layer_norm_weight = torch.nn.Parameter(torch.full((input_size,), init, dtype=dtype))
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=dtype))
            self.layer_norm_bias.sequence_parallel = config.sequence_parallel

    def forward(self, input_, *args, **kwargs):
        x = input_.float()
        shape = (x.shape[-1],)
        w = self.layer_norm_weight.float() + (1.0 if self.zero_centered_gamma else 0.0)
        if self.normalization == "RMSNorm":
            y = torch.nn.functional.rms_norm(x, shape, w, self.eps)
        else:
            bias = self.layer_norm_bias.float()
            y = torch.nn.functional.layer_norm(x, shape, w, bias, self.eps)
        return super().forward(y.to(input_.dtype), *args, **kwargs)


class SequenceParallelNorm:
    """``WrappedTorchNorm`` without its refusal of sequence parallelism (TE's norms allow
    it); the weight is marked ``sequence_parallel`` so its grad is all-reduced over TP."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


class ThdDotProductAttention(DotProductAttention):
    """``TEDotProductAttention`` as Megatron wraps it and TE checks it: unpacked inputs go to
    Megatron's local attention; packed ones (``PackedSeqParams(qkv_format="thd")``) must be
    what TE asserts (``[t, h, d]`` queries, keys and values; int32 ``cu_seqlens [b + 1]``
    covering the ``t`` tokens, on their device; ``max_seqlen`` at least the longest row, as
    TE sizes its kernels by it) and fp16/bf16 (TE disables its unfused backend for THD and
    flash/cuDNN take no fp32: "No dot product attention backend is available"). Each row
    attends causally within itself; the output is TE's ``[t, h·d]``."""

    dtype_rule = True
    """TE's backend rule; an fp32 equivalence test turns it off (the only rule that is not
    about layout)."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        packed = packed_seq_params
        if packed is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        assert packed.qkv_format == "thd", packed.qkv_format
        assert all(x.dim() == 3 for x in (query, key, value)), (
            "Queries, keys and values must be 3D tensors when qkv_format = thd!"
        )
        cu_q, cu_kv = packed.cu_seqlens_q, packed.cu_seqlens_kv
        assert cu_q is not None and cu_kv is not None and cu_q.shape == cu_kv.shape
        assert cu_q.dtype == torch.int32 and cu_kv.dtype == torch.int32, (
            "cu_seqlens_q and cu_seqlens_q must both be in dtype torch.int32!"
        )
        assert cu_q.device == query.device, f"cu_seqlens on {cu_q.device}, q on {query.device}"
        assert int(cu_q[0]) == 0 and int(cu_q[-1]) == query.shape[0], (cu_q, query.shape)
        longest = int(cu_q.diff().max())
        assert packed.max_seqlen_q >= longest and packed.max_seqlen_kv >= longest
        if self.dtype_rule and query.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("No dot product attention backend is available for the inputs")
        RECORD["thd_attention"] += 1
        out = torch.empty_like(query)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            out[a:b] = _attend(query[a:b], key[a:b], value[a:b], self.softmax_scale)
        return out.reshape(out.shape[0], -1)


_WRAPPED = weakref.WeakSet()


def prepare_model_for_fp8_inference(model):
    """Megatron's wrapper (``fp8_utils``): pad the token dimension of each FP8 linear's input
    to a multiple of 16 for inference, unpad the output; record the module."""
    for module in model.modules():
        if isinstance(module, _FP8Module) and module not in _WRAPPED:
            module.forward = _padded_forward(module, module.forward)
            _WRAPPED.add(module)
    return model


def _padded_forward(module, forward):
    def padded(input_, *args, **kwargs):
        tokens = input_.shape[0]
        extra = -tokens % 16
        if extra == 0:
            return forward(input_, *args, **kwargs)
        pad = input_.new_zeros((extra, *input_.shape[1:]))
        out, bias = forward(torch.cat([input_, pad]), *args, **kwargs)
        return out[:tokens], bias

    return padded


def _swap_classes(spec, swaps: dict) -> None:
    """Replace module classes in a Megatron ``ModuleSpec`` tree, in place."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        spec.module = swaps.get(spec.module, spec.module)
        _swap_classes(spec.submodules, swaps)
    elif isinstance(spec, functools.partial):  # 0.19: partial(MLP.as_mlp_submodule, ...)
        for value in spec.keywords.values():
            _swap_classes(value, swaps)
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if isinstance(value, type) and value in swaps:
                setattr(spec, field.name, swaps[value])
            else:
                _swap_classes(value, swaps)


def te_layer_spec(qk_layernorm: bool = False, **kwargs):
    """Stands in for ``get_gpt_layer_with_transformer_engine_spec``: Megatron's local spec
    with the FP8 linears, the sequence-parallel norm and TE's attention (THD)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    _swap_classes(
        spec,
        {
            tensor_parallel.ColumnParallelLinear: FP8ColumnParallelLinear,
            tensor_parallel.RowParallelLinear: FP8RowParallelLinear,
            WrappedTorchNorm: SequenceParallelNorm,
            DotProductAttention: ThdDotProductAttention,
        },
    )
    return spec


def te_fused_norm_layer_spec(qk_layernorm: bool = False, **kwargs):
    """``te_layer_spec`` with the norms fused into ``linear_qkv`` and ``linear_fc1``
    (``FusedNormColumnParallelLinear``), as Megatron's real TE spec has them."""
    from megatron.core.transformer.identity_op import IdentityOp

    spec = te_layer_spec(qk_layernorm=qk_layernorm, **kwargs)
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = IdentityOp
    _swap_classes(spec, {FP8ColumnParallelLinear: FusedNormColumnParallelLinear})
    return spec


def install_transformer_engine(fused_norm: bool = False) -> None:
    """Make ``--transformer-impl transformer_engine`` build the stand-in layers. Megatron-Core
    is imported first, so its own TE detection stays False (nothing of TE is ever called).
    ``fused_norm``: the norms fused into ``linear_qkv`` / ``linear_fc1`` (TE's
    ``LayerNormLinear``, ``te_fused_norm_layer_spec``)."""
    import megatron.core.fp8_utils as fp8_utils
    import megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper as w
    import megatron.core.models.gpt.gpt_layer_specs as specs
    import megatron.core.transformer.transformer_block as block

    fake = types.ModuleType("transformer_engine")
    fake.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    sys.modules.setdefault("transformer_engine", fake)
    specs.get_gpt_layer_with_transformer_engine_spec = (
        te_fused_norm_layer_spec if fused_norm else te_layer_spec
    )
    for name in ("megatron.core.transformer.transformer_block", "megatron.core.recompute"):
        with contextlib.suppress(ImportError):  # 0.17+ recomputes in megatron.core.recompute
            module = importlib.import_module(name)
            if hasattr(module, "te_checkpoint"):
                module.te_checkpoint = te_checkpoint
    block.LayerNormImpl = SequenceParallelNorm  # the final norm
    fp8_utils.prepare_model_for_fp8_inference = prepare_model_for_fp8_inference
    fp8_utils._fp8_inference_wrapped_modules = _WRAPPED
    w.prepare_model_for_fp8_inference = prepare_model_for_fp8_inference


# ---------------------------------------------------------------- flash-attn


def _check_flash_dtype(*tensors: torch.Tensor) -> None:
    if any(t.dtype not in (torch.float16, torch.bfloat16) for t in tensors):
        raise RuntimeError(FLASH_DTYPE_ERROR)


def _check_flash_inputs(q, k, v, block_table, **int32) -> None:
    """What flash-attn 2.x's ``flash_api.cpp`` checks before its kernels (``mha_varlen_fwd``,
    ``mha_fwd_kvcache``), with its messages: fp16/bf16 and one dtype for ``q, k, v``, their
    last dimension contiguous, a head dimension of at most 256, the int32 index tensors
    (``int32``: name → tensor), and a paged cache's ``block_table`` int32 with a contiguous
    last dimension and blocks of a multiple of 256 tokens."""
    _check_flash_dtype(q, k, v)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise RuntimeError("Input tensor must have contiguous last dimension")
    if q.shape[-1] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    for name, t in int32.items():
        if t.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
    if block_table is not None:
        if block_table.dtype != torch.int32:
            raise RuntimeError("block_table must have dtype torch.int32")
        if block_table.stride(-1) != 1:
            raise RuntimeError("block_table must have contiguous last dimension")
        if k.shape[1] % 256:
            raise RuntimeError("Paged KV cache block size must be divisible by 256")


def _attend(q, k, v, scale):
    """Causal attention of ``q [sq, hq, d]`` over ``k, v [sk, hk, d]`` (the last query sees
    every key: bottom-right causal alignment, as flash-attn); GQA by head repetition."""
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    k, v = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    pos = torch.arange(max(sk, sq), device=q.device)
    future = pos[None, :sk] > pos[:sq, None] + (sk - sq)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def _paged(cache, block_ids, length):
    """The first ``length`` tokens of one sequence from a ``[blocks, block_size, h, d]`` cache."""
    used = block_ids[: -(-length // cache.shape[1])].long()
    return cache[used].reshape(-1, *cache.shape[2:])[:length]


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=True,
    block_table=None,
    window_size=(-1, -1),
    return_attn_probs=False,
):
    """``flash_attn_varlen_func`` with a paged KV cache (prefill / mixed steps)."""
    _check_flash_inputs(q, k, v, block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    assert causal and tuple(window_size) == (-1, -1) and not return_attn_probs
    out, scale = torch.zeros_like(q), softmax_scale or q.shape[-1] ** -0.5
    for i in range(len(cu_seqlens_q) - 1):
        a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        n = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        if b > a and n > 0:
            kv = [_paged(c, block_table[i], n) for c in (k, v)]
            out[a:b] = _attend(q[a:b], *kv, scale)
    return out


def kvcache_attention(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    causal=True,
    block_table=None,
    num_splits=0,
    softmax_scale=None,
    window_size=(-1, -1),
):
    """``flash_attn_with_kvcache`` with a block table (decode-only steps, ``q [n, sq, h, d]``),
    as its kernel runs: every row at once over its whole block table, the keys at and past
    ``cache_seqlens`` masked on the device, so it reads nothing on the host and a CUDA graph
    (``cuda_graph_standin``) can capture it. Rows past ``cache_seqlens``/``block_table``
    (a graph's padding) are zeros."""
    _check_flash_inputs(q, k_cache, v_cache, block_table, seqlens_k=cache_seqlens)
    assert causal and tuple(window_size) == (-1, -1)
    scale = softmax_scale or q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    n = min(q.shape[0], len(cache_seqlens), len(block_table))
    sq, hq = q.shape[1], q.shape[2]
    rows = block_table[:n].long()  # [n, blocks]; unused entries are masked below
    k, v = (c[rows].flatten(1, 2) for c in (k_cache, v_cache))  # [n, S, hk, d]
    k, v = (t.repeat_interleave(hq // t.shape[2], dim=2) for t in (k, v))
    lengths = cache_seqlens[:n].long()
    key = torch.arange(k.shape[1], device=q.device)
    v = torch.where((key[None, :] < lengths[:, None])[..., None, None], v, 0)  # no stale NaN
    query = torch.arange(sq, device=q.device)
    visible = key[None, None, :] <= lengths[:, None, None] - sq + query[None, :, None]
    scores = torch.einsum("nqhd,nkhd->nhqk", q[:n].float(), k.float()) * scale
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    out[:n] = torch.einsum("nhqk,nkhd->nqhd", probs, v.float()).to(q.dtype)
    return out


class _TorchWithCpuGenerator(types.ModuleType):
    """``torch`` for the controller's module, whose ``Generator(device=<cuda>)`` is on CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def Generator(device=None):  # noqa: N802
        return torch.Generator("cpu")


def install_generator_redirect() -> None:
    import megatron.core.inference.text_generation_controllers.text_generation_controller as tgc

    tgc.torch = _TorchWithCpuGenerator("torch")


def install_flash_attn() -> None:
    """The flash-attn kernels above and the CPU redirects Megatron-Core's dynamic engine needs."""
    import megatron.core.inference.communication_utils as comm
    import megatron.core.inference.contexts.dynamic_context as dynamic_context
    import megatron.core.transformer.attention as attention

    install_generator_redirect()
    attention.is_fa_min_version = lambda *args, **kwargs: True
    attention.flash_attn_varlen_func = varlen_attention
    attention.flash_attn_with_kvcache = kvcache_attention
    if attention.rearrange is None:  # 's b h d -> s b (h d)'
        attention.rearrange = lambda t, pattern: t.reshape(*t.shape[:2], -1)
    comm._is_cuda = lambda tensor: None
    dynamic_context.triton_append_key_value_cache = None  # 0.17+: Triton (CUDA only)


# ---------------------------------------------------------------- launcher


def main(report_dir: str, argv: list[str]) -> int:
    """``pretrain_rl.py argv --device cuda`` on the simulated device with every stand-in."""
    import cuda_graph_standin
    import device_audit

    audit = device_audit.DeviceAudit()
    device_audit.install(audit)
    cuda_graph_standin.install()  # the dynamic engine's decode graphs (bf16 rollouts)
    torch.cuda.get_device_capability = lambda device=None: (9, 0)  # Hopper
    install_transformer_engine()
    install_flash_attn()
    code = device_audit.run_pretrain_rl(audit, argv)
    report = {"exit": code, "violations": audit.violations, "record": dict(RECORD)}
    device_audit.write_report(report_dir, report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[3:]))

"""Rollouts with a bounded KV cache: Megatron-Core's dynamic inference engine on the policy.

:func:`generate_rollout_dynamic` returns the same :class:`~loggra_megatron.rollout.generate.Rollout`
as :func:`~loggra_megatron.rollout.generate.generate_rollout`, but drives Megatron-Core 0.16's
``DynamicInferenceEngine`` on the *training model object itself* (no weight copy, no sync),
as Megatron-LM's RL does (``megatron/rl/inference/megatron.py::get_dynamic_inference_engine``,
``megatron/rl/rl_utils.py::megatron_rl_inference_mode``). CUDA only:
:func:`dynamic_engine_unavailable` says why not, e.g. on CPU.

Engine flow (files under ``megatron/core/inference/``)
-----------------------------------------------------
* ``contexts/dynamic_context.py::DynamicInferenceContext`` owns a *paged* KV cache, one
  buffer ``[2, layers of the stage, blocks + 1 dummy, block_size, KV heads / TP, kv_channels]``
  whose blocks of ``block_size_tokens`` tokens are handed to requests as they grow::

      KV bytes per rank = blocks · 2 · layers of the stage · block_size
                          · (query groups / TP) · kv_channels · bytes per element
      blocks = ceil(max(max_tokens, P + N) / block_size)
               (max_tokens=None: Σ_i ceil((p_i + N) / block_size), no bound)

  (``P`` the longest prompt, ``N = max_new_tokens``: one sequence always fits, as in the
  chunked static engine), passed as the constructor's ``buffer_size_gb`` with no separate
  paused pool. The context's ``max_tokens`` (tokens per forward) is ``min(max_tokens, Σ p_i)``
  rounded up to Megatron's multiple of 64, ``max_requests`` is ``min(B, blocks)``.
* ``engines/dynamic_engine.py::DynamicInferenceEngine`` schedules: each ``step_modern()``
  admits waiting requests while blocks and the token budget allow (a longer prompt is
  *chunked* over steps), runs one forward over the flat ``[1, tokens]`` batch of all active
  requests (prefill chunks and 1-token decodes mixed), samples one token per request and
  retires finished ones, freeing their blocks. A request needing a block when none is free
  is paused; paused requests that do not fit are *evicted*, i.e. re-queued with prompt +
  generated-so-far as the new prompt and prefilled again later. Greedy tokens therefore
  equal unbounded decoding (up to floating-point noise); only the order of work changes.
* ``text_generation_controllers/text_generation_controller.py::TextGenerationController``
  runs a step: ``GPTInferenceWrapper.run_one_forward_step`` under ``torch.inference_mode``,
  ``_dynamic_step_sample_logits``, then the bookkeeping (finish on ``termination_id`` or
  length). Attention reads the paged cache only through flash-attn's paged CUDA kernels
  (``transformer/attention.py::flash_decode_and_prefill``: ``flash_attn_varlen_func`` /
  ``flash_attn_with_kvcache`` with a block table; flash-attn 2 wants blocks of a multiple of
  256 tokens, the default). Why that rules out CPU: ``tests/test_rollout_dynamic.py``.

Sampling (our override of ``_dynamic_step_sample_logits``)
----------------------------------------------------------
The controller's sampler would draw padded vocabulary rows (the dynamic path neither masks
nor clamps them), uses one generator seeded from the model config and honours a single
``termination_id``. Ours cuts the ``[n, V]`` last-token logits of the ``n`` active requests
to ``vocab_size`` and samples with :func:`~loggra_megatron.rollout.generate.sample_tokens`
(greedy at ``temperature == 0``, else temperature + top-p) and a
:func:`~loggra_megatron.rollout.generate.sampling_generator` seeded from ``(seed, step, DP
rank)``. Several stop ids: the first is the ``termination_id``; a sampled *other* stop id is
handed to the engine as the first (which finishes the request at once) and written back into
the response afterwards. Draws follow the engine's batching: at ``temperature > 0`` they
depend on ``max_tokens`` and ``block_size_tokens``, their distribution does not.

Log-probs: the returned ``log_probs`` are the *untempered* (temperature-1) policy's,
recomputed after generation by :func:`~loggra_megatron.rollout.generate.compute_log_probs`
on the finished sequences (the KV cache freed first), in micro-batches of
``max(1, max_tokens // L)`` rows when bounded, with the model back in its training
configuration (sequence parallelism included): the static engine's up to float noise.

Sharding and what runs where
----------------------------
Every rank of a model replica (all TP and PP ranks) calls this with the same arguments; DP
replicas run independent engines (no coordinator). **TP**: each rank caches its KV heads;
the logits are all-gathered (``runtime_gather_output=True``), every TP rank samples and TP
rank 0's ids are broadcast over the TP group. **PP**: each stage caches its own layers (the
context all-reduces the block count: equal on all stages); hidden states go stage to stage
(``communication_utils`` p2p) and the last stage's ``[1, n, V]`` logits are broadcast to all
(``broadcast_from_last_pipeline_stage``, in ``params_dtype``: bf16 for a bf16 model), so all
stages sample the same ids and keep the same bookkeeping. The log-probs, computed on the last
stage, are broadcast over the PP group: every rank returns the same :class:`Rollout`.
Sequence parallelism is off while generating; context and expert parallelism are unsupported.

Model state: eval mode and SP flags are set and restored exactly
(:func:`~loggra_megatron.rollout.generate._generation_mode`). No CUDA graph is captured or
replayed (``enable_cuda_graph=False``, no graph batch sizes in the context), whatever the
training config says. RoPE's ``lru_cache`` is cleared before and after: a table cached under
``inference_mode`` is an inference tensor that a later fused-RoPE backward cannot save
(Megatron-LM's RL clears it too). Under FP8 (Transformer Engine) the cached FP8 weight casts
are refreshed before generation (``set_is_first_microbatch``, as the schedule does for a
first micro-batch) and after it, and the wrapper's FP8 padding of TE linears
(``fp8_utils.prepare_model_for_fp8_inference``: decode GEMMs have few rows) is undone
afterwards. Caveat: under delayed scaling generation updates the amax histories, as any
forward does.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from loggra_megatron.rollout.generate import (
    Rollout,
    _check_sampling,
    _generation_mode,
    _pack_prompts,
    compute_log_probs,
    sample_tokens,
    sampling_generator,
)

__all__ = ["dynamic_engine_unavailable", "generate_rollout_dynamic"]

DEFAULT_BLOCK_SIZE = 256


def dynamic_engine_unavailable(model=None) -> str | None:
    """Why Megatron-Core's dynamic engine cannot run on this process (``None``: it can):
    it needs the model on CUDA and flash-attn >= 2.7.3 or FA3 (and einops)."""
    import megatron.core.transformer.attention as attention

    on_cuda = model is None or next(model.parameters()).is_cuda
    if not (torch.cuda.is_available() and on_cuda):
        return "the dynamic engine needs CUDA (flash-attn paged attention)"
    try:
        flash = attention.HAVE_FA3 or attention.is_fa_min_version("2.7.3")
    except ImportError:
        flash = False
    if not flash:
        return "the dynamic engine needs flash-attn >= 2.7.3 or flash-attn 3"
    return "the dynamic engine needs einops" if attention.rearrange is None else None


def _stop_list(eos_id: int | Sequence[int] | None) -> list[int]:
    """Stop ids in order, without repeats."""
    ids = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id)
    return list(dict.fromkeys(int(i) for i in ids))


def truncate_at_stop(tokens: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], bool]:
    """``tokens`` up to and including the first stop id, and whether there was one."""
    stops = set(stop_ids)
    for i, tok in enumerate(tokens):
        if tok in stops:
            return list(tokens[: i + 1]), True
    return list(tokens), False


def pack_rollout(prompts: torch.Tensor, lengths: torch.Tensor, responses, stopped, pad_id: int):
    """A :class:`Rollout` (zero log-probs) from right-padded ``prompts [B, P]``, their
    ``lengths [B]`` and each row's generated tokens, in ``generate_rollout``'s layout."""
    device = prompts.device
    gen = torch.tensor([len(r) for r in responses], dtype=torch.long, device=device)
    lengths = lengths.to(device=device, dtype=torch.long)
    seq_len = lengths + gen
    width = max(int(seq_len.max()), prompts.shape[1])
    tokens = torch.full((len(responses), width), pad_id, dtype=torch.long, device=device)
    tokens[:, : prompts.shape[1]] = prompts
    for i, resp in enumerate(responses):
        p = int(lengths[i])
        tokens[i, p : p + len(resp)] = torch.as_tensor(list(resp), dtype=torch.long)
    positions = torch.arange(width, device=device)
    target = positions[: width - 1].unsqueeze(0) + 1  # response_mask[:, t] is about tokens[:, t+1]
    return Rollout(
        tokens=tokens,
        log_probs=torch.zeros(len(responses), width - 1, dtype=torch.float32, device=device),
        response_mask=(target >= lengths.unsqueeze(1)) & (target < seq_len.unsqueeze(1)),
        token_mask=positions.unsqueeze(0) < seq_len.unsqueeze(1),
        prompt_lengths=lengths,
        response_lengths=gen,
        truncated=~torch.tensor(list(stopped), dtype=torch.bool, device=device),
    )


class StepSampler:
    """Samples the active requests' next tokens (see the module docstring).

    ``__call__(logits [n, V], request_ids [n], skip_id)`` returns ``[n]`` ids: padded vocab
    rows never drawn, TP-consistent, and any stop id other than the first replaced by the
    first (recorded in ``substituted[request_id]``), except for request ``skip_id`` (the one
    in chunked prefill, whose token is discarded).
    """

    def __init__(self, *, temperature, top_p, vocab_size, generator, stop_ids, tp_group=None):
        self.temperature, self.top_p, self.vocab_size = temperature, top_p, vocab_size
        self.generator, self.tp_group = generator, tp_group
        self.termination_id = stop_ids[0] if stop_ids else -1
        self.other_stops = torch.tensor(stop_ids[1:], dtype=torch.long)
        self.substituted: dict[int, int] = {}

    def __call__(self, logits: torch.Tensor, request_ids: torch.Tensor, skip_id: int = -1):
        allowed = logits if self.vocab_size is None else logits[:, : self.vocab_size]
        ids = sample_tokens(allowed, self.temperature, self.top_p, self.generator)
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            src = dist.get_process_group_ranks(self.tp_group)[0]
            dist.broadcast(ids, src=src, group=self.tp_group)
        return self.substitute(ids, request_ids, skip_id)

    def substitute(self, ids: torch.Tensor, request_ids: torch.Tensor, skip_id: int = -1):
        if self.other_stops.numel() == 0:
            return ids
        hit = torch.isin(ids, self.other_stops.to(ids.device))
        hit &= request_ids.to(ids.device) != skip_id
        if bool(hit.any()):
            for rid, tok in zip(request_ids[hit.to(request_ids.device)].tolist(),
                                ids[hit].tolist(), strict=True):  # fmt: skip
                self.substituted[int(rid)] = int(tok)
            ids = torch.where(hit, torch.full_like(ids, self.termination_id), ids)
        return ids


@functools.lru_cache(maxsize=1)
def _controller_class():
    """Megatron's ``TextGenerationController`` with :class:`StepSampler` as its sampler."""
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class RolloutController(TextGenerationController):
        step_sampler: StepSampler

        def _dynamic_step_sample_logits(self, logits: torch.Tensor) -> None:
            context = self.inference_wrapped_model.inference_context
            active = slice(context.paused_request_count, context.total_request_count)
            n = active.stop - active.start
            if context.materialize_only_last_token_logits:
                last = logits.squeeze(0)
            else:
                last = context.last_token_logits(logits)
            ids = self.step_sampler(
                last[:n].float(), context.request_ids[active].long(),
                context.chunked_prefill_request_id,
            )  # fmt: skip
            self._sampled_tokens_cuda[:n] = ids

    return RolloutController


class _NoTokenizer:
    """The engine detokenizes finished requests for display; rollouts stay token ids."""

    bos = None
    eod = -1

    def detokenize(self, tokens, **kwargs) -> str:
        return ""


def _kv_block_bytes(config, layers: int, block_size: int, tp: int) -> int:
    """Bytes of one KV block on this rank (``DynamicInferenceContext.block_size_bytes``)."""
    heads = (config.num_query_groups or config.num_attention_heads) // tp
    return config.params_dtype.itemsize * 2 * layers * block_size * heads * config.kv_channels


def _plan(lengths: list[int], max_new_tokens: int, max_tokens: int | None, block_size: int):
    """``(kv_blocks, max_requests, tokens_per_step)`` before Megatron's 64-token rounding."""
    max_seq = max(lengths) + max_new_tokens
    need_all = sum(math.ceil((p + max_new_tokens) / block_size) for p in lengths)
    blocks = need_all
    if max_tokens is not None:
        blocks = min(need_all, math.ceil(max(max_tokens, max_seq) / block_size))
    requests = min(len(lengths), blocks)
    step_tokens = sum(lengths) if max_tokens is None else min(max_tokens, sum(lengths))
    return blocks, requests, max(step_tokens, requests)


def kv_cache_tokens(lengths: list[int], max_new_tokens: int, max_tokens: int | None,
                    block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Tokens of the paged KV buffer the engine gets for prompts of ``lengths``."""
    return _plan(lengths, max_new_tokens, max_tokens, block_size)[0] * block_size


def _build_engine(model, config, *, blocks, max_requests, step_tokens, max_seq, block_size,
                  sampler, seed):  # fmt: skip
    from megatron.core import parallel_state as ps
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
        InferenceWrapperConfig,
    )
    from megatron.core.utils import unwrap_model

    inner = unwrap_model(model)
    tp = ps.get_tensor_model_parallel_world_size()
    layers = len(inner.decoder.layers)
    block_bytes = _kv_block_bytes(config, layers, block_size, tp)
    context = DynamicInferenceContext(
        params_dtype=config.params_dtype,
        num_layers=layers,
        kv_channels=config.kv_channels,
        num_attention_heads=config.num_query_groups or config.num_attention_heads,
        max_sequence_length=max_seq,
        # blocks + the dummy block, plus half a block against float rounding
        buffer_size_gb=((blocks + 1) * block_bytes + block_bytes // 2) / 1024**3,
        max_requests=max_requests,
        max_tokens=DynamicInferenceContext.round_up_tokens(step_tokens, tp),
        block_size_tokens=block_size,
        materialize_only_last_token_logits=True,
        num_cuda_graphs=None,
        use_cuda_graphs_for_non_decode_steps=False,
        use_flashinfer_fused_rope=False,
        unified_memory_level=0,
    )
    if context.block_allocator.active_count != blocks:  # the formula above went stale
        raise RuntimeError(f"KV cache has {context.block_allocator.active_count} blocks, "
                           f"wanted {blocks}")  # fmt: skip
    wrapper_config = InferenceWrapperConfig(
        hidden_size=config.hidden_size,
        params_dtype=config.params_dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=inner.vocab_size,
        inference_max_requests=max_requests,
        inference_max_seq_length=max_seq,
        fp32_residual_connection=config.fp32_residual_connection,
        fp8=config.fp8,
    )
    wrapped = GPTInferenceWrapper(model, wrapper_config, context)
    controller = _controller_class()(
        wrapped, _NoTokenizer(), pp_group=ps.get_pipeline_model_parallel_group()
    )
    controller.step_sampler = sampler
    with warnings.catch_warnings():  # enable_cuda_graph is deprecated, but it is the off switch
        warnings.simplefilter("ignore")
        return DynamicInferenceEngine(
            controller, context, enable_cuda_graph=False, random_seed=int(seed),
            enable_chunked_prefill=True,
        )  # fmt: skip


def _run(engine, num_requests: int) -> dict[int, list[int]]:
    """Step the engine until every request is done; generated tokens by request id."""
    from megatron.core.inference.inference_request import Status

    out: dict[int, list[int]] = {}
    idle = 0
    while engine.has_unfinished_requests():
        result = engine.step_modern()
        finished = result["finished_request_records"]
        idle = 0 if (finished or result["active_request_ids"]) else idle + 1
        if idle > 2:
            raise RuntimeError("dynamic engine stalled: no request fits the KV cache")
        for record in finished:
            request = record.merge()
            if request.status != Status.COMPLETED:
                raise RuntimeError(f"request {record.request_id} failed: {request.events}")
            out[record.request_id] = list(request.generated_tokens)
    if sorted(out) != list(range(num_requests)):
        raise RuntimeError(f"dynamic engine returned requests {sorted(out)}")
    return out


def _clear_rotary_cache(inner) -> None:
    forward = getattr(getattr(inner, "rotary_pos_emb", None), "forward", None)
    if hasattr(forward, "cache_clear"):
        forward.cache_clear()


def _fp8_padding_set():
    try:
        from megatron.core.fp8_utils import _fp8_inference_wrapped_modules
    except ImportError:  # no Transformer Engine
        return None
    return _fp8_inference_wrapped_modules


def restore_forwards(modules, wrapped, before: set[int]) -> None:
    """Undo ``prepare_model_for_fp8_inference`` on ``modules`` it wrapped since ``before``
    (ids of those already wrapped): drop the instance ``forward`` and the set entry."""
    for module in modules:
        if module in wrapped and id(module) not in before:
            module.__dict__.pop("forward", None)
            wrapped.discard(module)


@contextlib.contextmanager
def _inference_state(model) -> Iterator[None]:
    """RoPE cache and FP8 state around generation; see the module docstring."""
    from megatron.core.utils import get_model_config, unwrap_model

    inner = unwrap_model(model)
    fp8 = bool(get_model_config(model).fp8) and hasattr(inner, "set_is_first_microbatch")
    wrapped = _fp8_padding_set()
    before = set() if wrapped is None else {id(m) for m in inner.modules() if m in wrapped}
    _clear_rotary_cache(inner)
    if fp8:
        inner.set_is_first_microbatch()  # recast the FP8 weights: they changed since
    try:
        yield
    finally:
        if wrapped is not None:
            restore_forwards(inner.modules(), wrapped, before)
        _clear_rotary_cache(inner)
        if fp8:
            inner.set_is_first_microbatch()  # drop casts made under inference_mode


def _generate(model, prompts, lengths, *, max_new_tokens, temperature, top_p, stop_ids,
              vocab_size, seed, step, max_tokens, block_size) -> list[list[int]]:  # fmt: skip
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    lens = lengths.tolist()
    blocks, max_requests, step_tokens = _plan(lens, max_new_tokens, max_tokens, block_size)
    generator = None
    if temperature > 0:
        generator = sampling_generator(seed, step, ps.get_data_parallel_rank(), prompts.device)
    sampler = StepSampler(temperature=temperature, top_p=top_p, vocab_size=vocab_size,
                          generator=generator, stop_ids=stop_ids,
                          tp_group=ps.get_tensor_model_parallel_group())  # fmt: skip
    greedy = temperature == 0
    params = SamplingParams(
        temperature=1.0 if greedy else float(temperature),
        top_k=1 if greedy else 0,
        top_p=0.0 if greedy or top_p >= 1.0 else float(top_p),
        num_tokens_to_generate=max_new_tokens,
        termination_id=sampler.termination_id,
    )
    with _generation_mode(model), _inference_state(model):
        engine = _build_engine(model, config, blocks=blocks, max_requests=max_requests,
                               step_tokens=step_tokens, max_seq=max(lens) + max_new_tokens,
                               block_size=block_size, sampler=sampler, seed=seed)  # fmt: skip
        try:
            for i, p in enumerate(lens):
                engine.add_request(i, prompts[i, :p].tolist(), params)
            generated = _run(engine, len(lens))
        finally:
            engine.context.deallocate_all_tensors()  # free the KV cache now
            del engine
    for rid, tok in sampler.substituted.items():  # the stop id that was really sampled
        generated[rid][-1] = tok
    return [generated[i] for i in range(len(lens))]


def _policy_log_probs(model, rollout: Rollout, max_tokens: int | None) -> torch.Tensor:
    """Untempered log-probs of the rollout's response tokens on every rank (0 elsewhere)."""
    from megatron.core import parallel_state as ps

    batch, width = rollout.tokens.shape
    log_probs = rollout.log_probs
    if width < 2 or not bool(rollout.response_mask.any()):
        return log_probs
    mbs = batch if max_tokens is None else max(1, max_tokens // width)
    out = compute_log_probs(model, rollout.tokens, micro_batch_size=mbs)
    if out is not None:
        log_probs = torch.where(rollout.response_mask, out.float(), 0.0)
    pp_group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:
        dist.broadcast(log_probs, src=dist.get_process_group_ranks(pp_group)[-1], group=pp_group)
    return log_probs.contiguous()


@torch.no_grad()
def generate_rollout_dynamic(
    model,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    seed: int = 0,
    step: int = 0,
    vocab_size: int | None = None,
    max_tokens: int | None = None,
    prompt_lengths: torch.Tensor | None = None,
    block_size_tokens: int = DEFAULT_BLOCK_SIZE,
) -> Rollout:
    """Sample up to ``max_new_tokens`` tokens after each prompt with Megatron-Core's dynamic
    engine, the KV cache bounded by ``max_tokens`` tokens; see the module docstring.

    Arguments as :func:`~loggra_megatron.rollout.generate.generate_rollout` (``prompts`` a
    list of token-id lists or a right-padded ``[B, P]`` tensor with ``prompt_lengths``;
    ``eos_id`` one or several stop ids; ``vocab_size``: ids from it on are never sampled).
    ``max_tokens``: KV-cache capacity in tokens (rounded up to whole blocks of
    ``block_size_tokens``, at least one longest sequence; ``None``: all sequences at once).
    Raises ``RuntimeError`` where :func:`dynamic_engine_unavailable` gives a reason. The
    model is in eval mode during the call and restored after; every rank of the model
    replica must call it alike.
    """
    _check_sampling(max_new_tokens, temperature, top_p)
    reason = dynamic_engine_unavailable(model)
    if reason is not None:
        raise RuntimeError(reason)
    if (max_tokens is not None and max_tokens < 1) or block_size_tokens < 1:
        raise ValueError("max_tokens and block_size_tokens must be positive")
    device = next(model.parameters()).device
    buf, lengths = _pack_prompts(prompts, prompt_lengths, pad_id, device)
    stop_ids = _stop_list(eos_id)
    responses: list[list[int]] = [[] for _ in range(buf.shape[0])]
    if max_new_tokens > 0:
        responses = _generate(model, buf, lengths, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, stop_ids=stop_ids,
                              vocab_size=vocab_size, seed=seed, step=step, max_tokens=max_tokens,
                              block_size=block_size_tokens)  # fmt: skip
    cut = [truncate_at_stop(r, stop_ids) for r in responses]
    rollout = pack_rollout(buf, lengths, [c[0] for c in cut], [c[1] for c in cut], pad_id)
    rollout.log_probs = _policy_log_probs(model, rollout, max_tokens)
    return rollout

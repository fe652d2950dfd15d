"""Rollouts with a bounded KV cache: Megatron-Core's dynamic inference engine on the policy.

``generate_rollout_dynamic`` returns the same ``Rollout``
as ``generate_rollout``, but drives Megatron-Core's
``DynamicInferenceEngine`` (paged KV cache, continuous batching, chunked prefill) on the
*training model object itself* (no weight copy, no sync), as Megatron-LM's RL does. CUDA
and flash-attn only: ``dynamic_engine_unavailable`` says why not. The engine is built
through ``rollout.dynamic.mcore_engine`` (the one place that knows the installed
megatron-core's inference API). The engine flow, the KV-buffer arithmetic
(``kv_cache_tokens``), sampling (``StepSampler``: padded vocab rows never drawn,
several stop ids, TP-consistent draws), the log-prob recompute, TP/PP behaviour and the
model state kept around generation (eval mode, RoPE cache, FP8 casts): ``docs/rollouts.md``
("The dynamic engine").
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

import loggra_megatron.rollout.dynamic.mcore_engine as mcore_engine
from loggra_megatron.model.batching import needed_lengths
from loggra_megatron.model.log_probs import compute_log_probs
from loggra_megatron.rollout.generation_mode import generation_mode
from loggra_megatron.rollout.protocol import EngineTarget, RolloutRequest
from loggra_megatron.rollout.static.generate import (
    Rollout,
    _check_sampling,
    _pack_prompts,
    sample_tokens,
    sampling_generator,
)

__all__ = ["dynamic_engine_unavailable", "generate_rollout_dynamic"]

DEFAULT_BLOCK_SIZE = 256


def refusal(target: EngineTarget) -> str | None:
    """What the dynamic engine cannot run, from the settings alone (``None``: nothing): it
    needs CUDA, fp16/bf16 weights (flash-attn's paged kernels take nothing else), and no
    blockwise FP8 (whose weight workspace, first built under inference mode, keeps only the
    row-wise data training then needs)."""
    if not target.cuda:
        return "the dynamic engine needs CUDA (flash-attn paged attention)"
    if not target.half:
        return "flash-attn takes fp16/bf16 only: the dynamic engine needs --bf16"
    if target.fp8_recipe == "blockwise":
        return (
            "blockwise FP8 cannot run under the dynamic engine: its weight workspace, "
            "first built under inference mode, keeps only the row-wise data training "
            "needs; use --fp8-recipe tensorwise"
        )
    return None


def dynamic_engine_unavailable(model=None) -> str | None:
    """Why Megatron-Core's dynamic engine cannot run ``model`` on this process (``None``: it
    can): ``refusal``, then flash-attn's kernels and einops."""
    return refusal(EngineTarget.of_model(model)) or mcore_engine.missing_attention_kernels()


def truncate_at_stop(tokens: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], bool]:
    """``tokens`` up to and including the first stop id, and whether there was one."""
    stops = set(stop_ids)
    for i, tok in enumerate(tokens):
        if tok in stops:
            return list(tokens[: i + 1]), True
    return list(tokens), False


def pack_rollout(prompts: torch.Tensor, lengths: torch.Tensor, responses, stopped, pad_id: int):
    """A ``Rollout`` (zero log-probs) from right-padded ``prompts [B, P]``, their
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
    in chunked prefill, whose token is discarded). No step reads the device on the host: the
    substitutions are kept on the device and read once, by ``substituted``, after
    generation.
    """

    def __init__(self, *, temperature, top_p, vocab_size, generator, stop_ids, tp_group=None):
        self.temperature, self.top_p, self.vocab_size = temperature, top_p, vocab_size
        self.generator, self.tp_group = generator, tp_group
        self.termination_id = stop_ids[0] if stop_ids else -1
        self.other_stops = torch.tensor(stop_ids[1:], dtype=torch.long)
        self._hits: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """Per step with other stop ids: ``(request ids, sampled ids, substituted)``."""

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
        request_ids = request_ids.to(ids.device)
        hit = torch.isin(ids, self.other_stops.to(ids.device)) & (request_ids != skip_id)
        self._hits.append((request_ids, ids, hit))
        return torch.where(hit, torch.full_like(ids, self.termination_id), ids)

    @property
    def substituted(self) -> dict[int, int]:
        """``{request id: the stop id it really sampled}`` where the first was returned
        instead (one read of the device, after generation)."""
        if not self._hits:
            return {}
        rids, ids, hit = (torch.cat(t) for t in zip(*self._hits, strict=True))
        return dict(zip(rids[hit].tolist(), ids[hit].tolist(), strict=True))


def _plan(
    lengths: list[int],
    max_new_tokens: int,
    max_tokens: int | None,
    block_size: int,
    request_multiple: int = 1,
):
    """``(kv_blocks, max_requests, tokens_per_step)`` before Megatron's 64-token rounding.

    Requests in flight are as many as the blocks hold at full length (``⌈(P + N)/block⌉``
    blocks each), so that none is ever evicted and re-prefilled; a multiple of
    ``request_multiple`` (TP on megatron-core 0.17+, which asserts it), the blocks raised to
    hold that many where the budget holds fewer. A step's tokens are at most the prompts of
    the requests in flight (their prefill), within ``max_tokens``."""
    max_seq = max(lengths) + max_new_tokens
    need_all = sum(math.ceil((p + max_new_tokens) / block_size) for p in lengths)
    blocks, requests = need_all, len(lengths)
    if max_tokens is not None:
        blocks = min(need_all, math.ceil(max(max_tokens, max_seq) / block_size))
        per_request = math.ceil(max_seq / block_size)
        requests = min(requests, blocks // per_request)
        requests = max(request_multiple, requests // request_multiple * request_multiple)
        blocks = max(blocks, min(requests, len(lengths)) * per_request)
    # a step's tokens: at most the prefill of every request in flight (the longest prompts)
    in_flight = sum(sorted(lengths, reverse=True)[: min(requests, len(lengths))])
    step_tokens = in_flight if max_tokens is None else min(max_tokens, in_flight)
    return blocks, requests, max(step_tokens, requests)


def kv_cache_tokens(
    lengths: list[int],
    max_new_tokens: int,
    max_tokens: int | None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> int:
    """Tokens of the paged KV buffer the engine gets for prompts of ``lengths``."""
    return _plan(lengths, max_new_tokens, max_tokens, block_size)[0] * block_size


def _clear_rotary_cache(inner) -> None:
    forward = getattr(getattr(inner, "rotary_pos_emb", None), "forward", None)
    if hasattr(forward, "cache_clear"):
        forward.cache_clear()


def restore_forwards(modules, wrapped, before: set[int]) -> None:
    """Undo ``prepare_model_for_fp8_inference`` on ``modules`` it wrapped since ``before``
    (ids of those already wrapped): drop the instance ``forward`` and the set entry."""
    for module in modules:
        if module in wrapped and id(module) not in before:
            module.__dict__.pop("forward", None)
            wrapped.discard(module)


@contextlib.contextmanager
def _inference_state(model) -> Iterator[None]:
    """RoPE cache and FP8 state around generation (``docs/rollouts.md``)."""
    from megatron.core.utils import get_model_config, unwrap_model

    inner = unwrap_model(model)
    fp8 = bool(get_model_config(model).fp8) and hasattr(inner, "set_is_first_microbatch")
    wrapped = mcore_engine.fp8_inference_wrapped_modules()
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


def _decode_graphs(model, config, wanted: bool):
    """``mcore_engine.decode_graphs`` when the decode steps are to be CUDA graphs
    (``--rollout-cuda-graphs``, and no FP8 while generating: Transformer Engine's FP8 weight
    casts inside Megatron's captured layers are unverified here, so ``--rollout-fp8`` decodes
    eagerly, as in the static engine), else a no-op;
    a launch environment that makes the capture unsafe is said once and decodes eagerly."""
    if not wanted or config.fp8:
        return contextlib.nullcontext()
    hazard = mcore_engine.graph_register_hazard()
    if hazard is not None:
        _warn_once(hazard)
        return contextlib.nullcontext()
    return mcore_engine.decode_graphs(model, config)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _generate(
    model,
    prompts,
    lengths,
    *,
    max_new_tokens,
    temperature,
    top_p,
    stop_ids,
    vocab_size,
    seed,
    step,
    stream,
    max_tokens,
    block_size,
    cuda_graphs,
    graph_sizes,
    fp8,
) -> tuple[list[list[int]], int, int]:
    """The generated tokens of each prompt, the requests evicted and the KV buffer's bytes."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.utils import get_model_config

    lens = lengths.tolist()
    multiple = (
        ps.get_tensor_model_parallel_world_size() if mcore_engine.has_inference_config() else 1
    )
    blocks, max_requests, step_tokens = _plan(
        lens, max_new_tokens, max_tokens, block_size, multiple
    )
    plan = mcore_engine.EnginePlan(
        blocks=blocks,
        max_requests=max_requests,
        step_tokens=step_tokens,
        max_seq=max(lens) + max_new_tokens,
        block_size=block_size,
        cuda_graphs=graph_sizes,  # captured only inside _decode_graphs
    )
    generator = None
    if temperature > 0:
        generator = sampling_generator(seed, step, stream, prompts.device)
    sampler = StepSampler(
        temperature=temperature,
        top_p=top_p,
        vocab_size=vocab_size,
        generator=generator,
        stop_ids=stop_ids,
        tp_group=ps.get_tensor_model_parallel_group(),
    )
    greedy = temperature == 0
    params = SamplingParams(
        temperature=1.0 if greedy else float(temperature),
        top_k=1 if greedy else 0,
        top_p=0.0 if greedy or top_p >= 1.0 else float(top_p),
        num_tokens_to_generate=max_new_tokens,
        termination_id=sampler.termination_id,
    )
    config = get_model_config(model)
    with (
        generation_mode(model, fp8=fp8),
        _inference_state(model),
        _decode_graphs(model, config, cuda_graphs),  # config.fp8 as generating
    ):
        with mcore_engine.built_engine(model, config, plan, sampler, seed) as engine:
            for i, p in enumerate(lens):
                engine.add_request(i, prompts[i, :p].tolist(), params)
            generated = mcore_engine.run_engine(engine, len(lens))
            evicted = int(engine.evicted_request_count)
            kv_bytes = mcore_engine.kv_buffer_bytes(engine)
        # its KV cache was freed on leaving the block; dropped before the graphs' exit
        # collects garbage, so that the engine's own reference cycles go with it
        del engine
    for rid, tok in sampler.substituted.items():  # the stop id that was really sampled
        generated[rid][-1] = tok
    return [generated[i] for i in range(len(lens))], evicted, kv_bytes


def _policy_log_probs(
    model, rollout: Rollout, micro_batch_size: int, length_grouping: bool = True
) -> torch.Tensor:
    """Untempered log-probs of the rollout's response tokens on every rank (0 elsewhere), in
    forwards of ``micro_batch_size`` rows (``--log-prob-micro-batch-size``), rows of similar
    length together (``length_grouping``)."""
    from megatron.core import parallel_state as ps

    width = rollout.tokens.shape[1]
    log_probs = rollout.log_probs
    if width < 2 or not bool(rollout.response_mask.any()):
        return log_probs
    out = compute_log_probs(
        model,
        rollout.tokens,
        micro_batch_size=micro_batch_size,
        lengths=needed_lengths(rollout.response_mask),
        group=length_grouping,
    )
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
    request: RolloutRequest,
    *,
    prompt_lengths: torch.Tensor | None = None,
    block_size_tokens: int = DEFAULT_BLOCK_SIZE,
) -> Rollout:
    """Sample up to ``request.max_new_tokens`` tokens after each prompt with Megatron-Core's
    dynamic engine; see the module docstring.

    ``prompts`` as ``generate_rollout``'s. From ``request`` (``RolloutRequest``): sampling,
    stop ids, seeding; ``max_tokens``, the KV-cache capacity in tokens (rounded up to whole
    blocks of ``block_size_tokens``, at least one longest sequence; ``None``: all sequences at
    once); ``log_prob_micro_batch_size``, the rows per forward of the log-prob recompute after
    generation (the whole batch at once would hold ``B × L × V/TP`` fp32 logits), rows of
    similar length together (``length_grouping``); ``log_probs=False`` skips the recompute
    (the rollout's ``log_probs`` stay 0: π_old comes from the training forward). Raises
    ``RuntimeError`` where ``dynamic_engine_unavailable`` gives a reason. The model is in eval
    mode during the call and restored after; every rank of the model replica must call it
    alike.
    """
    r = request
    _check_sampling(r.max_new_tokens, r.temperature, r.top_p)
    reason = dynamic_engine_unavailable(model)
    if reason is not None:
        raise RuntimeError(reason)
    bound = 1 if r.max_tokens is None else r.max_tokens
    if min(block_size_tokens, r.log_prob_micro_batch_size, bound) < 1:
        raise ValueError("max_tokens, block_size_tokens, log_prob_micro_batch_size: positive")
    device = next(model.parameters()).device
    buf, lengths = _pack_prompts(prompts, prompt_lengths, r.pad_id)
    buf = buf.to(device)
    stop_ids = list(dict.fromkeys(int(i) for i in r.stop_ids))  # in order, no repeats
    responses: list[list[int]] = [[] for _ in range(buf.shape[0])]
    evicted, kv_bytes = 0, 0
    if r.max_new_tokens > 0:
        responses, evicted, kv_bytes = _generate(
            model,
            buf,
            lengths,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            stop_ids=stop_ids,
            vocab_size=r.vocab_size,
            seed=r.seed,
            step=r.step,
            stream=r.stream(),
            max_tokens=r.max_tokens,
            block_size=block_size_tokens,
            cuda_graphs=r.cuda_graphs,
            graph_sizes=r.decode_graph_sizes,
            fp8=r.fp8,
        )
    cut = [truncate_at_stop(resp, stop_ids) for resp in responses]
    rollout = pack_rollout(buf, lengths, [c[0] for c in cut], [c[1] for c in cut], r.pad_id)
    rollout.evicted_requests, rollout.kv_cache_bytes = evicted, kv_bytes
    if r.log_probs:
        rollout.log_probs = _policy_log_probs(
            model, rollout, r.log_prob_micro_batch_size, r.length_grouping
        )
    return rollout

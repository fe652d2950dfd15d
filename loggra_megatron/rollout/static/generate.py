"""KV-cached autoregressive sampling from a Megatron-Core ``GPTModel``.

``generate_rollout`` is Megatron's static-batch scheme: right-padded prompts, one prefill
of the shortest prompt (once per distinct prompt), then one token per step (finished rows
idle until the whole batch is done) through a static KV cache and, on a GPU, a captured
decode step (``rollout/static/decoder.py``), with the log-probs of the temperature-1 policy of
every sampled token. TP rank 0 samples from the TP-gathered last-token logits and broadcasts
the ``[B]`` ids over TP, the log-prob is vocab-parallel (three ``[B]`` all-reduces); under
PP each step runs stage by stage (one send/recv of ``[s, B, H]``) and the last stage
broadcasts the ids over PP. ``model.log_probs.compute_log_probs`` recomputes the same
log-probs with a forward-only schedule. Layout, sampling, the communication per step and why:
``docs/rollouts.md#the-static-engine``.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from loggra_megatron.model.vocab_parallel import vocab_parallel_log_probs
from loggra_megatron.rollout.generation_mode import generation_mode
from loggra_megatron.rollout.protocol import RolloutRequest
from loggra_megatron.rollout.static.decoder import StaticDecoder, stage_hidden_dtype

__all__ = [
    "Rollout",
    "generate_rollout",
    "sample_tokens",
    "sampling_generator",
]


@dataclass
class Rollout:
    """A batch of generated sequences (``B`` rows, ``L`` = longest prompt + response).

    ``tokens [B, L]`` int64: prompt, then response, then ``pad_id``.
    ``log_probs [B, L - 1]`` float32: ``log π(tokens[:, t + 1] | tokens[:, :t + 1])`` under the
    temperature-1 policy where ``response_mask`` is set, 0 elsewhere.
    ``response_mask [B, L - 1]`` bool: target ``tokens[:, t + 1]`` is a generated token.
    ``token_mask [B, L]`` bool: ``tokens[:, t]`` is a prompt or generated token (not padding).
    ``prompt_lengths``, ``response_lengths [B]`` int64 (a stop token counts as generated).
    ``truncated [B]`` bool: stopped by ``max_new_tokens`` rather than by a stop token.
    ``decode_steps``: forwards of the decode loop (prefill included); ``host_syncs``: its reads
    of device values on the host; ``prefill_tokens``: prompt tokens its prefill ran, once per
    distinct prompt (the static engine counts them; 0 for an engine that does not).
    ``evicted_requests``: requests the engine evicted from its KV cache and prefilled again
    (the dynamic engine; None for an engine that never evicts).
    ``kv_cache_bytes``: bytes of the KV cache it generated with on this rank, measured on the
    engine's buffers (None: not measured).
    """

    tokens: torch.Tensor
    log_probs: torch.Tensor
    response_mask: torch.Tensor
    token_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    truncated: torch.Tensor
    decode_steps: int = 0
    host_syncs: int = 0
    prefill_tokens: int = 0
    evicted_requests: int | None = None
    kv_cache_bytes: int | None = None


def sampling_generator(
    seed: int, step: int, rank: int, device=None, chunk: int = 0
) -> torch.Generator:
    """A generator seeded by a hash of ``(seed, step, rank[, chunk])`` (stable across runs
    and platforms; chunk 0 is the stream of an unchunked rollout)."""
    key = f"{seed}/{step}/{rank}" + (f"/{chunk}" if chunk else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    gen = torch.Generator(device=device if device is not None else "cpu")
    gen.manual_seed(int.from_bytes(digest, "little") >> 1)  # 63 bits: manual_seed wants int64
    return gen


def sample_tokens(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one id per row of full-vocabulary ``logits [B, V]`` (``temperature=0``: greedy)."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass *before* it is below top_p: the top token always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    from megatron.core import parallel_state as ps

    if max_new_tokens < 0 or temperature < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError("need max_new_tokens >= 0, temperature >= 0 and 0 < top_p <= 1")
    if ps.get_context_parallel_world_size() > 1:
        raise NotImplementedError("generate_rollout() does not support context parallelism")


def _pack_prompts(prompts, prompt_lengths, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, P]`` int64 prompts (``pad_id`` after each) and ``[B]`` lengths, on
    the host."""
    if isinstance(prompts, torch.Tensor):
        tokens = prompts.to(device="cpu", dtype=torch.long)
        full = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long)
        lengths = full if prompt_lengths is None else torch.as_tensor(prompt_lengths).long().cpu()
    else:
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        tokens = torch.zeros(len(prompts), max([0, *lengths.tolist()]), dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
    if tokens.ndim != 2 or lengths.shape != tokens.shape[:1] or tokens.shape[0] == 0:
        raise ValueError("need a non-empty [B, P] batch of prompts and [B] prompt lengths")
    if int(lengths.min()) < 1 or int(lengths.max()) > tokens.shape[1]:
        raise ValueError("prompt lengths must be in [1, P]")
    tokens = tokens[:, : int(lengths.max())]
    tokens = tokens.masked_fill(torch.arange(tokens.shape[1]) >= lengths.unsqueeze(1), pad_id)
    return tokens, lengths  # on the host: the decode loop reads the lengths, the prefill rows


def _stage_forward(model, decoder, tokens: torch.Tensor, offset: int, pp_group, hidden_dtype):
    """Forward ``tokens [b, s]`` (positions ``offset ..``) through this pipeline stage.

    Receives ``[s, b, H]`` hidden states from the previous stage and sends this stage's output
    to the next one. With a ``StaticDecoder``, one token
    per row of the whole batch is a decode step (a step graph), more is a prefill; without
    one, Megatron's whole forward of the prefix (``offset`` 0; the uncached reference).
    Returns the (TP-gathered) logits of the last position ``[b, V]`` on the last stage,
    ``None`` elsewhere.
    """
    from megatron.core.inference.communication_utils import (
        recv_from_prev_pipeline_rank_,
        send_to_next_pipeline_rank,
    )
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    batch, seq = tokens.shape
    first = pp_group.rank() == 0
    last = pp_group.rank() == pp_group.size() - 1
    decode = decoder is not None and seq == 1 and batch == decoder.batch
    recv = None
    if not first:
        recv = decoder.hidden_in if decode else None
        if recv is None:
            hidden = get_model_config(model).hidden_size
            recv = torch.empty((seq, batch, hidden), dtype=hidden_dtype, device=tokens.device)
        recv_from_prev_pipeline_rank_(recv, pp_group)
    ids = tokens if first else None
    if decode:
        out = decoder.decode(ids, offset)
    else:
        get_attr_wrapped_model(model, "set_input_tensor")(recv)
        if decoder is not None:
            out = decoder.forward(ids, offset, seq)
        else:
            positions = torch.arange(seq, device=tokens.device).expand(batch, seq)
            out = model(tokens, positions, None, runtime_gather_output=True)
            out = out[:, -1, :].float() if last else out
    if not last:
        send_to_next_pipeline_rank(out.to(hidden_dtype).contiguous(), pp_group)
    return out if last else None


def _next_tokens(logits, next_ids, *, temperature, top_p, generator, vocab_size):
    """On the last stage: TP rank 0 samples from the gathered ``[B, V]`` logits (rows from
    ``vocab_size`` on masked out) and broadcasts the ids over TP; every TP rank computes
    their untempered log-probs from its own vocabulary shard. Returns ``(ids, log-probs)``."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if tp_rank == 0:
        allowed = logits if vocab_size is None else logits[:, :vocab_size]
        next_ids = sample_tokens(allowed, temperature, top_p, generator)
    if tp > 1:
        dist.broadcast(next_ids, src=ps.get_tensor_model_parallel_src_rank(), group=tp_group)
    shard = logits.shape[-1] // tp
    local = logits[:, tp_rank * shard : (tp_rank + 1) * shard]
    return next_ids, vocab_parallel_log_probs(local, next_ids, tp_group)


@torch.no_grad()
def generate_rollout(
    model,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    request: RolloutRequest,
    *,
    prompt_lengths: torch.Tensor | None = None,
    chunk: int = 0,
    use_kv_cache: bool = True,
    share_prefill: bool = True,
    decoder: StaticDecoder | None = None,
) -> Rollout:
    """Sample up to ``request.max_new_tokens`` tokens after each prompt
    (``docs/rollouts.md``); ``request``: sampling, stop ids, seeding, FP8 row padding and CUDA
    graphs (``RolloutRequest``; its KV-cache bound is ``generate_chunked``'s).

    ``model`` is this rank's ``GPTModel`` stage (optionally wrapped in DDP / Float16Module);
    it is put in eval mode and restored. ``prompts`` is a list of token-id lists, or a
    right-padded ``[B, P]`` tensor with ``prompt_lengths [B]`` (default: all ``P``).
    ``chunk``: index of this batch in a chunked rollout (its own sampling stream). For tests
    and benchmarks: ``use_kv_cache=False`` recomputes the whole prefix every step, and
    ``share_prefill=False`` prefills every row instead of each distinct prompt once.
    ``decoder``: a ``StaticDecoder`` the caller made and attached inside its
    ``generation_mode``, reused across calls with its KV cache and captured step graphs
    (``generate_chunked``: one per rollout); the batch is filled with finished rows up to its
    ``batch``. None: this call enters the mode and makes one.
    """
    from megatron.core import parallel_state as ps

    r = request
    _check_sampling(r.max_new_tokens, r.temperature, r.top_p)
    device = next(model.parameters()).device
    buf, lengths = _pack_prompts(prompts, prompt_lengths, r.pad_id)
    real_rows = buf.shape[0]
    rows = -(-real_rows // r.row_multiple) * r.row_multiple
    if decoder is not None:
        _check_fits(decoder, real_rows, buf.shape[1] + r.max_new_tokens)
        rows = decoder.batch
    buf, lengths = _fill_rows(buf, lengths, rows)
    shared = _shared_prefill(buf, lengths) if use_kv_cache and share_prefill else None
    state = _DecodeState.start(buf.to(device), lengths, real_rows, r.max_new_tokens, r.pad_id)
    if shared is not None:
        state.prefill = (shared[0].to(device), shared[1].to(device))
    stop_ids = torch.as_tensor(r.stop_ids, dtype=torch.long, device=device)
    tp_group = ps.get_tensor_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    last = pp_group.rank() == pp_group.size() - 1
    generator = None
    if last and dist.get_rank(tp_group) == 0 and r.temperature > 0:
        generator = sampling_generator(r.seed, r.step, r.stream(), device, chunk)
    sample = partial(
        _next_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        generator=generator,
        vocab_size=r.vocab_size,
    )
    batch, total = state.buf.shape
    with contextlib.ExitStack() as owned:
        if decoder is None:  # else the caller's, attached in its generation_mode
            owned.enter_context(generation_mode(model, fp8=r.fp8))
            if use_kv_cache:
                made = StaticDecoder(model, batch, total, cuda_graphs=r.cuda_graphs)
                decoder = owned.enter_context(made.attached())
        _decode(model, state, sample, stop_ids, decoder, pp_group)
    if pp_group.size() > 1:
        src = dist.get_process_group_ranks(pp_group)[-1]
        dist.broadcast(state.log_probs, src=src, group=pp_group)
    return state.rollout(real_rows)


def _check_fits(decoder: StaticDecoder, rows: int, length: int) -> None:
    if rows > decoder.batch or length > decoder.capacity:
        raise ValueError(
            f"{rows} rows of up to {length} tokens do not fit the decoder's "
            f"{decoder.batch} rows of {decoder.capacity} positions"
        )


def _fill_rows(buf, lengths, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``buf`` and ``lengths`` with finished rows appended up to ``rows``: copies of the
    longest prompt, which fill the GEMMs (FP8's row multiple, a reused decoder's batch)
    without a shorter prefill."""
    extra = rows - buf.shape[0]
    if not extra:
        return buf, lengths
    longest = int(lengths.argmax())  # host lengths: no sync
    buf = torch.cat([buf, buf[longest].expand(extra, -1)])
    return buf, torch.cat([lengths, lengths[longest].expand(extra)])


def _shared_prefill(buf, lengths) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows [U], index [B])`` where rows share the prefill's tokens (the shortest prompt's
    length; a GRPO group's rows share the whole prompt): the first row of each distinct prefix
    and, per row, its prefix's position in ``rows``; None if every prefix differs. On the host,
    before the tokens go to the device."""
    first: dict[tuple[int, ...], int] = {}
    prefixes = buf[:, : int(lengths.min())].tolist()
    index = [first.setdefault(tuple(p), len(first)) for p in prefixes]
    if len(first) == len(index):
        return None
    rows = [index.index(u) for u in range(len(first))]
    return torch.tensor(rows), torch.tensor(index)


@dataclass
class _DecodeState:
    """What the decode loop reads and writes, per row (``B``) and position (``L``)."""

    buf: torch.Tensor  # [B, L] prompts, then samples, then pad_id
    lengths: torch.Tensor  # [B] prompt lengths (device)
    shortest: int  # the shortest prompt, known on the host
    max_new_tokens: int
    log_probs: torch.Tensor  # [B, L - 1] of the targets tokens[:, t + 1]
    response_mask: torch.Tensor  # [B, L - 1]
    gen_len: torch.Tensor  # [B] generated tokens
    done: torch.Tensor  # [B] finished (fill rows are from the start)
    stopped: torch.Tensor  # [B] by a stop token
    steps: int = 0  # decode-loop forwards
    host_syncs: int = 0  # reads of device values on the host
    prefill: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, index): _shared_prefill
    prefill_tokens: int = 0  # tokens the prefill ran

    @classmethod
    def start(cls, buf, lengths, real_rows: int, max_new_tokens: int, pad_id: int):
        """``lengths``: ``[B]`` prompt lengths on the host."""
        batch, device = buf.shape[0], buf.device
        shortest, total = int(lengths.min()), int(lengths.max()) + max_new_tokens
        buf = torch.cat([buf, buf.new_full((batch, max_new_tokens), pad_id)], dim=1)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        done[real_rows:] = True
        return cls(
            buf=buf,
            lengths=lengths.to(device),
            shortest=shortest,
            max_new_tokens=max_new_tokens,
            log_probs=torch.zeros(batch, total - 1, dtype=torch.float32, device=device),
            response_mask=torch.zeros(batch, total - 1, dtype=torch.bool, device=device),
            gen_len=torch.zeros(batch, dtype=torch.long, device=device),
            done=done,
            stopped=torch.zeros(batch, dtype=torch.bool, device=device),
        )

    def record(self, t: int, next_ids, lp, stop_ids) -> None:
        """Position ``t`` takes ``next_ids`` in the rows past their prompt and not finished
        (``lp``: their log-probs, ``None`` off the last stage)."""
        active = (self.lengths <= t) & ~self.done  # rows whose token at t is a sample
        self.buf[:, t] = torch.where(active, next_ids, self.buf[:, t])
        self.response_mask[:, t - 1] = active
        if lp is not None:
            self.log_probs[:, t - 1] = torch.where(active, lp, 0.0)
        self.gen_len += active.long()
        hit_stop = active & torch.isin(next_ids, stop_ids)
        self.stopped |= hit_stop
        self.done |= hit_stop | (self.gen_len >= self.max_new_tokens)

    def rollout(self, n: int) -> Rollout:
        """The ``Rollout`` of the first ``n`` rows, cut to the longest finished one."""
        lengths, gen_len = self.lengths[:n], self.gen_len[:n]
        seq_len = lengths + gen_len
        width = int(seq_len.max())
        self.host_syncs += 1
        positions = torch.arange(width, device=self.buf.device)
        return Rollout(
            tokens=self.buf[:n, :width].contiguous(),
            log_probs=self.log_probs[:n, : width - 1].contiguous(),
            response_mask=self.response_mask[:n, : width - 1].contiguous(),
            token_mask=positions.unsqueeze(0) < seq_len.unsqueeze(1),
            prompt_lengths=lengths,
            response_lengths=gen_len,
            truncated=~self.stopped[:n],
            decode_steps=self.steps,
            host_syncs=self.host_syncs,
            prefill_tokens=self.prefill_tokens,
        )


STOP_CHECK_INTERVAL = 16
"""Decode steps between two reads of "every row is done" on the host: the loop's only host
sync (prompt lengths are known on the host), so at most ``STOP_CHECK_INTERVAL − 1`` steps
run after the last row finished; they change nothing (finished rows are not written)."""


def _decode(model, state: _DecodeState, sample, stop_ids, decoder, pp_group) -> None:
    """Prefill, then one token per step until every row is done (on all ranks together:
    the last stage broadcasts the ids over PP). Reads the device on the host once every
    ``STOP_CHECK_INTERVAL`` steps."""
    from megatron.core.utils import get_model_config

    dtype = stage_hidden_dtype(get_model_config(model))
    pp = pp_group.size()
    last = pp_group.rank() == pp - 1
    pp_last_rank = dist.get_process_group_ranks(pp_group)[-1]
    buf = state.buf
    batch, total = buf.shape
    forward = partial(_stage_forward, model, decoder, pp_group=pp_group, hidden_dtype=dtype)
    start, t = 0, state.shortest
    while t < total and state.max_new_tokens > 0:
        if state.steps % STOP_CHECK_INTERVAL == 0:
            state.host_syncs += 1
            if bool(state.done.all()):
                break
        state.steps += 1
        lo = start if decoder is not None else 0
        if state.steps == 1 and state.prefill is not None:  # one prefill per distinct prompt
            rows, index = state.prefill
            logits = forward(buf[rows, :t], 0)
            decoder.share_prefix(index, t)
            logits = logits.index_select(0, index) if last else None
            state.prefill_tokens += len(rows) * t
        else:
            logits = forward(buf[:, lo:t], lo)
            state.prefill_tokens += batch * t if state.steps == 1 else 0
        next_ids, lp = torch.empty(batch, dtype=torch.long, device=buf.device), None
        if last:
            next_ids, lp = sample(logits, next_ids)
        if pp > 1:
            dist.broadcast(next_ids, src=pp_last_rank, group=pp_group)
        state.record(t, next_ids, lp, stop_ids)
        start, t = t, t + 1

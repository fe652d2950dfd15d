"""Chunked token log-probs (model/output_head.py): the values and gradients of the unchunked
log-softmax, from a float64 reference and from the model's own logits, at TP=2 (with
sequence parallelism) and PP=2; and the memory a chunk holds."""

import pytest
import torch

from loggra_megatron.model.output_head import chunked_token_log_probs
from loggra_megatron.testing import run_distributed, tiny_gpt_model

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

N, H, V = 37, 16, 50


def _inputs(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64).to(dtype)
    weight = (0.5 * torch.randn(V, H, generator=gen, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def _reference(hidden, weight, targets):
    logp = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk", [1, 5, N, 1024])
def test_values_and_gradients_equal_the_float64_log_softmax(chunk):
    hidden, weight, targets = _inputs(torch.float32)
    g = torch.randn(N, generator=torch.Generator().manual_seed(1))
    out = chunked_token_log_probs(hidden, weight, targets, chunk)
    assert out.dtype == torch.float32
    out.backward(g)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    expected = _reference(h64, w64, targets)
    expected.backward(g.double())
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=0, atol=1e-5)


def test_bf16_weights_get_a_bf16_gradient_accumulated_in_fp32():
    hidden, weight, targets = _inputs(torch.bfloat16)
    out = chunked_token_log_probs(hidden, weight, targets, 4)
    out.sum().backward()
    assert weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    _reference(h64, w64, targets).sum().backward()
    # one bf16 rounding of the accumulated sum, not one per chunk
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-2, atol=1e-2)


def test_a_chunk_holds_only_its_own_logits():
    """No allocation during the forward or the backward reaches ``tokens × V`` floats: the
    largest is a chunk's ``[c, V]`` fp32 (or the ``[V, h]`` weight gradient)."""
    n, h, v, chunk = 512, 8, 1000, 32
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    sizes = []

    class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                sizes.append(out.numel())
            return out

    with Allocations():
        chunked_token_log_probs(hidden, weight, targets, chunk).sum().backward()
    assert max(sizes) == max(chunk * v, v * h)
    assert max(sizes) < n * v // 4


# ---------------------------------------------------------------- TP over the vocabulary
def _tp_shard(rank):
    import torch.distributed as dist

    hidden, weight, targets = _inputs(torch.float32)
    shard = weight.detach()[rank * V // 2 : (rank + 1) * V // 2].clone().requires_grad_()
    out = chunked_token_log_probs(hidden, shard, targets, 6, dist.group.WORLD)
    out.sum().backward()
    grad_hidden = hidden.grad.clone()
    dist.all_reduce(grad_hidden)  # the region's backward: summed over TP
    return out.detach(), grad_hidden, shard.grad


def test_vocab_parallel_shards_give_the_whole_vocabularys_values_and_gradients():
    hidden, weight, targets = _inputs(torch.float32)
    whole = chunked_token_log_probs(hidden, weight, targets, 6)
    whole.sum().backward()
    ranks = run_distributed(_tp_shard, 2)
    for rank, (out, grad_hidden, grad_shard) in enumerate(ranks):
        torch.testing.assert_close(out, whole.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(grad_hidden, hidden.grad, rtol=0, atol=1e-6)
        rows = slice(rank * V // 2, (rank + 1) * V // 2)
        torch.testing.assert_close(grad_shard, weight.grad[rows], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- the model's own logits
VOCAB, SEQ, ROWS = 64, 8, 4


def _tokens():
    return torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))


def _against_the_models_logits(rank, chunk, sequence_parallel):
    """Chunked log-probs and the parameter gradients of their sum, against the model's
    unchunked logits and Megatron's vocab-parallel log-softmax of them (same weights)."""
    from megatron.core import parallel_state as ps

    from loggra_megatron.model.forward import gpt_forward, last_hidden, positions_like
    from loggra_megatron.model.vocab_parallel import vocab_parallel_log_probs

    kw = {}
    if (
        sequence_parallel
    ):  # Transformer Engine's spec, as CPU stand-ins (tests/helpers/gpu_standins.py)
        import gpu_standins

        gpu_standins.install_transformer_engine()
        kw = dict(use_te=True, sequence_parallel=True)
    model = tiny_gpt_model(
        vocab=VOCAB,
        seq=SEQ,
        share_embeddings=True,
        use_cpu_initialization=True,
        log_prob_chunk_size=chunk,
        **kw,
    )
    batch = {"tokens": _tokens()}
    x = batch["tokens"][:, :-1]
    tp = ps.get_tensor_model_parallel_group()
    ref = vocab_parallel_log_probs(model(x, positions_like(x), None), batch["tokens"][:, 1:], tp)
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = last_hidden(model, batch, gpt_forward(model, batch)).log_probs()
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return ref.detach(), out.detach(), ref_grads, grads


@pytest.mark.parametrize(
    ("tp", "sequence_parallel"), [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-sp"]
)
def test_the_models_log_probs_and_gradients_are_todays(tp, sequence_parallel):
    for ref, out, ref_grads, grads in run_distributed(
        _against_the_models_logits, tp, 3, sequence_parallel, tp=tp
    ):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
        assert ref_grads.keys() == grads.keys()
        for name, grad in grads.items():  # tied embeddings: both uses reach the weight
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def _pipelined(rank):
    from megatron.core import parallel_state as ps

    from loggra_megatron.model.forward import positions_like, run_schedule
    from loggra_megatron.model.log_probs import compute_log_probs
    from loggra_megatron.model.vocab_parallel import vocab_parallel_log_probs

    model = tiny_gpt_model(vocab=VOCAB, seq=SEQ, use_cpu_initialization=True, log_prob_chunk_size=5)
    tokens = _tokens()
    chunked = compute_log_probs(model, tokens, micro_batch_size=2)

    def logits_step(data_iterator, m):
        b = next(data_iterator)
        x = b["tokens"][:, :-1]
        targets = b["tokens"][:, 1:]
        return m(
            x, positions_like(x), None
        ), lambda z, non_loss_data=True: vocab_parallel_log_probs(
            z, targets, ps.get_tensor_model_parallel_group()
        )

    micro = [{"tokens": tokens[i : i + 2]} for i in (0, 2)]
    with torch.no_grad():
        ref = run_schedule(model, logits_step, micro, forward_only=True, collect_non_loss_data=True)
    if not ps.is_pipeline_last_stage():
        return None
    return chunked, torch.cat(ref)


def test_pipelined_log_probs_are_todays():
    results = [r for r in run_distributed(_pipelined, 2, pp=2) if r is not None]
    assert len(results) == 1
    chunked, ref = results[0]
    torch.testing.assert_close(chunked, ref, rtol=0, atol=1e-6)


def _grad_strides_into_the_final_norm(rank):
    from loggra_megatron.model.forward import gpt_forward, last_hidden

    model = tiny_gpt_model(vocab=VOCAB, seq=SEQ, use_cpu_initialization=True)
    seen = []
    model.decoder.final_layernorm.register_full_backward_hook(
        lambda module, grad_input, grad_output: seen.append(grad_output[0])
    )
    batch = {"tokens": _tokens()[:1]}  # b = 1: the [s, 1, h] gradient
    last_hidden(model, batch, gpt_forward(model, batch)).log_probs().sum().backward()
    (grad,) = seen
    return tuple(grad.shape), grad.stride()


def test_the_gradient_reaching_the_decoder_is_row_major():
    """With one row per micro-batch the transpose after the output layer hands back a
    ``[s, 1, h]`` gradient whose size-1 dimension has stride ``s·h``; a frozen linear layer's
    ``grad.matmul(weight)`` then expands its weight to ``[s, m, n]`` (measured: 22 MiB at
    hidden 256), and ``contiguous()`` does not fix it."""
    ((shape, stride),) = run_distributed(_grad_strides_into_the_final_norm, 1)
    s, b, h = shape
    assert b == 1 and stride == (b * h, h, 1)


def _ddp_main_grads(rank, tied):
    """DDP's ``main_grad`` after the chunked log-probs' backward vs after the model's own
    logits' (same weights): untied, the output weight's chunks go straight into it."""
    from megatron.core import parallel_state as ps

    from loggra_megatron.model.forward import gpt_forward, last_hidden, positions_like
    from loggra_megatron.model.vocab_parallel import vocab_parallel_log_probs
    from loggra_megatron.testing import wrap_ddp

    model = tiny_gpt_model(
        vocab=VOCAB,
        seq=SEQ,
        share_embeddings=tied,
        use_cpu_initialization=True,
        log_prob_chunk_size=5,
    )
    ddp = wrap_ddp(model)
    batch = {"tokens": _tokens()}
    x = batch["tokens"][:, :-1]
    tp = ps.get_tensor_model_parallel_group()
    grads = []
    for chunked in (False, True):
        ddp.zero_grad_buffer()
        if chunked:
            out = last_hidden(ddp, batch, gpt_forward(ddp, batch))
            log_probs = out.log_probs()
        else:
            log_probs = vocab_parallel_log_probs(
                ddp(x, positions_like(x), None), batch["tokens"][:, 1:], tp
            )
        log_probs.sum().backward()
        ddp.finish_grad_sync()
        grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
    return grads, out.into_main_grad


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_ddp_main_grads_are_todays(tied):
    for (ref, chunked), fused in run_distributed(_ddp_main_grads, 1, tied):
        assert fused is not tied  # the tied weight's embedding gradient must reach .grad
        for name, grad in chunked.items():
            torch.testing.assert_close(grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_default_chunk_holds_at_most_2_to_the_22_logits_of_the_shard():
    from loggra_megatron.model.config import log_prob_chunk_tokens

    assert log_prob_chunk_tokens(64, 10**6) == 64  # a given --log-prob-chunk-size is kept
    for vocab in (50, 16128, 16384, 16385, 32000, 129024, 152064, 10**7):
        c = log_prob_chunk_tokens(None, vocab)
        assert c in (16, 32, 64, 128, 256) and (c in (16, 256) or c * vocab <= 1 << 22)
        assert c in (16, 256) or 2 * c * vocab > 1 << 22  # the largest that fits
    assert log_prob_chunk_tokens(None, 10**7) == 16  # never below 16 tokens
    assert log_prob_chunk_tokens(None, 16128) == 256  # the 27B example's shard at TP 8
    assert log_prob_chunk_tokens(None, 32000) == 128


def _built_chunk(rank):
    from loggra_megatron.model.output_head import LOG_PROB_CHUNK

    default = tiny_gpt_model(vocab=40000, use_cpu_initialization=True)
    given = tiny_gpt_model(vocab=40000, use_cpu_initialization=True, log_prob_chunk_size=7)
    return getattr(default, LOG_PROB_CHUNK), getattr(given, LOG_PROB_CHUNK)


@pytest.mark.parametrize("tp,chunk", [(1, 64), (2, 128)])
def test_build_gpt_model_sizes_the_default_chunk_by_this_ranks_vocabulary(tp, chunk):
    """40000 entries: 2^22 / 40000 → 64 tokens at TP 1; 20000 per rank → 128 at TP 2."""
    for default, given in run_distributed(_built_chunk, tp, tp=tp):
        assert (default, given) == (chunk, 7)

"""``loggra_megatron.rollout.dynamic.generate``: Megatron-Core's dynamic inference engine as a rollout
engine with a bounded KV cache.

On CPU (megatron-core 0.16.1, ``loggra_megatron.cpu``'s CPU mode) the engine does *not* run:
1. ``TextGenerationController.__init__`` (``text_generation_controller.py:75``) calls
   ``torch.Generator(device=torch.cuda.current_device())``: ``RuntimeError: Cannot access
   accelerator device when none is available.`` A redirect fixes it (a type, not a torch
   function: the CPU mode's ``TorchFunctionMode`` never sees it).
2. The first forward, ``Attention.forward`` (``transformer/attention.py:926``), asserts
   flash-attn: ``ModuleNotFoundError: No module named 'flash_attn'`` (``core/utils.py:378``,
   ``get_fa_version_str``). Fundamental: in 0.16.1 only flash-attn's paged CUDA kernels read
   the paged KV cache, and flash-attn has no CPU build. (Next: ``einops.rearrange``,
   attention.py:1178, and under PP ``communication_utils._is_cuda`` on the logits.)

The ``*_documented_failure`` tests pin that chain. The other engine tests run the *real*
engine, scheduler and driver on CPU, a bf16 model, with ``tests/helpers/gpu_standins.py``'s
flash-attn stand-in (plain-PyTorch paged attention with flash-attn's input checks), the
Generator redirect, the Triton KV append off and a no-op ``_is_cuda``, against the static
engine on the same weights (TP=1, TP=2, PP=2). The ``gpu`` test runs the real kernels.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import subprocess
import sys
import traceback

import pytest
import torch
from megatron.core.package_info import __version__ as MCORE_VERSION

from loggra_megatron.model.batching import needed_lengths
from loggra_megatron.rollout import RolloutRequest, generate_rollout
from loggra_megatron.rollout.dynamic.generate import (
    StepSampler,
    _plan,
    dynamic_engine_unavailable,
    generate_rollout_dynamic,
    pack_rollout,
    restore_forwards,
    truncate_at_stop,
)
from loggra_megatron.rollout.static.chunking import kv_cache_bytes
from loggra_megatron.testing import (
    run_distributed,
    tensor_bytes_left_in_cycles,
    tiny_bf16_gpt_model,
    tiny_gpt_model,
)

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

VOCAB, MAX_SEQ, NEW, PAD, BLOCK = 64, 32, 6, 0, 256  # flash-attn pages: multiples of 256
PROMPTS = [[5, 9, 17], [3, 4, 5, 6, 7], [60, 2], [11, 12, 13, 14]]
# torch's CPU build / a CUDA build on a machine without a driver
GEN_ERRORS = {
    ("RuntimeError", "Cannot access accelerator device when none is available"),
    (
        "AcceleratorError",
        "CUDA error: CUDA driver version is insufficient for CUDA runtime version",
    ),
}
GEN_LINES = {"0.16.1": 75, "0.19.2": 251}  # TextGenerationController.__init__: torch.Generator
FA_ERROR = ("ModuleNotFoundError", "No module named 'flash_attn'")


# ---------------------------------------------------------------- the documented CPU failure


def _describe(exc: BaseException) -> dict:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "megatron/core/" in f.filename]
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "frames": [(f.filename.split("megatron/core/")[-1], f.name, f.lineno) for f in frames],
    }


def _failure_worker(rank: int) -> dict:
    import gpu_standins

    import loggra_megatron.rollout.dynamic.generate as dynamic

    model = tiny_gpt_model(2, 32, 4, VOCAB, MAX_SEQ, use_cpu_initialization=True)
    model.train()
    out = {"reason": dynamic.dynamic_engine_unavailable(model)}
    dynamic.dynamic_engine_unavailable = lambda model=None: None  # go on into Megatron
    for key in ("as_is", "generator_redirected"):
        if key == "generator_redirected":
            gpu_standins.install_generator_redirect()
        try:
            generate_rollout_dynamic(  # (with graphs: torch.cuda.graph_pool_handle first)
                model, PROMPTS, RolloutRequest(max_new_tokens=2, temperature=0.0, cuda_graphs=False)
            )
            out[key] = None
        except Exception as exc:
            out[key] = _describe(exc)
        out[key + "_training"] = model.training
    return out


@pytest.fixture(scope="module")
def cpu_failure():
    return run_distributed(_failure_worker, 1)[0]


def _is_fa_error(err: dict) -> bool:
    frames = [(path, name) for path, name, _ in err["frames"]]
    return (
        (err["type"], err["message"]) == FA_ERROR
        and ("transformer/attention.py", "forward") in frames
        and frames[-1] == ("utils.py", "get_fa_version_str")
    )


def test_cpu_documented_failure_generator(cpu_failure):
    """Without help the engine fails on the CUDA Generator -- or, once the CPU mode redirects
    ``torch.Generator``, at the flash-attn check (then update this module's docstring)."""
    assert "needs CUDA" in cpu_failure["reason"]  # what generate_rollout_dynamic raises first
    err = cpu_failure["as_is"]
    assert err is not None, "the dynamic engine ran on CPU: update docs and tests"
    if not _is_fa_error(err):
        head = err["message"].splitlines()[0].rstrip(".")
        assert (err["type"], head) in GEN_ERRORS, err
        path, name, line = err["frames"][-1]
        assert (path, name) == (
            "inference/text_generation_controllers/text_generation_controller.py",
            "__init__",
        ), err
        assert line == GEN_LINES.get(MCORE_VERSION, line), err
    assert cpu_failure["as_is_training"]


def test_cpu_documented_failure_flash_attn(cpu_failure):
    """Past the Generator, the dynamic attention needs flash-attn: fundamental on CPU."""
    err = cpu_failure["generator_redirected"]
    assert err is not None, "the dynamic engine ran on CPU: update docs and tests"
    assert _is_fa_error(err), err
    if MCORE_VERSION == "0.16.1":  # the lines of the module docstring
        lines = {(path, name): line for path, name, line in err["frames"]}
        assert lines[("transformer/attention.py", "forward")] == 926, err
        assert lines[("utils.py", "get_fa_version_str")] == 378, err
    assert cpu_failure["generator_redirected_training"]


# ---------------------------------------------------------------- the engine on CPU (double)


def _load_pp_stage(model, full_state: dict) -> None:
    from megatron.core import parallel_state as ps

    model = getattr(model, "module", model)  # Float16Module -> GPTModel
    per_stage = len(model.decoder.layers)
    offset = ps.get_pipeline_model_parallel_rank() * per_stage
    state = {}
    for key in model.state_dict():
        src = key
        if key.startswith("decoder.layers."):
            _, _, idx, rest = key.split(".", 3)
            src = f"decoder.layers.{int(idx) + offset}.{rest}"
        state[key] = full_state[src]
    model.load_state_dict(state, strict=True)


def _graph_facts(model, streams, stream, tracker) -> dict:
    """What a rollout with CUDA graphs must leave behind: nothing of them."""
    import cuda_graph_standin
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.cuda_graphs import CudaGraphManager, _CudagraphGlobalRecord
    from megatron.core.utils import get_model_config, unwrap_model

    layers = unwrap_model(model).decoder.layers
    return {
        "managers": sum(hasattr(layer, "cudagraph_manager") for layer in layers),
        "live_graphs": len(cuda_graph_standin.live_graphs()),
        "records": len(_CudagraphGlobalRecord.cudagraph_inference_record),
        "pool": CudaGraphManager.global_mempool,
        "impl": get_model_config(model).cuda_graph_impl,
        "tracker": random.get_cuda_rng_tracker() is tracker,
        "stream": streams.current is stream,
    }


def _worker(rank: int, full_state: dict | None = None) -> dict:
    import cuda_graph_standin
    import gpu_standins
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    import loggra_megatron.rollout.dynamic.generate as dynamic
    import loggra_megatron.rollout.dynamic.mcore_engine as mcore_engine

    gpu_standins.install_flash_attn()
    streams = cuda_graph_standin.install()  # every case decodes through CUDA graphs
    stream, tracker = streams.current, random.get_cuda_rng_tracker()
    dynamic.dynamic_engine_unavailable = lambda model=None: None  # CPU, with the stand-ins
    log_prob_rows = []
    compute = dynamic.compute_log_probs

    def rows_spy(model, tokens, micro_batch_size, **kw):  # rows per forward of the recompute
        log_prob_rows.append(micro_batch_size)
        return compute(model, tokens, micro_batch_size=micro_batch_size, **kw)

    dynamic.compute_log_probs = rows_spy
    run, last_run = mcore_engine.run_engine, {}

    def spy(engine, num_requests):  # record what the engine did
        out = run(engine, num_requests)
        last_run.update(
            blocks=mcore_engine.kv_block_count(engine.context),
            evicted=engine.evicted_request_count,
            generated=sum(len(tokens) for tokens in out.values()),
        )
        return out

    mcore_engine.run_engine = spy
    model = tiny_bf16_gpt_model(
        num_layers=2,
        hidden_size=32,
        heads=4,
        vocab=VOCAB,
        seq=MAX_SEQ,
        query_groups=2,
        init_method_std=0.3,
    )  # flash-attn: bf16
    if full_state is not None:
        _load_pp_stage(model, full_state)
    model.train()
    gen = dict(max_new_tokens=NEW, pad_id=PAD)
    out = {
        "static": generate_rollout(model, PROMPTS, RolloutRequest(temperature=0.0, **gen)),
        "runs": {},
    }

    def dyn(key, prompts=PROMPTS, **kwargs):
        last_run.clear()
        log_prob_rows.clear()
        before = dict(cuda_graph_standin.COUNTS)
        out[key] = generate_rollout_dynamic(
            model, prompts, RolloutRequest(**{**gen, **kwargs}), block_size_tokens=BLOCK
        )
        graphs = {k: v - before[k] for k, v in cuda_graph_standin.COUNTS.items()}
        facts = _graph_facts(model, streams, stream, tracker)
        kv_bytes = out[key].kv_cache_bytes
        out["runs"][key] = dict(
            last_run, log_prob_rows=list(log_prob_rows), kv_bytes=kv_bytes, **graphs, **facts
        )

    dyn("greedy", temperature=0.0)
    dyn("greedy_eager", temperature=0.0, cuda_graphs=False)
    dyn("one_graph_size", temperature=0.0, decode_graph_sizes=1)
    for m in (1, 12, 16):  # 1: raised to one sequence (3 blocks)
        dyn(f"bounded{m}", temperature=0.0, max_tokens=m)
    long = [PROMPTS[0], [(7 * i) % VOCAB for i in range(70)]]  # > the 64-token step budget
    out["static_long"] = generate_rollout(model, long, RolloutRequest(temperature=0.0, **gen))
    dyn("chunked", long, temperature=0.0, max_tokens=1)  # prefilled in two chunks
    out["eos_id"] = eos = int(out["static"].tokens[0, len(PROMPTS[0]) + 2])  # row 0's 3rd token
    out["static_eos"] = generate_rollout(
        model, PROMPTS, RolloutRequest(temperature=0.0, stop_ids=(eos,), **gen)
    )
    dyn("eos_first", temperature=0.0, stop_ids=(eos, VOCAB + 1), max_tokens=12)
    dyn("eos_second", temperature=0.0, stop_ids=(VOCAB + 1, eos), max_tokens=12)
    sample = dict(temperature=1.0, seed=7, step=3)
    dyn("sampled", **sample)
    dyn("sampled_again", **sample)
    dyn("sampled_next_step", **{**sample, "step": 4})
    dyn("small_vocab", vocab_size=5, **sample)
    dyn("top_p_tiny", top_p=1e-6, **sample)
    dyn("no_new", max_new_tokens=0)
    dyn("log_prob_rows3", temperature=0.0, log_prob_micro_batch_size=3)
    dyn("no_log_probs", temperature=0.0, log_probs=False)  # π_old: the training forward's
    out["bytes_left_in_cycles"] = tensor_bytes_left_in_cycles(
        lambda: generate_rollout_dynamic(
            model, PROMPTS, RolloutRequest(**{**gen, **sample}), block_size_tokens=BLOCK
        )
    )
    out["failed_build"] = _failed_build(model, gen)
    out["kv_per_token"] = kv_cache_bytes(model, 1, 1)
    out["training"] = model.training
    out["layers"] = len(getattr(model, "module", model).decoder.layers)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out["request_multiple"] = tp if mcore_engine.has_inference_config() else 1
    greedy = out["greedy"]
    lengths = needed_lengths(greedy.response_mask)  # each row up to its last response token
    recomputed = compute(model, greedy.tokens, micro_batch_size=1, lengths=lengths)
    whole = compute(model, greedy.tokens, micro_batch_size=1)  # every row at full width
    if recomputed is not None:  # the last pipeline stage
        out["recomputed"] = torch.where(greedy.response_mask, recomputed.float(), 0.0)
        out["recomputed_whole"] = torch.where(greedy.response_mask, whole.float(), 0.0)
    if torch.distributed.get_world_size() == 1:
        x = torch.randint(0, VOCAB, (2, len(PROMPTS[1]) + NEW))  # the engine's RoPE length
        model(x, torch.arange(x.shape[1]).expand_as(x), None, labels=x).float().mean().backward()
        out["state_dict"] = getattr(model, "module", model).state_dict()
    return out


def _failed_build(model, gen) -> dict:
    """A rollout whose engine constructor raises at its very end (after it set Megatron's
    ``InferenceMode`` flag, 0.17+): the error, and whether the flag is left set."""
    from megatron.core.inference.engines import dynamic_engine

    init = dynamic_engine.DynamicInferenceEngine.__init__

    def failing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        raise RuntimeError("the constructor failed")

    dynamic_engine.DynamicInferenceEngine.__init__ = failing
    error = None
    try:
        request = RolloutRequest(temperature=0.0, **gen)
        generate_rollout_dynamic(model, PROMPTS, request, block_size_tokens=BLOCK)
    except RuntimeError as e:
        error = str(e)
    finally:
        dynamic_engine.DynamicInferenceEngine.__init__ = init
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:  # 0.16: no process-wide flag
        return {"error": error, "inference_mode": False}
    return {"error": error, "inference_mode": InferenceMode.is_active()}


@pytest.fixture(scope="module")
def tp1():
    return run_distributed(_worker, 1)


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_worker, 2, tp=2)


@pytest.fixture(scope="module")
def pp2(tp1):
    return run_distributed(_worker, 2, pp=2, full_state=tp1[0]["state_dict"])


@pytest.fixture(params=["tp1", "tp2", "pp2"])
def layout(request):
    return request.getfixturevalue(request.param)


ENGINES_ATOL = 0.1
"""The static engine's log-probs come from its KV-cached decode, the dynamic engine's from a
recompute of the finished sequences: in bf16 they differ by rounding (their exactness is
``test_dynamic_log_probs_are_the_policy_recompute``)."""


def _assert_same(a, b, atol: float = ENGINES_ATOL) -> None:
    assert torch.equal(a.tokens, b.tokens)
    for f in ("response_mask", "token_mask", "prompt_lengths", "response_lengths", "truncated"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=atol, rtol=0)


def test_greedy_equals_static_engine(layout, tp1):
    for r in layout:
        _assert_same(r["greedy"], r["static"])
        _assert_same(r["greedy"], tp1[0]["static"])  # same weights on every layout


def test_bounded_kv_cache_gives_the_same_tokens(layout):
    for r in layout:
        for m in (1, 12, 16):
            _assert_same(r[f"bounded{m}"], r["static"])
        # KV blocks of 256 tokens (flash-attn's paged kernels take no smaller): one per
        # request unbounded, then one block for max(m, P + N = 11) tokens, which holds one
        # request at full length: one request in flight at a time, none evicted; on
        # megatron-core 0.17+ at TP = 2 two requests, the blocks raised to hold them
        runs = [r["runs"][k] for k in ("greedy", "bounded1", "bounded12", "bounded16")]
        want = [4, 1, 1, 1] if r["request_multiple"] == 1 else [4, 2, 2, 2]
        assert [run["blocks"] for run in runs] == want
        assert all(run["evicted"] == 0 for run in runs)
        assert r["bounded1"].evicted_requests == 0 == r["greedy"].evicted_requests


def test_chunked_prefill_of_a_long_prompt(layout):
    for r in layout:
        _assert_same(r["chunked"], r["static_long"])


def test_several_stop_ids(layout):
    for r in layout:
        _assert_same(r["eos_first"], r["static_eos"])
        _assert_same(r["eos_second"], r["static_eos"])  # stops on the second id too
        for key in ("eos_first", "eos_second"):  # the engine stopped there, not only the result
            assert r["runs"][key]["generated"] == int(r["static_eos"].response_lengths.sum())
        assert r["static_eos"].response_lengths[0] <= 3


def test_sampling_reproducible_masked_and_log_probs(layout):
    for r in layout:
        _assert_same(r["sampled"], r["sampled_again"], atol=0.0)
        assert not torch.equal(r["sampled"].tokens, r["sampled_next_step"].tokens)
        assert not torch.equal(r["sampled"].tokens, r["greedy"].tokens)
        small = r["small_vocab"]
        assert (small.tokens[small.token_mask & ~_prompt_mask(small)] < 5).all()
        _assert_same(r["top_p_tiny"], r["greedy"], atol=0.0)
        for key in ("sampled", "small_vocab"):
            rollout = r[key]
            mask = rollout.response_mask
            assert (rollout.log_probs[mask] < 0).all() and (rollout.log_probs[~mask] == 0).all()


def _prompt_mask(rollout):
    positions = torch.arange(rollout.tokens.shape[1], device=rollout.tokens.device)
    return positions.unsqueeze(0) < rollout.prompt_lengths.unsqueeze(1)


def test_all_model_parallel_ranks_agree(tp2, pp2):
    for results in (tp2, pp2):
        for key in ("greedy", "bounded12", "sampled", "eos_second", "small_vocab"):
            _assert_same(results[0][key], results[1][key], atol=0.0)


def test_dynamic_log_probs_are_the_policy_recompute(layout):
    """The returned log-probs are exactly the untempered policy's on the finished sequences,
    each row cut after its last response token (on every rank: broadcast from the last
    pipeline stage). A forward of the whole width agrees to a bf16 rounding of the logits:
    its matmuls have other shapes, which some CPU kernels (AVX2) round differently."""
    last = [r for r in layout if "recomputed" in r]
    assert last
    for r in layout:
        assert (r["greedy"].log_probs[r["greedy"].response_mask] < 0).all()
        torch.testing.assert_close(r["greedy"].log_probs, last[0]["recomputed"], atol=0.0, rtol=0)
        torch.testing.assert_close(
            r["greedy"].log_probs, last[0]["recomputed_whole"], atol=0.05, rtol=0
        )


def test_log_prob_recompute_runs_in_log_prob_micro_batches(layout):
    """The old log-probs are recomputed in forwards of ``--log-prob-micro-batch-size`` rows,
    bounded or not (the whole rollout at once would hold ``B × L × V/TP`` fp32 logits),
    with the same result."""
    for r in layout:
        runs = r["runs"]
        assert runs["greedy"]["log_prob_rows"] == [1] and runs["bounded12"]["log_prob_rows"] == [1]
        assert runs["log_prob_rows3"]["log_prob_rows"] == [3]
        _assert_same(r["log_prob_rows3"], r["greedy"], atol=1e-2)


def test_no_recompute_where_pi_old_is_the_training_forward(layout):
    """``log_probs=False`` (one optimizer update per RL step: π_old is the training forward's
    own) runs no log-prob forward: the same tokens, log-probs left 0."""
    for r in layout:
        assert r["runs"]["no_log_probs"]["log_prob_rows"] == []
        assert torch.equal(r["no_log_probs"].tokens, r["greedy"].tokens)
        assert not r["no_log_probs"].log_probs.any()


def test_decode_steps_are_cuda_graph_replays_and_leave_nothing_behind(layout):
    """Each decode-only step replays the layers' captured graphs (Megatron's own
    ``CudaGraphManager`` over ``tests/helpers/cuda_graph_standin.py``'s recorded graphs, which
    read what a GPU's graph would: stale memory stays stale), with the tokens and log-probs of
    eager decoding; after every rollout no manager, graph, record or pool is left, and the
    config, the RNG tracker and the current stream are the training ones again."""
    for r in layout:
        runs = r["runs"]
        _assert_same(r["greedy"], r["greedy_eager"], atol=0.0)
        graphed, eager = runs["greedy"], runs["greedy_eager"]
        assert graphed["captures"] >= r["layers"]
        # Megatron replays each graph once right after capturing it; then the decode steps
        # (all but the first token, which the eager prefill step samples) replay
        assert graphed["replays"] - graphed["captures"] == (NEW - 1) * r["layers"]
        assert eager["captures"] == 0 == eager["replays"]
        _assert_same(r["one_graph_size"], r["greedy_eager"], atol=0.0)
        assert runs["one_graph_size"]["captures"] == r["layers"]  # one size: the largest
        assert graphed["captures"] >= runs["one_graph_size"]["captures"]
        assert runs["sampled"]["replays"] > 0
        for key, run in runs.items():
            left = {k: run[k] for k in ("managers", "live_graphs", "records", "pool", "impl")}
            assert left == {
                "managers": 0,
                "live_graphs": 0,
                "records": 0,
                "pool": None,
                "impl": "none",
            }, key
            assert run["tracker"] and run["stream"], key


def test_an_engine_constructor_that_raises_leaves_no_inference_mode(layout):
    """The engine is built inside the block that releases it: a constructor that raises
    after setting Megatron's InferenceMode flag (0.17+) clears it, and the error reaches the
    caller (a later training forward would take inference-only branches)."""
    for r in layout:
        assert r["failed_build"] == {"error": "the constructor failed", "inference_mode": False}


def test_kv_cache_bytes_measured_on_the_engine_buffer(layout):
    """``memory/kv_cache_bytes`` is the paged buffer's size (its blocks and Megatron's dummy
    block), not a formula."""
    for r in layout:
        for key in ("greedy", "bounded1", "bounded16"):
            run = r["runs"][key]
            assert run["kv_bytes"] == (run["blocks"] + 1) * BLOCK * r["kv_per_token"], key


def test_a_rollout_leaves_no_tensor_in_a_reference_cycle(layout):
    """The engine, its context and its KV blocks are freed when the rollout returns, not by a
    later cyclic collection."""
    assert [r["bytes_left_in_cycles"] for r in layout] == [0] * len(layout)


def test_model_state_restored_and_trainable_after(layout):
    for r in layout:
        assert r["training"]
        no_new = r["no_new"]
        assert not no_new.response_mask.any() and no_new.truncated.all()
        assert no_new.tokens.shape == (len(PROMPTS), max(len(p) for p in PROMPTS))


# ---------------------------------------------------------------- pure logic


def test_truncate_at_stop():
    assert truncate_at_stop([4, 7, 9, 7], [9, 7]) == ([4, 7], True)
    assert truncate_at_stop([4, 5], [9]) == ([4, 5], False)
    assert truncate_at_stop([], []) == ([], False)


def test_pack_rollout_layout():
    prompts = torch.tensor([[5, 9, 17], [60, 2, PAD]])
    r = pack_rollout(prompts, torch.tensor([3, 2]), [[1, 8], [3, 4, 6, 2]], [True, False], PAD)
    assert r.tokens.tolist() == [[5, 9, 17, 1, 8, PAD], [60, 2, 3, 4, 6, 2]]
    assert r.response_mask.tolist() == [
        [False, False, True, True, False],
        [False, True, True, True, True],
    ]
    assert r.token_mask.tolist() == [[True] * 5 + [False], [True] * 6]
    assert r.response_lengths.tolist() == [2, 4] and r.truncated.tolist() == [False, True]
    assert r.log_probs.shape == (2, 5) and not r.log_probs.any()


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops that read tensor values on the host (a device sync on a GPU)."""

    READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select")

    def __enter__(self):
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.READS or func._schema.name.startswith("aten::index"):
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_flash_attn_standins_check_what_flash_attn_checks():
    """The stand-ins refuse what flash-attn 2.x's kernels refuse (``flash_api.cpp``), so a
    call the GPU would reject fails on CPU first: int32 index tensors, the block table,
    pages of a multiple of 256 tokens, contiguous last dimensions, head dim ≤ 256."""
    import gpu_standins as g

    q = torch.zeros(3, 2, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 256, 2, 16, dtype=torch.bfloat16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    g.varlen_attention(q, cache, cache, cu, cu, 3, 3, block_table=table)  # accepted
    cases = {
        "cu_seqlens_q must have dtype int32": dict(cu_seqlens_q=cu.long()),
        "block_table must have dtype torch.int32": dict(block_table=table.long()),
        "Paged KV cache block size must be divisible by 256": dict(k=cache[:, :128]),
        "Input tensor must have contiguous last dimension": dict(q=q.transpose(1, 2)),
    }
    for message, change in cases.items():
        args = dict(q=q, k=cache, v=cache, cu_seqlens_q=cu, cu_seqlens_k=cu, block_table=table)
        args.update(change)
        if "k" in change:
            args["v"] = change["k"]
        with pytest.raises(RuntimeError, match=message):
            g.varlen_attention(max_seqlen_q=3, max_seqlen_k=3, **args)
    decode = q[:1].unsqueeze(1)  # [n, 1, h, d]
    lengths = torch.tensor([3], dtype=torch.int32)
    g.kvcache_attention(decode, cache, cache, lengths, block_table=table)  # accepted
    with pytest.raises(RuntimeError, match="seqlens_k must have dtype int32"):
        g.kvcache_attention(decode, cache, cache, lengths.long(), block_table=table)
    wide = torch.zeros(1, 1, 2, 264, dtype=torch.bfloat16)
    wide_cache = torch.zeros(2, 256, 2, 264, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head dimension at most 256"):
        g.kvcache_attention(wide, wide_cache, wide_cache, lengths, block_table=table)


def test_step_sampler_masks_padded_vocab_and_maps_stop_ids():
    logits = torch.zeros(3, 10)
    logits[:, 8:] = 100.0  # padded rows (vocab 8) dominate
    logits[0, 3], logits[1, 5], logits[2, 6] = 5.0, 5.0, 5.0
    sampler = StepSampler(temperature=0.0, top_p=1.0, vocab_size=8, generator=None, stop_ids=[6, 5])
    ids = sampler(logits, torch.tensor([10, 11, 12]), skip_id=-1)
    assert ids.tolist() == [3, 6, 6] and sampler.substituted == {11: 5}
    ids = sampler(logits, torch.tensor([10, 11, 12]), skip_id=11)  # 11 in chunked prefill
    assert ids.tolist() == [3, 5, 6] and sampler.substituted == {11: 5}
    # no step reads the device on the host (no .item(), bool() or boolean indexing)
    with _HostReads() as reads:
        sampler.substitute(torch.tensor([5, 6, 5]), torch.tensor([20, 21, 22]))
    assert reads.ops == [] and sampler.substituted == {11: 5, 20: 5, 22: 5}
    gen = torch.Generator().manual_seed(0)
    hot = StepSampler(temperature=1.0, top_p=1.0, vocab_size=8, generator=gen, stop_ids=[])
    assert (hot(logits.repeat(200, 1), torch.arange(600)) < 8).all()


def test_plan_bounds_kv_blocks():
    lengths = [3, 5, 2, 4]
    assert _plan(lengths, 6, None, 4) == (11, 4, 14)
    # one longest sequence, 11 tokens = 3 blocks: one request in flight, never evicted
    assert _plan(lengths, 6, 1, 4) == (3, 1, 1)
    # 4 blocks still hold one at full length; a step prefills at most the requests in
    # flight: the longest prompt (5), the two longest (5 + 4)
    assert _plan(lengths, 6, 16, 4) == (4, 1, 5)
    assert _plan(lengths, 6, 24, 4) == (6, 2, 9)
    assert _plan(lengths, 6, 10**6, 256) == (4, 4, 14)  # never more than needed
    # a multiple of TP (megatron-core 0.17+ asserts it): the blocks raised to hold them
    assert _plan(lengths, 6, 16, 4, request_multiple=2) == (6, 2, 9)
    assert _plan(lengths, 6, 24, 4, request_multiple=2) == (6, 2, 9)


def test_restore_forwards_undoes_only_new_wrappers():
    import weakref

    old, new = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    wrapped = weakref.WeakSet([old, new])
    for m in (old, new):
        m.forward = lambda x: x
    restore_forwards([old, new], wrapped, before={id(old)})
    assert "forward" in old.__dict__ and old in wrapped
    assert "forward" not in new.__dict__ and new not in wrapped
    x = torch.ones(1, 2)
    assert torch.equal(new(x), torch.nn.functional.linear(x, new.weight, new.bias))


def test_import_is_lazy():
    code = "import sys, loggra_megatron.rollout.dynamic.generate; print(sorted(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "megatron.core.inference.engines" not in out.stdout
    assert "megatron.core.inference.contexts.dynamic_context" not in out.stdout


# ---------------------------------------------------------------- GPU (real kernels)


def _greedy_gap(model, rollout) -> float:
    """Largest ``max log π - log π(chosen)`` over the generated tokens, from one plain
    (no-cache) forward of the finished sequences: 0 for exact greedy, bf16 noise for a
    near-tie, large if the KV cache, positions or masking were wrong."""
    tokens = rollout.tokens
    model.eval()
    logits = model(
        tokens, torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens), None
    ).float()
    model.train()
    lp = logits[:, :-1].log_softmax(-1)
    gap = lp.max(-1).values - lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return float(gap[rollout.response_mask].max())


def _gpu_worker() -> dict:
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    from loggra_megatron.parallel import initialize_megatron

    initialize_megatron(1, 1, 1234, device="cuda")
    # bf16 (flash-attn has no fp32), head dim 64, default KV blocks of 256 tokens
    model = tiny_gpt_model(2, 256, 4, VOCAB, 512, bf16=True, init_method_std=0.05)
    model.train()
    gen = dict(max_new_tokens=24, pad_id=PAD, temperature=0.0)
    runs = {"static": generate_rollout(model, PROMPTS, RolloutRequest(**gen))}
    runs["greedy"] = generate_rollout_dynamic(model, PROMPTS, RolloutRequest(**gen))
    runs["bounded"] = generate_rollout_dynamic(
        model, PROMPTS, RolloutRequest(max_tokens=1, **gen)
    )  # 1 row
    sampled = generate_rollout_dynamic(
        model, PROMPTS, RolloutRequest(max_new_tokens=24, vocab_size=VOCAB - 8)
    )
    with torch.no_grad():
        gaps = {key: _greedy_gap(model, rollout) for key, rollout in runs.items()}
    return {
        "gaps": gaps,
        "equal_rows": {
            k: (r.tokens == runs["static"].tokens).all(1).tolist() for k, r in runs.items()
        },
        "sampled_max_id": int(sampled.tokens[sampled.token_mask & ~_prompt_mask(sampled)].max()),
        "training": model.training,
        "graphs": len(_CudagraphGlobalRecord.cudagraph_inference_record),
    }


@pytest.mark.gpu
def test_gpu_dynamic_greedy_equals_static():
    reason = dynamic_engine_unavailable()
    if reason is not None:
        pytest.skip(reason)
    ctx = mp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        r = pool.submit(_gpu_worker).result(timeout=600)
    # Every token the greedy (at worst bf16 near-tie) choice given its own prefix; bf16
    # noise makes rows drift apart from the static engine's after a near-tie.
    assert all(gap < 0.25 for gap in r["gaps"].values()), r
    assert r["sampled_max_id"] < VOCAB - 8 and r["training"] and r["graphs"] == 0, r

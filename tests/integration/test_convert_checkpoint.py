"""HF <-> Megatron-Core checkpoint conversion (Llama, Qwen2, Qwen3) on CPU/gloo ranks.

Tiny random HF models (2 layers, hidden 64, vocab 100 -> padded 128/256; fp32, plus one bf16)
are converted to Megatron dist checkpoints; the Megatron model's logits must match HF's
(fp32: max abs diff <= 1e-4, measured ~2e-7) at TP=1, TP=2 and PP=2, HF -> Megatron -> HF
must reproduce every safetensors tensor bit for bit, and the exported config.json must give
transformers the same model. Norm weights and biases are randomised so that a wrong mapping
of them cannot hide behind their ones/zeros initialisation.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import warm_launch
from convert_cli import CLI, cli_main, load_hf_dir
from safetensors.torch import save_file

from loggra_megatron.convert.hf_config import gpt_args_from_hf
from loggra_megatron.convert.hf_io import HFCheckpointReader
from loggra_megatron.convert.hf_to_megatron import validate_hf_checkpoint
from loggra_megatron.convert.mapping import deinterleave_qkv, interleave_qkv
from loggra_megatron.model.args import GPTModelArgs, pad_vocab_size
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 100, 16, 2
ATOL = 1e-4
IDS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# name -> (config class, model class, extra config). Covers GQA, MQA (1 KV head: TP=2 splits
# a query group), tied/untied embeddings, Llama 3 RoPE scaling, QKV bias, QK-norm + head_dim.
CASES = {
    "llama_gqa_untied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE, max_position_embeddings=16384),
    ),
    "llama_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=4, tie_word_embeddings=True),
    ),
    "qwen2_bias": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    "qwen3_qknorm_mqa": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_key_value_heads=1, head_dim=24, tie_word_embeddings=True),
    ),
    "qwen2_bf16": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=2, tie_word_embeddings=True, dtype="bfloat16"),
    ),
}
# bf16 parameters: Megatron and HF round differently, so only a loose check of the logits.
ATOL_CASE = {"qwen2_bf16": 2e-2}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (hf_dir, logits [b, s, V] of the saved model reloaded by HF, HF RoPE inv_freq)."""
    root = tmp_path_factory.mktemp("hf")
    models = {}
    for i, (name, (cfg_cls, model_cls, extra)) in enumerate(CASES.items()):
        torch.manual_seed(100 + i)
        cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
        model = getattr(transformers, model_cls)(cfg).float()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n or n.endswith(".bias"):
                    p.add_(0.2 * torch.randn_like(p))
        path = root / name
        model.to(getattr(torch, extra.get("dtype", "float32"))).save_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
        with torch.no_grad():
            logits = model(IDS).logits.float()
        models[name] = (str(path), logits, model.model.rotary_emb.inv_freq.clone())
    return models


# ---------------------------------------------------------------------- workers (module level)
def _forward_logits(model, args):
    """Full-vocab logits [b, s, V] on every rank, for any TP/PP (PP by hand-off of hidden)."""
    from megatron.core import parallel_state as ps

    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        for s in range(pp):
            if stage == s:
                out = model(IDS, pos, None)
            if s < pp - 1:  # [s, b, h] activations go to the next stage
                ranks = ps.get_pipeline_model_parallel_group()
                hidden = (
                    out
                    if stage == s
                    else torch.empty(SEQ, BATCH, args.hidden_size, dtype=args.torch_dtype)
                )
                src = torch.distributed.get_global_rank(ranks, s)
                torch.distributed.broadcast(hidden, src=src, group=ranks)
                if stage == s + 1:
                    model.set_input_tensor(hidden)
        last = torch.distributed.get_global_rank(ps.get_pipeline_model_parallel_group(), pp - 1)
        if stage == pp - 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(out)[..., : args.vocab_size]
            logits = logits.contiguous()
        else:
            logits = torch.empty(BATCH, SEQ, args.vocab_size, dtype=args.torch_dtype)
        torch.distributed.broadcast(logits, src=last, group=ps.get_pipeline_model_parallel_group())
    return logits


def _load_and_run(mg_dir):
    from loggra_megatron.convert import load_megatron_checkpoint, read_model_args
    from loggra_megatron.model.build import build_gpt_model

    args = read_model_args(mg_dir)
    model = build_gpt_model(args, use_cpu_initialization=True, perform_initialization=False)
    model = model.to(args.torch_dtype).eval()  # as Megatron's Float16Module does
    load_megatron_checkpoint(model, mg_dir)
    inv_freq = model.rotary_pos_emb.inv_freq.clone() if hasattr(model, "rotary_pos_emb") else None
    return _forward_logits(model, args), inv_freq


def _reinit_parallel(tp, pp):
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _convert_worker(rank, cases, workdir, tag, then_pp=None):
    """Convert every case at the harness' TP/PP, run it, export it. If ``then_pp``, re-init
    as TP=1/PP=then_pp, load + run + export the same checkpoints again, and also convert,
    load and run at that PP."""
    from loggra_megatron.convert import (
        convert_hf_to_megatron,
        convert_megatron_to_hf,
        read_model_args,
    )

    results = {}
    for name, hf_dir in cases.items():
        mg = os.path.join(workdir, f"{name}-{tag}-mg")
        convert_hf_to_megatron(hf_dir, mg)
        logits, inv_freq = _load_and_run(mg)
        convert_megatron_to_hf(mg, os.path.join(workdir, f"{name}-{tag}-hf"))
        results[name] = {"logits": logits, "inv_freq": inv_freq, "args": read_model_args(mg)}
    if then_pp:
        _reinit_parallel(1, then_pp)
        for name, hf_dir in cases.items():
            mg = os.path.join(workdir, f"{name}-{tag}-mg")
            logits, _ = _load_and_run(mg)
            convert_megatron_to_hf(mg, os.path.join(workdir, f"{name}-{tag}-pp{then_pp}-hf"))
            results[name]["logits_pp"] = logits
            mg_pp = os.path.join(workdir, f"{name}-{tag}-pp{then_pp}-mg")  # convert at PP too
            convert_hf_to_megatron(hf_dir, mg_pp)
            results[name]["logits_pp_converted"] = _load_and_run(mg_pp)[0]
    return results


def _check(hf_models, results, workdir, tag, suffixes):
    report = {}
    for name, res in results.items():
        hf_dir, ref, ref_inv_freq = hf_models[name]
        assert res["args"] == gpt_args_from_hf(hf_dir)
        if res["inv_freq"] is not None:
            torch.testing.assert_close(res["inv_freq"], ref_inv_freq, rtol=1e-6, atol=0)
        src = load_hf_dir(hf_dir)
        for key in ("logits", "logits_pp", "logits_pp_converted"):
            if key in res:
                diff = (res[key].float() - ref).abs().max().item()
                report[f"{name}/{key}"] = diff
                tol = ATOL_CASE.get(name, ATOL)
                assert diff <= tol, f"{name} {tag} {key}: max |megatron - hf| = {diff:.3e}"
        for sfx in suffixes:
            out_dir = os.path.join(workdir, f"{name}-{tag}{sfx}")
            out = load_hf_dir(out_dir)
            assert sorted(out) == sorted(src), f"{name}{sfx}: tensor names differ"
            for k in src:
                assert out[k].dtype == src[k].dtype and torch.equal(out[k], src[k]), (
                    f"{name}{sfx}: {k}"
                )
            with open(os.path.join(out_dir, "config.json")) as f:
                cfg = json.load(f)
            assert gpt_args_from_hf(cfg) == gpt_args_from_hf(hf_dir)
        # The exported config.json means the same model to transformers (RoPE, eps, tying).
        model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype="auto").eval()
        with torch.no_grad():
            assert torch.equal(model(IDS).logits.float(), ref), f"{name}: exported HF logits"
    print(
        f"\n[{tag}] max |megatron - hf| logits: "
        + ", ".join(f"{k}={v:.1e}" for k, v in report.items())
    )


# ---------------------------------------------------------------------- tests
def test_tp1_logits_match_and_roundtrip_is_bit_exact(hf_models, tmp_path):
    cases = {n: hf_models[n][0] for n in CASES}
    (results,) = run_distributed(_convert_worker, 1, cases, str(tmp_path), "tp1")
    _check(hf_models, results, str(tmp_path), "tp1", ["-hf"])


def test_tp2_then_pp2_logits_match_and_roundtrip_is_bit_exact(hf_models, tmp_path):
    """Convert at TP=2 (gloo, 2 ranks), run at TP=2, then load the same checkpoints at PP=2."""
    cases = {n: hf_models[n][0] for n in CASES}
    results = run_distributed(_convert_worker, 2, cases, str(tmp_path), "tp2", then_pp=2, tp=2)
    for name in CASES:  # every rank computed the same full logits
        torch.testing.assert_close(
            results[0][name]["logits"], results[1][name]["logits"], rtol=0, atol=0
        )
    _check(hf_models, results[0], str(tmp_path), "tp2", ["-hf", "-pp2-hf"])


def _cli_worker(rank, argv):
    return cli_main(argv)


def test_cli_roundtrip_and_refusals(hf_models, tmp_path, capsys):
    """hf-to-megatron as a user runs it (its own process, no torchrun); megatron-to-hf via
    main() inside an already initialised Megatron; refusals before any process group."""
    hf_dir = hf_models["llama_tied"][0]
    mg, out = tmp_path / "mg", tmp_path / "hf"
    r = _cli("--direction", "hf-to-megatron", "--load", hf_dir, "--save", str(mg))
    assert r.returncode == 0, r.stderr
    assert "layer 1" in r.stdout and "done: 2 layers" in r.stdout
    args = GPTModelArgs.load_json(mg / "loggra_model_args.json")
    assert args == gpt_args_from_hf(hf_dir)
    assert (mg / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    argv = [
        "--direction",
        "megatron-to-hf",
        "--load",
        str(mg),
        "--save",
        str(out),
        "--max-shard-size",
        "60KB",
    ]
    assert run_distributed(_cli_worker, 1, argv) == [0]
    assert (out / "model.safetensors.index.json").exists()  # sharded: 60 KB < model size
    src, dst = load_hf_dir(hf_dir), load_hf_dir(out)
    assert sorted(src) == sorted(dst) and all(torch.equal(src[k], dst[k]) for k in src)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, hf_models["llama_tied"][1], rtol=0, atol=0)

    # Refusals (exit code 2, message on stderr): unsupported architecture, occupied --save.
    bad = tmp_path / "mistral"
    bad.mkdir()
    cfg = json.loads((mg / "hf_config.json").read_text())
    (bad / "config.json").write_text(
        json.dumps({**cfg, "model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    )
    capsys.readouterr()
    assert (
        cli_main(
            ["--direction", "hf-to-megatron", "--load", str(bad), "--save", str(tmp_path / "x")]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "unsupported Hugging Face model" in err and "MistralForCausalLM" in err
    assert cli_main(["--direction", "hf-to-megatron", "--load", hf_dir, "--save", str(mg)]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("parallel", "world", "message"),
    [
        (["--pipeline-model-parallel-size", "3"], 3, "does not divide the model's 2 layers"),
        (["--tensor-model-parallel-size", "3"], 3, "does not divide the model's 4 attention heads"),
        (["--tensor-model-parallel-size", "2"], 1, "launch with torchrun --nproc-per-node 2"),
    ],
)
def test_cli_refuses_parallel_sizes_the_model_cannot_take(
    hf_models, tmp_path, capsys, monkeypatch, parallel, world, message
):
    """Exit 2 with the reason before any process group (was Megatron's AssertionError on
    every rank of a torchrun job)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    load = hf_models["llama_tied"][0]
    argv = ["--direction", "hf-to-megatron", "--load", load, "--save", str(tmp_path / "x")]
    assert cli_main([*argv, *parallel]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_refuses_unsupported_configs():
    base = {**COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    assert gpt_args_from_hf(base).num_query_groups == 4
    refusals = {
        "unsupported Hugging Face model": {
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
        },
        "unsupported Hugging Face architecture": {
            "architectures": ["LlamaForSequenceClassification"]
        },
        "RoPE scaling type 'yarn'": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        "high_freq_factor": {"rope_parameters": {**LLAMA3_ROPE, "high_freq_factor": 2.0}},
        "attention_bias": {"attention_bias": True},
        "mlp_bias": {"mlp_bias": True},
        "hidden_act": {"hidden_act": "gelu"},
        "sliding-window": {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "use_sliding_window": True,
        },
        "required field 'vocab_size'": {"vocab_size": None},
    }
    for msg, patch in refusals.items():
        with pytest.raises(ValueError, match=msg):
            gpt_args_from_hf({**base, **patch})
    # transformers 4.x layout of Llama 3.1 RoPE is read too.
    v4 = {
        **base,
        "rope_theta": 5e5,
        "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
    }
    args = gpt_args_from_hf(v4)
    assert args.rope_scaling and args.rope_scaling_factor == 8.0 and args.rotary_base == 5e5
    assert GPTModelArgs.from_dict(json.loads(json.dumps(args.to_dict()))) == args
    with pytest.raises(ValueError, match="num_query_groups"):
        GPTModelArgs(
            num_layers=1,
            hidden_size=64,
            ffn_hidden_size=64,
            num_attention_heads=4,
            vocab_size=8,
            num_query_groups=3,
        )


def test_refuses_mismatched_tensor_shape(hf_models, tmp_path):
    hf_dir = hf_models["qwen2_bias"][0]
    tensors = load_hf_dir(hf_dir)
    tensors["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(7)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    args = gpt_args_from_hf(hf_dir)
    with (
        HFCheckpointReader(tmp_path) as reader,
        pytest.raises(ValueError, match=r"k_proj\.bias.*\[7\]"),
    ):
        validate_hf_checkpoint(reader, args)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with HFCheckpointReader(tmp_path) as reader, pytest.raises(ValueError, match="lacks 1 tensor"):
        validate_hf_checkpoint(reader, args)


def test_qkv_interleave_layout():
    """Megatron's group g = [q heads g*n..g*n+n-1, k head g, v head g]; exact inverse."""
    ng, n, d, h = 2, 3, 4, 5
    q, k, v = (torch.randn(m * d, h) for m in (ng * n, ng, ng))
    fused = interleave_qkv(q, k, v, ng)
    block = (n + 2) * d
    for g in range(ng):
        torch.testing.assert_close(
            fused[g * block : g * block + n * d], q[g * n * d : (g + 1) * n * d]
        )
        torch.testing.assert_close(
            fused[g * block + n * d : g * block + (n + 1) * d], k[g * d : (g + 1) * d]
        )
        torch.testing.assert_close(
            fused[g * block + (n + 1) * d : (g + 1) * block], v[g * d : (g + 1) * d]
        )
    for a, b in zip(deinterleave_qkv(fused, ng, n, d), (q, k, v), strict=True):
        assert torch.equal(a, b)
    assert pad_vocab_size(100, 128, 2) == 256 and pad_vocab_size(32000, 128, 1) == 32000


class _ExtraState(torch.nn.Module):
    """A module with Transformer Engine-style ``_extra_state`` (FP8 metadata in TE)."""

    def __init__(self):
        super().__init__()
        self.meta = {"amax_history": [0.0]}

    def get_extra_state(self):
        return self.meta

    def set_extra_state(self, state):
        self.meta = state


def _te_extra_state_load(rank, root):
    """A checkpoint written by a local-spec model loads into a model with ``_extra_state``
    modules (TE layers); a missing real tensor is still refused."""
    from loggra_megatron.convert import load_megatron_checkpoint, save_megatron_checkpoint
    from loggra_megatron.testing import tiny_gpt_model

    local = tiny_gpt_model(use_cpu_initialization=True)
    args = GPTModelArgs(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        vocab_size=64,
        make_vocab_size_divisible_by=1,
        max_position_embeddings=16,
    )
    save_megatron_checkpoint(local, root, args)
    te_like = tiny_gpt_model(use_cpu_initialization=True, init_method_std=0.5)
    for layer in te_like.decoder.layers:  # as TE layers: in every layer
        layer.fp8_meta = _ExtraState()
    load_megatron_checkpoint(te_like, root)
    same = all(
        torch.equal(a, b) for a, b in zip(local.parameters(), te_like.parameters(), strict=True)
    )
    extra = tiny_gpt_model(use_cpu_initialization=True)
    for layer in extra.decoder.layers:
        layer.register_parameter("scale", torch.nn.Parameter(torch.ones(3)))
    try:
        load_megatron_checkpoint(extra, root)
        refused = False
    except ValueError as e:
        refused = "lacks" in str(e) and "scale" in str(e)
    return same, refused


def test_te_extra_state_absent_from_a_local_spec_checkpoint_is_not_an_error(tmp_path):
    (result,) = run_distributed(_te_extra_state_load, 1, str(tmp_path / "mg"))
    assert result == (True, True)


def test_hf_to_megatron_refuses_a_truncated_safetensors_file(hf_models, tmp_path, capsys):
    """It used to end in a raw SafetensorError; now exit 2 naming the file, before any
    process group."""
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(hf_models["llama_tied"][0], src)
    weights = src / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    capsys.readouterr()
    argv = ["--direction", "hf-to-megatron", "--load", str(src), "--save", str(tmp_path / "mg")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert f"{weights}: not a readable safetensors file" in err, err
    assert not (tmp_path / "mg").exists()


def _cli(*argv, timeout=300):
    """tools/convert_checkpoint.py as a user runs it (its own process, no torchrun)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return warm_launch.run(CLI, [str(a) for a in argv], env=env, timeout=timeout)


def test_an_interrupted_conversion_is_cleaned_up_by_the_rerun(hf_models, tmp_path):
    """kill -9 used to leave --save holding only release.tmp, which the rerun
    refused as "exists and is not empty" without saying why; its leftovers are removed now
    (a directory holding anything else is still refused, naming what it holds)."""
    hf_dir = hf_models["llama_tied"][0]
    mg = tmp_path / "mg"
    (mg / "release.tmp").mkdir(parents=True)
    (mg / "release.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (mg / "loggra_model_args.json").write_text("{}")
    r = _cli("--direction", "hf-to-megatron", "--load", hf_dir, "--save", mg)
    assert r.returncode == 0, r.stderr
    assert "removing an interrupted conversion's loggra_model_args.json, release.tmp" in r.stdout
    assert sorted(os.listdir(mg)) == [
        "hf_config.json",
        "latest_checkpointed_iteration.txt",
        "loggra_model_args.json",
        "release",
    ]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    r = _cli("--direction", "hf-to-megatron", "--load", hf_dir, "--save", other)
    assert r.returncode == 2 and "is not empty (notes.txt)" in r.stderr


@pytest.fixture
def full_disk(tmp_path):
    """A 96 KiB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)])
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_fails_in_one_line_and_leaves_nothing(hf_models, tmp_path, full_disk):
    """A full disk used to give a SafetensorError traceback (megatron-to-hf) or
    "unexpected pos" (hf-to-megatron) and leave an empty directory."""
    hf_dir = hf_models["llama_tied"][0]
    mg = tmp_path / "mg"
    assert _cli("--direction", "hf-to-megatron", "--load", hf_dir, "--save", mg).returncode == 0
    for direction, load in (("hf-to-megatron", hf_dir), ("megatron-to-hf", mg)):
        save = full_disk / direction
        r = _cli("--direction", direction, "--load", load, "--save", save)
        assert r.returncode == 1, (direction, r.stdout, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: writing --save {save} failed, its file system is full")
        assert "Traceback" not in r.stderr, r.stderr
        assert not save.exists(), os.listdir(save)


def test_kill_9_during_a_conversion_leaves_no_process_behind(tmp_path):
    """kill -9 of the converter while it writes must not leave its
    helper processes (the dist-checkpoint writer's queue manager, the resource tracker)
    running; the rerun then cleans up and converts."""
    import signal
    import time

    import psutil

    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    mg = tmp_path / "mg"
    argv = [CLI, "--direction", "hf-to-megatron", "--load", tmp_path / "hf", "--save", mg]
    proc = subprocess.Popen([sys.executable, *map(str, argv)], stdout=subprocess.DEVNULL)
    converter = psutil.Process(proc.pid)
    deadline = time.time() + 120
    children = []
    while time.time() < deadline and proc.poll() is None:
        children = converter.children(recursive=True)
        if (mg / "release.tmp").exists() and children:
            break
        time.sleep(0.05)
    assert children, "the converter finished or never started writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    r = _cli("--direction", "hf-to-megatron", "--load", tmp_path / "hf", "--save", mg)
    assert r.returncode == 0, r.stderr

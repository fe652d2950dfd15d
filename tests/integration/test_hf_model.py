"""Real Hugging Face models end to end, offline: a tiny Qwen2-style model and a byte-level BPE
tokenizer with a chat template (made here), Parquet data with chat-message prompts, the
math task checked by math-verify, HF -> Megatron -> GRPO on 2 processes -> HF."""

import importlib.util
import json
import os
from functools import partial

import pytest
import torch
import warm_launch
from rl_runs import ENV, REWARD, ROOT, torchrun

from loggra_megatron.data.prompts import PromptRenderer
from loggra_megatron.data.tokenizer import load_tokenizer
from loggra_megatron.metrics import read_metrics
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

_spec = importlib.util.spec_from_file_location(
    "make_tiny_model", os.path.join(ROOT, "examples", "hf_model", "make_tiny_model.py")
)
make_tiny_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tiny_model)
IDS = torch.tensor([[5, 17, 42, 9, 88, 3, 120, 7]])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("hfm")
    make_tiny_model.main(["--out", str(out), "--num-train", "64", "--num-eval", "8"])
    return out


# ---------------------------------------------------------------- tokenizer and rendering
def test_chat_template_rendering_equals_transformers(hf_dir):
    from transformers import AutoTokenizer

    from loggra_megatron.tasks import TASKS

    tok = load_tokenizer(str(hf_dir / "hf"))
    reference = AutoTokenizer.from_pretrained(str(hf_dir / "hf"), local_files_only=True)
    messages = [{"role": "user", "content": "What is 3 divided by 4?"}]
    renderer = PromptRenderer(tok, TASKS["math"](), chat=True, system_prompt="Be brief.")
    expected = reference.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *messages],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert renderer.ids(messages) == list(expected)
    question = renderer.messages("What is 3 divided by 4?")  # a string prompt: + instruction
    assert question[-1]["content"].endswith("within \\boxed{}.")
    # both of Qwen's stop tokens end a completion; Qwen has no BOS
    stops = {reference.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert set(tok.stop_ids) == stops and tok.bos is None and tok.has_chat_template


def _sample_and_stop(rank, vocab_size):
    """Greedy generation where the padded vocabulary rows are the most likely ids."""
    from loggra_megatron.rollout import RolloutRequest, generate_rollout
    from loggra_megatron.testing import tiny_gpt_model

    model = tiny_gpt_model(vocab=64, seq=32, use_cpu_initialization=True)
    with torch.no_grad():  # output rows ≥ vocab_size (padding) dominate every step
        model.output_layer.weight[vocab_size:] = 10.0 * model.output_layer.weight[:1].sign()
    unmasked = generate_rollout(
        model, [[1, 2, 3]] * 2, RolloutRequest(max_new_tokens=6, temperature=1.0)
    )
    masked = generate_rollout(
        model,
        [[1, 2, 3]] * 2,
        RolloutRequest(max_new_tokens=6, temperature=1.0, vocab_size=vocab_size),
    )
    greedy = partial(RolloutRequest, max_new_tokens=6, temperature=0.0, vocab_size=vocab_size)
    first = int(generate_rollout(model, [[1, 2, 3]], greedy()).tokens[0, 3])
    stopped = generate_rollout(model, [[1, 2, 3]], greedy(stop_ids=(63, first)))  # the 2nd id
    return unmasked.tokens[:, 3:], masked.tokens[:, 3:], stopped


def test_padded_vocab_rows_are_never_sampled_and_any_stop_id_stops():
    ((unmasked, masked, stopped),) = run_distributed(_sample_and_stop, 1, 48)
    assert (unmasked >= 48).any()  # the padded rows win without the mask...
    assert (masked < 48).all()  # ...and are never sampled with it
    assert int(stopped.response_lengths[0]) == 1 and not bool(stopped.truncated[0])


# ---------------------------------------------------------------- the whole path
def _megatron_logits(rank, root):
    from loggra_megatron.convert import load_megatron_checkpoint, read_model_args
    from loggra_megatron.model.build import build_gpt_model

    args = read_model_args(root)
    model = build_gpt_model(args, use_cpu_initialization=True, perform_initialization=False).eval()
    load_megatron_checkpoint(model, root)
    with torch.no_grad():
        logits = model(IDS, torch.arange(IDS.shape[1]).unsqueeze(0), None)
    return logits[..., : args.vocab_size]


def _convert(direction: str, load, save) -> None:
    """tools/convert_checkpoint.py in ``direction`` (hf-to-megatron or megatron-to-hf)."""
    argv = ["--direction", direction, "--load", str(load), "--save", str(save)]
    proc = warm_launch.run("tools/convert_checkpoint.py", argv, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _grpo_flags(hf_dir, mcore, run) -> list[str]:
    """GRPO from the converted checkpoint: math task, chat template, Parquet data, eval."""
    data = hf_dir / "data"
    flags = [
        "--load",
        mcore,
        "--save",
        run,
        "--tokenizer-model",
        hf_dir / "hf",
        "--task",
        "math",
        "--data-path",
        data / "train.parquet",
        "--eval-data-path",
        data / "eval.parquet",
        "--eval-interval",
        2,
        "--seq-length",
        96,
        "--max-new-tokens",
        16,
        "--prompts-per-step",
        4,
        "--num-generations",
        4,
        "--global-batch-size",
        8,
        "--micro-batch-size",
        4,
        "--train-iters",
        2,
        "--lr",
        3e-3,
        "--loggra-rank",
        8,
        "--sft-iters",
        2,
        "--sft-lr",
        1e-3,
    ]
    return [str(f) for f in flags]


def _check_converted_back(hf_dir, run, back) -> None:
    """The model converted back: transformers' logits equal the trained Megatron model's
    (fp32), differ from the initial model's, and it generates."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    with torch.no_grad():
        expected = hf(IDS).logits
    (megatron,) = run_distributed(_megatron_logits, 1, str(run))
    initial = transformers.AutoModelForCausalLM.from_pretrained(hf_dir / "hf").float().eval()
    with torch.no_grad():
        assert not torch.allclose(initial(IDS).logits, expected, atol=1e-4)  # it trained
    torch.testing.assert_close(megatron, expected, atol=1e-4, rtol=0)
    out = hf.generate(IDS[:, :4], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 9)


def test_hf_model_to_megatron_grpo_and_back(hf_dir, tmp_path):
    """HF dir -> convert -> GRPO (2 processes, math task with math-verify, chat template,
    Parquet, eval) -> convert back -> transformers: its logits equal the trained Megatron
    model's (fp32) and it generates."""
    mcore, run, back = tmp_path / "mcore", tmp_path / "run", tmp_path / "hf_out"
    _convert("hf-to-megatron", hf_dir / "hf", mcore)
    torchrun(_grpo_flags(hf_dir, mcore, run))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2] and "eval/accuracy" in rows[1]
    assert all(0 <= r["reward/accuracy"] <= 1 for r in rows)
    _convert("megatron-to-hf", run, back)
    _check_converted_back(hf_dir, run, back)


def test_text_answers_with_a_custom_reward_train(tokenizer, tmp_path):
    """--task jsonl with answers that are words and a user reward: no numeric check runs."""
    data = tmp_path / "words.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Spell {n}", "answer": w}) + "\n"
            for n, w in ((3, "three"), (7, "seven"), (9, "nine"), (1, "one"))
        )
    )
    out = tmp_path / "run"
    torchrun(
        [
            "--tokenizer-model",
            tokenizer,
            "--data-path",
            str(data),
            "--reward-fn",
            f"{REWARD}:spelled_number",
            "--output-dir",
            str(out),
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "48",
            "--max-new-tokens",
            "8",
            "--prompts-per-step",
            "2",
            "--num-generations",
            "2",
            "--global-batch-size",
            "4",
            "--micro-batch-size",
            "2",
            "--train-iters",
            "1",
            "--loggra-rank",
            "8",
        ],
        nproc=1,
    )
    (row,) = read_metrics(out)
    assert 0 <= row["reward/accuracy"] <= 1

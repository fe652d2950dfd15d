"""examples/pretrained_smollm2's data and evaluation scripts, offline: the held-out split and
the greedy evaluation with transformers (on a tiny model made from a GGUF file written here;
the example itself downloads SmolLM2-135M-Instruct)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from tiny_gguf import write_tiny_gguf  # noqa: E402

from loggra_megatron.convert.gguf_import import gguf_to_hf  # noqa: E402
from loggra_megatron.data.prompts import PromptDataset  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pretrained_smollm2"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_held_out_questions_are_never_trained_on(tmp_path):
    _script("make_data").main(["--out", str(tmp_path), "--num-eval", "32"])
    train = PromptDataset.from_files(str(tmp_path / "train.jsonl")).examples
    held_out = PromptDataset.from_files(str(tmp_path / "eval.jsonl")).examples
    assert (len(train), len(held_out)) == (68, 32)
    questions = [e["prompt"][0]["content"] for e in train + held_out]
    assert len(set(questions)) == 100  # every single-digit sum once
    for e in train + held_out:
        assert e["prompt"] == [{"role": "user", "content": e["prompt"][0]["content"]}]
        a, b = e["metadata"]["operands"]
        assert e["answer"] == str(a + b) and 0 <= a <= 9 and 0 <= b <= 9


def test_evaluate_scores_greedy_completions_as_the_trainer_does(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    gguf_to_hf(str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"), log=lambda m: None)
    _script("make_data").main(["--out", str(tmp_path / "data"), "--num-eval", "4"])
    out = tmp_path / "result.json"
    evaluate = _script("evaluate")
    argv = ["--model", str(tmp_path / "hf"), "--data", str(tmp_path / "data" / "eval.jsonl")]
    evaluate.main([*argv, "--max-new-tokens", "6", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["n"] == 4 and len(result["samples"]) == 4
    correct = sum(s["reward"] == 1.0 for s in result["samples"])
    assert result["accuracy"] == correct / 4
    again = evaluate.evaluate(str(tmp_path / "hf"), argv[-1], 6, "last_number")
    assert [s["completion"] for s in again["samples"]] == [
        s["completion"] for s in result["samples"]
    ]  # greedy: the same completions

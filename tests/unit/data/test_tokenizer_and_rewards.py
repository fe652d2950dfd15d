# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Task generator, prompt datasets and batches, rewards, and the SentencePiece tokenizer."""

from __future__ import annotations

import json
import math
import os
import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
from packaging import version

from loggra_megatron.data import DatasetFormatError, PromptDataset
from loggra_megatron.data import tokenizer as tokenizer_module
from loggra_megatron.data.tokenizer import (
    USER_DEFINED_SYMBOLS,
    SentencePieceTokenizer,
    train_tokenizer,
    with_required_chars,
)
from loggra_megatron.tasks import generate_tasks, write_jsonl
from loggra_megatron.tasks.prompt_format import format_completion, format_prompt, task_texts
from loggra_megatron.tasks.rewards import (
    RewardSpecError,
    default_reward,
    exact_match_numeric,
    extract_answer,
    format_reward,
    load_reward_fn,
)
from loggra_megatron.tasks.scoring import RewardFunctionError, Scoring

REPO = str(Path(__file__).resolve().parents[3])

# ------------------------------------------------------------------------ generator


def _evaluate(operands, operators):
    """Standard precedence without eval: fold products into terms, then sum the terms."""
    terms, signs = [operands[0]], [1]
    for op, x in zip(operators, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


@pytest.mark.parametrize("kind", ["arithmetic", "word_problems", "mixed"])
def test_generator_is_deterministic_and_prefix_stable(kind):
    a = generate_tasks(kind, 200, seed=7)
    assert a == generate_tasks(kind, 200, seed=7)
    assert a[:50] == generate_tasks(kind, 50, seed=7)
    assert a != generate_tasks(kind, 200, seed=8)
    assert len({t["prompt"] for t in a}) > 150
    for t in a:
        assert set(t) == {"prompt", "answer", "metadata"}
        assert isinstance(t["prompt"], str) and isinstance(t["answer"], str)


def test_arithmetic_answers_recomputed_from_metadata():
    tasks = generate_tasks("arithmetic", 500, seed=0, num_digits=(1, 3), num_operands=4)
    assert {op for t in tasks for op in t["metadata"]["operators"]} == {"+", "-", "*"}
    for t in tasks:
        m = t["metadata"]
        assert len(m["operands"]) == 4
        assert all(0 <= x <= 999 for x in m["operands"])
        assert int(t["answer"]) == _evaluate(m["operands"], m["operators"])
        assert t["prompt"] == f"What is {m['expression']}?"
    assert any(int(t["answer"]) < 0 for t in tasks)


def test_arithmetic_difficulty_knobs():
    tasks = generate_tasks("arithmetic", 200, 1, num_digits=3, operators="-", allow_negative=False)
    for t in tasks:
        assert all(100 <= x <= 999 for x in t["metadata"]["operands"])
        assert t["metadata"]["operators"] == ["-"] and int(t["answer"]) >= 0
    with pytest.raises(TypeError, match="num_digit"):
        generate_tasks("arithmetic", 1, 0, num_digit=2)
    with pytest.raises(TypeError, match="max_number"):
        generate_tasks("arithmetic", 1, 0, max_number=5)
    with pytest.raises(ValueError, match="operators"):
        generate_tasks("arithmetic", 1, 0, operators="/")
    with pytest.raises(ValueError, match="kind"):
        generate_tasks("calculus", 1, 0)


def test_word_problem_answers_match_expressions():
    tasks = generate_tasks("word_problems", 1000, seed=3, max_number=50)
    templates = {t["metadata"]["template"] for t in tasks}
    assert len(templates) >= 8
    for t in tasks:
        m = t["metadata"]
        value = eval(m["expression"], {"__builtins__": {}})
        assert math.isclose(float(t["answer"]), value, abs_tol=1e-9), t
        assert float(t["answer"]) >= 0
        assert m["solution"].endswith(f"= {t['answer']}.")
    assert any("." in t["answer"] for t in tasks)  # the money template
    assert {
        t["metadata"]["steps"] for t in generate_tasks("word_problems", 200, 0, max_steps=1)
    } == {1}


# ------------------------------------------------------------------------- datasets


def test_jsonl_round_trip(tmp_path):
    tasks = generate_tasks("mixed", 30, seed=0)
    write_jsonl(tasks, tmp_path / "tasks.jsonl")
    dataset = PromptDataset.from_files(tmp_path / "tasks.jsonl")
    assert len(dataset) == 30 and dataset[5] == tasks[5]
    (tmp_path / "numeric.jsonl").write_text(
        '{"prompt": "p", "answer": 12}\n\n{"prompt": "q", "answer": -1.5}\n'
    )
    assert [e["answer"] for e in PromptDataset.from_files(tmp_path / "numeric.jsonl").examples] == [
        "12",
        "-1.5",
    ]
    assert PromptDataset.builtin("arithmetic", 10, seed=4).examples == generate_tasks(
        "arithmetic", 10, 4
    )


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "p", "answer": "1"', "invalid JSON"),
        ('["p", "1"]', "expected a JSON object"),
        ('{"prompt": "p"}', "missing required field(s) ['answer']"),
        ('{"answer": "1"}', "missing required field(s) ['prompt']"),
        ('{"prompt": 3, "answer": "1"}', "column 'prompt' changed from string to number"),
        ('{"prompt": "p", "answer": true}', "column 'answer' changed from string to boolean"),
        ('{"prompt": "  ", "answer": "1"}', "'prompt' is empty"),
        ('{"prompt": "p", "answer": "1", "metadata": {"a": [1]}, "x": 1}', None),  # valid
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"prompt": "What is 1 + 1?", "answer": "2"})
    path.write_text(f"{good}\n\n{bad_line}\n{good}\n")
    if message is None:
        assert len(PromptDataset.from_files(path)) == 3
        return
    with pytest.raises(DatasetFormatError) as e:
        PromptDataset.from_files(path)
    assert str(e.value).startswith(f"{path}:3: ")
    assert message in str(e.value)


def test_jsonl_non_utf8_byte_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}).encode()
    path.write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(
        DatasetFormatError, match=rf"^{path}:2: not UTF-8 \(byte 0xe9 at column 16\)"
    ):
        PromptDataset.from_files(path)


def test_jsonl_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no JSONL or Parquet files"):
        PromptDataset.from_files(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetFormatError, match="no examples"):
        PromptDataset.from_files(tmp_path / "empty.jsonl")


def _global_batches(dataset, gbs, dp_size, num_batches, start_index=None):
    """The global batches' dataset indices, gathered over DP ranks (rank-major)."""
    iterators = [dataset.batches(gbs, r, dp_size, start_index) for r in range(dp_size)]
    ranks = [list(islice(it, num_batches)) for it in iterators]
    return [[e["index"] for r in range(dp_size) for e in ranks[r][k]] for k in range(num_batches)]


def test_batches_cover_each_prompt_once_per_epoch_across_dp_ranks():
    dataset = PromptDataset.builtin("mixed", 10, seed=0)
    stream = [i for batch in _global_batches(dataset, 4, 2, 10) for i in batch]  # 4 epochs
    epochs = [stream[e * 10 : (e + 1) * 10] for e in range(4)]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 4  # reshuffled every epoch
    assert dataset.consumed_samples == 40 and dataset.epoch == 4
    # The same stream regardless of the DP size.
    assert [
        i for b in _global_batches(PromptDataset.builtin("mixed", 10, 0), 4, 4, 10) for i in b
    ] == stream
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        next(dataset.batches(6, 0, 4))


def test_batches_resume_from_state_dict_equals_uninterrupted():
    uninterrupted = _global_batches(PromptDataset.builtin("mixed", 13, seed=5), 6, 2, 7)

    first = PromptDataset.builtin("mixed", 13, seed=5)
    it = first.batches(6, dp_rank=1, dp_size=2)
    for _ in range(3):
        next(it)  # rank 1 trains 3 steps, then checkpoints
    state = json.loads(json.dumps(first.state_dict()))
    assert state["consumed_samples"] == 18

    resumed = PromptDataset.builtin("mixed", 13, seed=5)
    resumed.load_state_dict(state)
    assert _global_batches(resumed, 6, 2, 4) == uninterrupted[3:]
    assert (
        _global_batches(PromptDataset.builtin("mixed", 13, 5), 6, 2, 4, start_index=18)
        == uninterrupted[3:]
    )
    with pytest.raises(ValueError, match="13 examples with seed 5"):
        PromptDataset.builtin("mixed", 12, seed=5).load_state_dict(state)


# -------------------------------------------------------------------------- rewards


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (" 37 + 48 = 85.\n#### 85", "85", 1.0),
        ("#### 85 apples, I think.", "85", 1.0),
        ("#### 85.", "85", 1.0),
        ("#### 85\nQuestion: What is 1 + 1?\nAnswer: #### 2", "85", 1.0),  # first marker wins
        ("####: none\n#### 85", "85", 1.0),  # a marker without a number is skipped
        ("#### 1,000", "1000", 1.0),
        ("#### 1000", "1,000", 1.0),
        ("#### -1,234,567.5", "-1234567.5", 1.0),
        ("#### -12", "-12", 1.0),
        ("#### 12", "-12", 0.0),
        ("#### 3.50", "3.5", 1.0),
        ("#### $3.75", "3.75", 1.0),
        ("#### 3.7", "3.75", 0.0),
        ("#### 0.30000000000000004", "0.3", 1.0),
        ("#### .5", "0.5", 1.0),
        ("The answer is 85", "85", 0.0),  # no marker, no credit
        ("85", "85", 0.0),
        ("#### ", "85", 0.0),
        ("#### 86", "85", 0.0),
    ],
)
def test_exact_match_numeric(completion, answer, expected):
    assert exact_match_numeric("q", completion, answer, {}) == expected


def test_format_and_default_rewards():
    assert extract_answer("so #### -1,000.25 left") == "-1,000.25"
    assert format_reward("q", "blah\n#### 7", "8", {}) == 1.0
    assert format_reward("q", "#### seven", "7", {}) == 0.0
    assert format_reward("q", "The answer is 7", "7", {}) == 0.0
    assert default_reward("q", "#### 7", "7", {}) == pytest.approx(1.0)
    assert default_reward("q", "#### 8", "7", {}) == pytest.approx(0.1)
    assert default_reward("q", "7", "7", {}) == 0.0
    tasks = generate_tasks("mixed", 100, seed=2)
    completions = [format_completion(t["answer"], t["metadata"]["solution"]) for t in tasks]
    rewards, correct = score_batch(
        default_reward,
        [t["prompt"] for t in tasks],
        completions,
        [t["answer"] for t in tasks],
        [t["metadata"] for t in tasks],
    )
    assert rewards == pytest.approx([1.0] * 100) and all(correct)


def test_load_reward_fn(tmp_path, monkeypatch):
    assert load_reward_fn("exact_match_numeric") is exact_match_numeric
    assert load_reward_fn("loggra_megatron.tasks.rewards:format_reward") is format_reward
    (tmp_path / "my_rewards.py").write_text("def length(p, c, a, m):\n    return len(c) / 10\n")
    (tmp_path / "broken_dep.py").write_text("import no_such_dependency_xyz\n")
    assert load_reward_fn(f"{tmp_path / 'my_rewards.py'}:length")("q", "abc", "1", {}) == 0.3
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_fn("my_rewards:length")("q", "ab", "1", {}) == 0.2

    cases = {
        "exact_match": "expected 'module:function'",
        "no_such_module_xyz:score": "module 'no_such_module_xyz' not found",
        "broken_dep:score": "importing 'broken_dep' failed: No module named 'no_such_dependency_xyz'",
        "loggra_megatron.tasks.rewards:no_such_fn": "has no attribute 'no_such_fn'",
        "loggra_megatron.tasks.rewards:ANSWER_MARKER": "not callable",
        ":score": "both module and function",
        f"{tmp_path / 'missing.py'}:score": "not found",
    }
    for spec, message in cases.items():
        with pytest.raises(RewardSpecError) as e:
            load_reward_fn(spec)
        assert str(e.value).startswith(f"--reward-fn {spec!r}") and message in str(e.value), e.value


def score_batch(fn, prompts, completions, answers, metadatas=None, accuracy_threshold=1.0):
    """``(rewards, correct)`` as the trainer scores them, the first failure raised."""
    scores = Scoring(fn, None, accuracy_threshold).score(prompts, completions, answers, metadatas)
    return scores.rewards, scores.correct


def _reward_divides_by_zero_on_seven(prompt, completion, answer, metadata):
    return 1.0 / (int(answer) - 7)


def test_reward_failures_stop_a_strict_run_naming_the_sample():
    prompts = ["What is 1 + 1?", "What is 2 + 2?", "What is 3 + 4? " + "x" * 500]
    answers = ["2", "4", "7"]
    with pytest.raises(RewardFunctionError) as e:
        score_batch(_reward_divides_by_zero_on_seven, prompts, ["#### 0"] * 3, answers)
    err = e.value
    assert err.index == 2 and err.prompt == prompts[2]
    assert "raised on sample 2" in str(err) and "What is 3 + 4?" in str(err)
    assert "_reward_divides_by_zero_on_seven" in str(err) and "..." in str(err)
    assert "ZeroDivisionError" in err.traceback_text and "ZeroDivisionError" in str(err)
    assert "1.0 / (int(answer) - 7)" in err.traceback_text
    assert isinstance(err.__cause__, ZeroDivisionError)

    for bad in (float("nan"), float("inf"), None, "1.0", [1.0], torch.tensor([1.0, 2.0])):
        with pytest.raises(RewardFunctionError, match="returned .* on sample 0"):
            score_batch(lambda p, c, a, m, bad=bad: bad, ["q"], ["c"], ["1"])
    for good, value in ((True, 1.0), (np.float32(0.5), 0.5), (torch.tensor(0.25), 0.25), (3, 3.0)):
        rewards, _ = score_batch(lambda p, c, a, m, good=good: good, ["q"], ["c"], ["1"])
        assert rewards == [value]
    with pytest.raises(ValueError, match="2 prompts, 1 completions"):
        score_batch(default_reward, ["a", "b"], ["c"], ["1", "2"])


# ------------------------------------------------------------------------ tokenizer


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory):
    texts = task_texts(generate_tasks("mixed", 2000, seed=0))
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "math", vocab_size=384)


def test_tokenizer_round_trip_and_special_ids(tokenizer_model):
    tok = SentencePieceTokenizer(tokenizer_model)
    assert tok.vocab_size == 384
    samples = task_texts(generate_tasks("mixed", 50, seed=11)) + [
        format_prompt("What is 12 * 34?"),
        "  leading and  double spaces,\n\ttabs? {braces} ~ 1,000.5 -7 ",
        "",
    ]
    for text in samples:
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids) and tok.unk not in ids
        assert tok.detokenize(ids) == text
    prompt, completion = format_prompt("What is 2 + 3?"), " 2 + 3 = 5.\n#### 5"
    assert tok.detokenize(tok.tokenize(prompt) + tok.tokenize(completion)) == prompt + completion
    assert tok.pieces("9876543210") == list("9876543210")
    assert "####" in tok.pieces("\n#### 42") and "\n" in tok.pieces("\n#### 42")
    specials = {tok.bos, tok.eos, tok.pad, tok.unk}
    assert len(specials) == 4 and all(0 <= i < tok.vocab_size for i in specials)
    assert tok.eod == tok.eos and tok.id_to_piece(tok.pad) == "<pad>"
    assert tok.detokenize(torch.tensor([tok.bos, *tok.tokenize("ok"), tok.eos, tok.pad])) == "ok"


def test_tokenizer_training_is_deterministic(tokenizer_model, tmp_path):
    texts = task_texts(generate_tasks("mixed", 2000, seed=0))
    again = train_tokenizer(texts, tmp_path / "again", vocab_size=384)
    with open(tokenizer_model, "rb") as a, open(again, "rb") as b:
        assert a.read() == b.read()
    assert os.path.isfile(tmp_path / "again.vocab")


def test_required_chars_the_corpus_lacks_get_a_sentence_each(tmp_path, monkeypatch):
    """SentencePiece 0.2.2 (e.g. on the H200 image) aborts the process on a required
    character the corpus never shows (`#` shows only inside the `####` symbol); each gets a
    one-character sentence, which leaves 0.2.3's model bitwise unchanged."""
    texts = ["12 + 3 = 15\n#### 15", "7 - 2 = 5"]
    fed = list(with_required_chars(iter(texts), "1#x\t", USER_DEFINED_SYMBOLS))
    assert fed == [*texts, "#", "x", "\t"]
    tasks = list(task_texts(generate_tasks("mixed", 500, seed=0)))
    with_sentences = train_tokenizer(tasks, tmp_path / "with", vocab_size=256)
    tok = SentencePieceTokenizer(with_sentences)
    assert tok.unk not in tok.tokenize("#x~") and tok.detokenize(tok.tokenize("#x~")) == "#x~"
    if version.parse(spm.__version__) >= version.parse("0.2.3"):
        monkeypatch.setattr(tokenizer_module, "with_required_chars", lambda texts, *_: iter(texts))
        without = train_tokenizer(tasks, tmp_path / "without", vocab_size=256)
        with open(with_sentences, "rb") as a, open(without, "rb") as b:
            assert a.read() == b.read()


def test_tokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        SentencePieceTokenizer(tmp_path / "missing.model")
    (tmp_path / "garbage.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="--tokenizer-model"):
        SentencePieceTokenizer(tmp_path / "garbage.model")


def _exits(prompt, completion, answer, metadata):

    sys.exit(3)


def test_reward_problems_keep_their_reason_and_sys_exit_is_caught():
    """NaN/None/str keep their own reason; sys.exit() in a reward is an error, not an exit."""
    for bad, shown in (
        (float("nan"), "returned nan"),
        (None, "returned None"),
        ("1.0", "returned '1.0'"),
    ):
        with pytest.raises(RewardFunctionError) as e:
            score_batch(lambda p, c, a, m, bad=bad: bad, ["q"], ["c"], ["1"])
        assert shown in str(e.value) and "need a finite float" in e.value.problem
        located = e.value.at(" at RL step 3")
        assert shown in str(located) and "at RL step 3" in str(located)
    with pytest.raises(RewardFunctionError, match=r"called sys.exit\(3\) on sample 0"):
        score_batch(_exits, ["q"], ["c"], ["1"])


def test_accuracy_comes_from_the_reward_or_its_own_verdict():
    """reward ≥ threshold counts as correct unless the function says so itself; text answers
    with a custom reward never reach a numeric check."""
    prompts, answers = ["Spell 14"] * 3, ["fourteen"] * 3
    completions = ["fourteen", "forteen", "14"]

    def spelled(p, c, a, m):
        return 1.0 if c == a else 0.0

    def verdict(p, c, a, m):
        return {"reward": 0.5, "correct": c == a}

    assert score_batch(spelled, prompts, completions, answers) == (
        [1.0, 0.0, 0.0],
        [True, False, False],
    )
    assert score_batch(spelled, prompts, completions, answers, accuracy_threshold=0.0)[1] == [
        True,
        True,
        True,
    ]
    assert score_batch(verdict, prompts, completions, answers)[1] == [True, False, False]
    for bad in ({"score": 1.0}, {"reward": 1.0, "correct": "yes"}):
        with pytest.raises(RewardFunctionError, match="returned"):
            score_batch(lambda p, c, a, m, bad=bad: bad, ["q"], ["c"], ["1"])

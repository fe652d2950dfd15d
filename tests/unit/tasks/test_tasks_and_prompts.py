"""Tasks as one unit (data, prompt, reward, verdict), the math verifier, and prompt files in
JSONL and Parquet (chat-message prompts, shards, errors naming file and row)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rl_runs import tiny_argv

from loggra_megatron.arguments import parse_args
from loggra_megatron.data.files import DatasetFormatError, read_examples
from loggra_megatron.tasks import TASKS, generate_tasks
from loggra_megatron.tasks.math import MathTask, extract_final_answer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1/2 + 1/2?"}]


# ---------------------------------------------------------------- the math verifier
@pytest.mark.parametrize(
    ("completion", "answer", "correct"),
    [
        ("so it is \\boxed{\\frac{1}{2}}.", "0.5", True),
        ("\\boxed{0.5}", "1/2", True),
        ("#### 1/2\nmore text", "\\frac{1}{2}", True),
        ("\\boxed{\\frac{2}{4}}", "1/2", True),
        ("first \\boxed{3} then \\boxed{4}", "4", True),  # the last box counts
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", True),
        ("\\boxed{3}", "4", False),
        ("\\boxed{\\frac{1}{3}}", "0.33", False),
        ("the answer is 4", "4", False),  # no final-answer format
        ("\\boxed{4", "4", False),  # unbalanced
    ],
)
def test_math_verify_reward_table(completion, answer, correct):
    task = MathTask(format_reward=0.1)
    assert task.is_correct("q", completion, answer, {}) is correct
    formatted = extract_final_answer(completion) is not None
    expected = 1.0 if correct else (0.1 if formatted else 0.0)
    assert task.reward("q", completion, answer, {}) == expected


def test_math_reference_completion_is_correct():
    task = MathTask()
    example = {"prompt": "What is 3/4 of 2?", "answer": "3/2", "metadata": {"solution": "3/4 * 2"}}
    completion = task.reference_completion(example)
    assert "\\boxed{3/2}" in completion and task.is_correct("", completion, "3/2", {})


# ---------------------------------------------------------------- task flags
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"task": "word_problems", "task-digits": 3}, "--task-digits=3: applies to --task"),
        ({"task": "math"}, "--task='math': reads its prompts from --data-path"),
        ({"task": "arithmetic", "data-path": "DATA"}, "--task arithmetic generates its prompts"),
        ({"format-reward": 0.1}, "--format-reward=0.1: applies to --task math"),
        ({"eval-interval": 5}, "--eval-interval=5: applies with --eval-data-path"),
        ({"tokenizer-type": "GPT2Tokenizer"}, "--tokenizer-type"),
    ],
)
def test_task_settings_that_do_not_apply_are_refused(tokenizer, tmp_path, flags, needle, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "1"}\n')
    flags = {k: (data if v == "DATA" else v) for k, v in flags.items()}
    with pytest.raises(SystemExit):
        parse_args(tiny_argv(tokenizer, **flags))
    assert needle in capsys.readouterr().err


def test_chat_template_switch_is_automatic_or_explicit(tokenizer):
    assert parse_args(tiny_argv(tokenizer)).data.apply_chat_template is None  # automatic
    no = parse_args([*tiny_argv(tokenizer), "--no-apply-chat-template"])
    assert no.data.apply_chat_template is False


def test_mixed_honours_the_arithmetic_knobs(tokenizer, tmp_path):
    cfg = parse_args(
        tiny_argv(tokenizer, task="mixed", **{"task-digits": 1, "task-operators": "+"})
    )
    tasks = generate_tasks("mixed", 200, seed=0, **cfg.task.knobs("mixed"))
    arithmetic = [t for t in tasks if t["metadata"]["kind"] == "arithmetic"]
    assert arithmetic and all(
        len(str(x)) == 1 for t in arithmetic for x in t["metadata"]["operands"]
    )
    assert all(set(t["metadata"]["operators"]) == {"+"} for t in arithmetic)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "1"}\n')
    assert parse_args(tiny_argv(tokenizer, **{"data-path": data})).data.task == "jsonl"
    assert TASKS["jsonl"].needs_data and TASKS["math"].needs_data


# ---------------------------------------------------------------- prompt files
def test_parquet_and_jsonl_with_chat_messages_shards_and_extra_columns(tmp_path):
    rows = [
        {"prompt": MESSAGES, "answer": "1", "level": 3},
        {"prompt": MESSAGES, "answer": "2", "level": 5},
    ]
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), shards / "part-0.parquet")
    (shards / "part-1.jsonl").write_text(json.dumps({"question": "3+4?", "solution": 7}) + "\n")
    parquet = read_examples(str(shards / "part-0.parquet"))
    assert parquet[0] == {"prompt": MESSAGES, "answer": "1", "metadata": {"level": 3}}
    both = read_examples(str(shards / "*.parquet"))
    assert len(both) == 2
    with pytest.raises(DatasetFormatError, match=r"part-1.jsonl:1: missing required field"):
        read_examples(str(shards))  # a directory: every shard, the JSONL one lacks 'prompt'
    mixed = read_examples(
        str(shards / "part-1.jsonl"), prompt_key="question", answer_key="solution"
    )
    assert mixed == [{"prompt": "3+4?", "answer": "7", "metadata": {}}]


def test_a_bad_parquet_row_names_file_and_row(tmp_path):
    path = tmp_path / "bad.parquet"
    rows = [
        {"prompt": "p", "answer": "1"},
        {"prompt": "q", "answer": "2"},
        {"prompt": "", "answer": "3"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetFormatError, match=rf"^{path}: row 3: 'prompt' is empty"):
        read_examples(str(path))
    bad_messages = tmp_path / "msgs.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": [{"role": "user"}], "answer": "1"}]), bad_messages
    )
    with pytest.raises(
        DatasetFormatError, match=r"row 1: 'prompt' must be a non-empty string or a list"
    ):
        read_examples(str(bad_messages))


def test_long_rows_and_big_integer_answers_are_read_exactly(tmp_path):
    """A 3 MB row (a long reasoning trace) used to be refused by pyarrow ("straddles two
    block boundaries"); integers above 2^53 in a column pyarrow reads as doubles (it also
    holds 1.5) used to lose their last digits."""
    path = tmp_path / "long.jsonl"
    rows = [
        {"prompt": "x" * 3_000_000, "answer": 9007199254740993},
        {"prompt": "b", "answer": 1.5},
        {"prompt": "c", "answer": 12345678901234567891},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = read_examples(str(path))
    assert [e["answer"] for e in examples] == ["9007199254740993", "1.5", "12345678901234567891"]
    assert len(examples[0]["prompt"]) == 3_000_000


def test_row_errors_name_the_line_and_only_the_keys_the_row_has(tmp_path):
    nested = tmp_path / "nested.jsonl"
    nested.write_text(
        '{"prompt": "a", "answer": "1", "metadata": {"x": 1}}\n\n'
        '{"prompt": "b", "answer": "2", "metadata": {"x": "s"}}\n'
    )
    with pytest.raises(DatasetFormatError, match=rf"{nested}:3: column 'metadata.x' changed from"):
        read_examples(str(nested))  # a nested column used to have no line number
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "extra": 3}\n')
    with pytest.raises(DatasetFormatError) as e:
        read_examples(str(missing))
    # pyarrow gives every row every column (None where absent): 'answer' is not among "has"
    assert "missing.jsonl:2: missing required field(s) ['answer'] (has ['extra', 'prompt'])" in str(
        e.value
    )


def test_a_resume_over_other_prompts_of_the_same_count_is_refused(tmp_path):
    """The data position carries a fingerprint of the prompts: as many other prompts used to
    resume silently at the same position."""
    from loggra_megatron.data.prompts import PromptDataset

    first = tmp_path / "a.jsonl"
    first.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    second = tmp_path / "b.jsonl"
    second.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "c", "answer": "2"}\n')
    state = PromptDataset.from_files(first, seed=1).state_dict()
    PromptDataset.from_files(first, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="other examples .* fingerprint"):
        PromptDataset.from_files(second, seed=1).load_state_dict(state)


def test_adversarial_final_answers_are_judged_once_quickly_and_quietly(capfd):
    """A power tower or thousands of nested braces in \\boxed{} cost ~10 s each (two
    math-verify time-outs of 5 s: the reward and the verdict parsed separately) and were
    printed whole; each answer is judged once now, within 2 s limits, without output."""
    import time

    task = MathTask()
    tower = "\\boxed{9^{9^{9^{9^{9^{9^{9}}}}}}}"
    braces = "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}"
    for completion in (tower, braces):
        start = time.perf_counter()
        assert task.reward("q", completion, "2", {}) == 0.0
        assert not task.is_correct("q", completion, "2", {})
        assert time.perf_counter() - start < 6.0
    out, err = capfd.readouterr()
    assert "9^{9" not in out + err and "{{{{" not in out + err


def test_big_integer_metadata_is_read_exactly(tmp_path):
    """Integers above 2^53 in metadata (a top-level column or a nested
    object) were rounded like the answers used to be."""
    path = tmp_path / "meta.jsonl"
    rows = [
        {"prompt": "a", "answer": 1, "id": 9007199254740993, "metadata": {"seed": 2**63 + 1}},
        {"prompt": "b", "answer": 2, "id": 0.5, "metadata": {"seed": 1.25}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = read_examples(str(path))
    assert first["metadata"]["id"] == 9007199254740993
    assert first["metadata"]["seed"] == 2**63 + 1
    assert second["metadata"]["id"] == 0.5 and second["metadata"]["seed"] == 1.25


# ---------------------------------------------------------------- rewards as the trainer calls them
def _examples(name: str) -> list[dict]:
    from loggra_megatron.tasks import TASKS

    if not TASKS[name].needs_data:
        return TASKS[name]().generate(4, seed=0)
    return [  # the tasks that read --data-path: numbers every such reward reads
        {"prompt": "What is 3/4 of 2?", "answer": "1.5", "metadata": {"solution": "3/4 * 2"}},
        {"prompt": "Half of 9?", "answer": "4.5", "metadata": {"solution": "9/2"}},
    ]


def _another(answer: str) -> str:
    """A number other than ``answer``."""
    value = float(answer) + 1
    return str(int(value)) if value.is_integer() else str(value)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_scores_right_and_wrong_answers_under_the_default_settings(
    name, tokenizer, tmp_path
):
    """Each task scored as ``pretrain_rl.py`` scores it under the default settings (the
    ``Scoring`` its preflight builds, called on the main thread as the trainer calls it): a
    reference completion is correct with reward 1, one with another answer is wrong, and no
    sample is a reward error. (The default --reward-timeout once ran these rewards in a
    thread, where math-verify refused its signal-based time-out; the refusal read as a wrong
    answer, so every correct math answer scored 0. A refusal is a reward error now, which
    fails here as well.)"""
    from loggra_megatron.data.prompts import prompt_text
    from loggra_megatron.tasks import write_jsonl
    from loggra_megatron.tasks.math import equivalent
    from loggra_megatron.train.preflight import preflight

    flags = {"reward-fn": None, "task": name}
    if TASKS[name].needs_data:
        flags["data-path"] = tmp_path / "prompts.jsonl"
        write_jsonl(_examples(name), flags["data-path"])
    host = preflight(parse_args(tiny_argv(tokenizer, **flags)))
    assert host.scoring.workers is None  # built-in: scored in the trainer's process
    examples = host.dataset.examples[:4]
    right = [host.task.reference_completion(e) for e in examples]
    wrong = [
        host.task.reference_completion({**e, "answer": _another(e["answer"])}) for e in examples
    ]
    n = len(examples)
    equivalent.cache_clear()
    scores = host.scoring.score(
        [prompt_text(e["prompt"]) for e in examples] * 2,
        right + wrong,
        [e["answer"] for e in examples] * 2,
        [e["metadata"] for e in examples] * 2,
    )
    assert scores.errors == [], scores.errors[0]
    assert scores.correct == [True] * n + [False] * n, (right, wrong)
    assert scores.rewards[:n] == [1.0] * n and all(r < 1.0 for r in scores.rewards[n:])


def test_math_verify_judges_off_the_main_thread_too():
    """math-verify's own time-out (a SIGALRM) is the main thread's only: elsewhere it is off,
    and a correct answer is still correct (it was refused, read as a wrong answer)."""
    import threading

    from loggra_megatron.tasks.math import equivalent

    equivalent.cache_clear()
    verdicts = []
    thread = threading.Thread(target=lambda: verdicts.append(equivalent("\\frac{1}{2}", "0.5")))
    thread.start()
    thread.join()
    assert verdicts == [True]


def test_a_math_verify_failure_is_a_reward_error_not_a_wrong_answer(monkeypatch):
    """A comparison that fails inside math-verify, or a reference it cannot read, scored 0 as
    if the answer were wrong; each is a reward error of its sample now (counted, and no
    verdict), while an unreadable predicted answer stays a wrong one."""
    import math_verify

    from loggra_megatron.tasks.math import equivalent
    from loggra_megatron.tasks.scoring import Scoring

    task = MathTask()
    scoring = Scoring(task.reward, task.is_correct, 1.0, max_error_fraction=0.9)
    equivalent.cache_clear()
    scores = scoring.score(
        ["q"] * 3, ["\\boxed{1}", "\\boxed{\\frac{}{}}", "\\boxed{2}"], ["", "1", "1"]
    )
    assert [e.index for e in scores.errors] == [0]
    assert "math-verify reads no expression in the reference ''" in str(scores.errors[0])
    assert scores.correct == [False, False, False] and scores.rewards[1:] == [0.0, 0.0]

    def broken(*args, **kwargs):
        raise RuntimeError("sympy failed inside math-verify")

    monkeypatch.setattr(math_verify, "verify", broken)
    equivalent.cache_clear()
    scores = scoring.score(["q"] * 2, ["\\boxed{1}", "no final answer"], ["1", "1"])
    assert [e.index for e in scores.errors] == [0] and scores.rewards[1] == 0.0
    assert "sympy failed inside math-verify" in scores.errors[0].traceback_text
    equivalent.cache_clear()

"""The memory numbers the documents print are the estimator's: every ``$ python
tools/estimate_memory.py`` block and every table of docs/memory.md is re-run and compared,
docs/memory.md's example is the 27B script's command, and the README's estimator and
Qwen2.5-7B commands (conversion and training at the same TP/PP; the training command fits
80 GB by the estimator, as its paragraph says)."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest
from launch_flags import (
    ROOT,
    USABLE_GIB,
    assert_quotes,
    command,
    env_flags,
    estimator_cli,
    exported,
    flag_list,
    memory_argv,
    read,
    script_argv,
)

DOCS = read(os.path.join(ROOT, "docs", "memory.md"))
README = read(os.path.join(ROOT, "README.md"))
SH = os.path.join(ROOT, "examples", "h100_8gpu", "train_27b_loggra.sh")
QWEN = "tools/configs/qwen2.5-7b-instruct.json"


@pytest.fixture(scope="module")
def cli():
    return estimator_cli()


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands name tools/configs/... relative to it


def _blocks() -> list[tuple[list[str], str]]:
    """``(argv, printed output)`` of each ``$ python tools/estimate_memory.py`` block."""
    out = []
    for block in re.findall(
        r"^```\n(\$ python tools/estimate_memory\.py.*?)^```", DOCS, re.S | re.M
    ):
        lines = block.splitlines()
        n = next(i for i, line in enumerate(lines) if not line.endswith("\\"))
        words = shlex.split(" ".join(line.rstrip("\\") for line in lines[: n + 1]))
        out.append((words[3:], "\n".join(lines[n + 1 :]) + "\n"))
    return out


def _printed(cli, capsys, argv) -> str:
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def _json(cli, capsys, argv) -> dict:
    return json.loads(_printed(cli, capsys, [*argv, "--json"]))


def test_every_output_block_is_what_its_command_prints(cli, capsys):
    blocks = _blocks()
    assert len(blocks) == 7  # the headline step, the 27B example and five --fit searches
    assert [("--fit" in argv) for argv, _ in blocks] == [False] * 2 + [True] * 5
    for argv, shown in blocks:
        assert _printed(cli, capsys, argv) == shown, " ".join(argv)


def test_the_example_block_is_the_27b_script(cli):
    flags = set(cli.build_parser()._option_string_actions)
    script = dict(flag_list(script_argv(SH, 8, flags)))
    script["--hf-config"] = ["tools/configs/llama-style-27b.json"]
    headline, example = _blocks()[:2]
    assert dict(flag_list(example[0])) == script
    assert example[1] in DOCS.split("## The 27B example", 1)[1]
    assert headline[1] in DOCS.split("## Result", 1)[1].split("## The 27B example", 1)[0]


# ---------------------------------------------------------------------- the tables
def _rows(header: str) -> list[list[str]]:
    """The body rows of the markdown table whose header line starts with ``header``."""
    table = DOCS.split("\n" + header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    assert table, header
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in table]


def _set(argv: list[str], flag: str, value: str | None) -> list[str]:
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        del argv[i : i + 2]
    return argv if value is None else [*argv, flag, value]


def _static(res: dict) -> float:
    return res["total"] - max(res["phases"].values())


def _total(res: dict) -> str:
    return f"{res['total']:.1f} {'✓' if res['fits'] else '✗'}"


def _saved(dense: dict, loggra: dict) -> str:
    return f"{100 * (dense['total'] - loggra['total']) / dense['total']:.1f} %"


def test_sensitivity_rank_layout_and_variant_tables(cli, capsys):
    base = _blocks()[0][0]
    for seq, recompute, batch, *cells in _rows("| seq | recompute | rollout B |"):
        argv = _set(_set(base, "--seq-length", seq), "--max-new-tokens", str(int(seq) - 1024))
        argv = _set(argv, "--prompts-per-step", str(int(batch) // 8))  # groups of 8
        argv = _set(argv, "--inference-max-tokens", None)  # the KV cache holds all B at once
        if recompute == "none":  # the method and layer count apply only with full recompute
            for flag in ("--recompute-granularity", "--recompute-method", "--recompute-num-layers"):
                argv = _set(argv, flag, None)
        res = _json(cli, capsys, argv)
        d, lg = res["adam"], res["loggra"]
        assert cells == [_total(d), _total(lg), _saved(d, lg), lg["peak_phase"]], seq
    dense = _json(cli, capsys, base)["adam"]
    for name, state, sketch, static, total, saved in _rows("| optimizer | optimizer state |"):
        rank = re.fullmatch(r"LoGRA r=(\d+)|dense Adam", name)[1]
        res = _json(cli, capsys, _set(base, "--loggra-rank", rank) if rank else base)
        mine = res["loggra"] if rank else dense
        want = [f"{mine['optimizer_state']:.2f}", f"{mine['sketch_buffer']:.2f}"]
        want += [f"{_static(mine):.2f}", _total(mine)]
        assert [state, sketch, static, total] == want, name
        assert saved == (_saved(dense, mine) if rank else "–")
    for name, *cells in _rows("| layout | dense static |"):
        t, p, d = re.fullmatch(r"TP(\d) PP(\d) DP(\d)", name).groups()
        argv = _set(
            _set(base, "--tensor-model-parallel-size", t), "--pipeline-model-parallel-size", p
        )
        argv = [a for a in argv if t != "1" or a != "--sequence-parallel"]
        assert int(t) * int(p) * int(d) == 8
        res = _json(cli, capsys, argv)
        want = [f"{_static(res['adam']):.1f}", _total(res["adam"])]
        want += [f"{_static(res['loggra']):.1f}", _total(res["loggra"])]
        assert cells == want, name
    for name, *cells in _rows("| variant | dense static |"):
        extra = re.findall(r"`([^`]*)`", name)
        argv = [*base, *shlex.split(extra[-1])] if ": `" in name else base
        for word in [w for w in argv if w.startswith("--no-") and "--" + w[5:] in argv]:
            argv = [w for w in argv if w not in (word, "--" + word[5:])]  # PyTorch's default
        res = _json(cli, capsys, argv)
        d, lg = res["adam"], res["loggra"]
        want = [f"{_static(d):.1f}", _total(d), f"{_static(lg):.1f}", _total(lg)]
        assert cells == [*want, _saved(d, lg), lg["peak_phase"]], name


def test_best_against_best_table(cli, capsys):
    example = _blocks()[1][0]
    aware = [*example, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    fp32, moments = _json(cli, capsys, example), _json(cli, capsys, aware)
    cols = [fp32["adam"], moments["adam"], fp32["loggra"]]

    def peak(res: dict) -> str:
        free = USABLE_GIB - res["total"]
        return f"{res['total']:.2f} ✓ ({free:.2f} free)" if res["fits"] else f"{res['total']:.2f} ✗"

    def rows_at_once(argv: list[str]) -> list[str]:
        line = next(
            x for x in _printed(cli, capsys, argv).splitlines() if x.startswith("max rollout rows")
        )
        return line.split()[-2:]

    rows = {r[0]: r[1:] for r in _rows("| GiB per GPU | dense Adam (fp32 moments) |")}
    assert rows["static"] == [f"{_static(c):.2f}" for c in cols]
    assert rows["peak (rollout phase)"] == [peak(c) for c in cols]
    assert all(c["peak_phase"] == "rollout" for c in cols)
    saves = [_saved(cols[0], cols[2]), _saved(cols[1], cols[2]), "–"]
    assert rows["LoGRA saves"] == saves
    dense_rows, loggra_rows = rows_at_once(example)
    assert rows["max rollout rows at once (16k tokens)"] == [
        dense_rows,
        rows_at_once(aware)[0],
        loggra_rows,
    ]


# ---------------------------------------------------------------------- README
def test_readme_estimate_is_the_headline_command():
    readme = ["--hf-config", *command(README, "python tools/estimate_memory.py --hf-config")]
    assert readme == _blocks()[0][0]


def test_readme_fit_command_is_the_27b_search():
    readme = ["--fit", *command(README, "python tools/estimate_memory.py --fit")]
    assert readme == _blocks()[2][0]


def test_readme_qwen_commands_agree_and_fit(cli, capsys):
    """The conversion and the training run at the same TP/PP (one conversion process per
    shard, the training's world a multiple of it), the training bounds its KV cache and its
    log-prob micro-batch, and the estimator says it fits 80 GB as the paragraph quotes."""
    qwen = README.split("On one 8-GPU node (Qwen2.5-7B-Instruct", 1)[1].split("## Tools", 1)[0]
    start = re.search(r"torchrun --nproc-per-node (\d+) tools/convert_checkpoint\.py", qwen)
    conv = dict(flag_list(command(qwen, start[0])))
    train_nproc = re.search(r"torchrun --nproc-per-node (\d+) pretrain_rl\.py", qwen)
    train = flag_list(command(qwen, train_nproc[0]))
    run = dict(train)
    layout = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size")
    assert [conv[k] for k in layout] == [run[k] for k in layout]
    shards = int(conv[layout[0]][0]) * int(conv[layout[1]][0])
    assert int(start[1]) == shards and int(train_nproc[1]) % shards == 0
    assert conv["--load"] == run["--tokenizer-model"]  # the HF directory, tokenizer.json
    assert "--inference-max-tokens" in run and "--log-prob-micro-batch-size" in run
    flags = set(cli.build_parser()._option_string_actions)
    env = env_flags(exported(qwen))
    assert env == ["--expandable-segments", "--no-nccl-nvls"]
    argv = ["--hf-config", QWEN, "--world-size", train_nproc[1], "--gpu-memory-gb", "79.1"]
    argv += [*env, *memory_argv(train, flags)]
    res = _json(cli, capsys, argv)
    assert res["loggra"]["total"] <= USABLE_GIB - 5 and res["adam"]["fits"]
    quoted = qwen.split("Memory per GPU by the estimator", 1)[1].split("(The GPU commands", 1)[0]
    said = " ".join(quoted.replace("`", " ").split())
    assert " ".join(argv[: 6 + len(env)]) in said  # the paragraph names this command
    assert_quotes(quoted, _printed(cli, capsys, argv), "README, Qwen2.5-7B")

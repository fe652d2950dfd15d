"""Static checks of docker/Dockerfile and docker/README.md (no Docker engine needed)."""

from __future__ import annotations

import os
import re
import shlex

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(REPO, "docker")


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments)]`` with comments dropped and continuations joined."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line = pending + line
        pending = ""
        instr, _, args = line.partition(" ")
        out.append((instr.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


def _substitute(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], m[0]), text)


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    with open(os.path.join(DOCKER, "Dockerfile")) as f:
        return parse_dockerfile(f.read())


@pytest.fixture(scope="module")
def build_args(dockerfile) -> dict[str, str]:
    args = {}
    for instr, rest in dockerfile:
        if instr == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value.strip('"')
    return args


def _runs(dockerfile, build_args) -> list[str]:
    return [_substitute(rest, build_args) for instr, rest in dockerfile if instr == "RUN"]


def test_parser_handles_continuations_and_comments():
    text = "# c\nARG A=1\nRUN echo a \\\n    # inner comment\n    && echo b\nCMD x\n"
    assert parse_dockerfile(text) == [
        ("ARG", "A=1"),
        ("RUN", "echo a && echo b"),
        ("CMD", "x"),
    ]


def test_base_is_an_ngc_pytorch_image(dockerfile, build_args):
    froms = [rest for instr, rest in dockerfile if instr == "FROM"]
    assert len(froms) == 1, "one stage expected"
    assert next(instr for instr, _ in dockerfile if instr != "ARG") == "FROM"
    image = _substitute(froms[0].split()[0], build_args)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3", image), image


def test_megatron_core_is_pinned_within_pyproject_range(dockerfile, build_args):
    from packaging.requirements import Requirement

    pins = [
        m[1]
        for run in _runs(dockerfile, build_args)
        for m in re.finditer(r"megatron-core==([\w.]+)", run)
    ]
    assert len(pins) == 1, pins
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
    spec = next(r.specifier for r in deps if r.name == "megatron-core")
    assert spec.contains(pins[0]), f"megatron-core=={pins[0]} is outside pyproject's {spec}"


def test_runtime_requirements_installed_and_image_stack_untouched(dockerfile, build_args):
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = [Requirement(d).name for d in tomllib.load(f)["project"]["dependencies"]]
    installs = " ".join(r for r in _runs(dockerfile, build_args) if "pip install" in r)
    words = {re.split(r"[<>=!~\[]", w.strip("\"'"))[0].lower() for w in shlex.split(installs)}
    for name in deps:
        if name not in ("torch", "numpy", "megatron-core"):  # numpy, torch: in the image
            assert name.lower() in words, f"{name} (pyproject dependency) is not installed"
    for provided in ("torch", "transformer-engine", "transformer_engine", "apex"):
        assert provided not in words, f"{provided} comes with the NGC image; do not reinstall"
    env = " ".join(rest for instr, rest in dockerfile if instr == "ENV")
    assert re.search(r'PIP_CONSTRAINT=(""|\s|$)', env), "unset NGC's PIP_CONSTRAINT"


def test_repository_copied_and_installed_without_deps(dockerfile):
    seq = [(i, rest) for i, rest in dockerfile if i in ("WORKDIR", "COPY", "RUN")]
    workdir = next(k for k, (i, _) in enumerate(seq) if i == "WORKDIR")
    copy = next(k for k, (i, r) in enumerate(seq) if i == "COPY" and r.split() == [".", "."])
    install = next(
        k for k, (i, r) in enumerate(seq) if i == "RUN" and "pip install --no-deps -e ." in r
    )
    assert workdir < copy < install
    path = seq[workdir][1]
    assert path.startswith("/") and not path.startswith("/root"), "non-root-safe WORKDIR"
    assert not any(i == "ENTRYPOINT" for i, _ in dockerfile)
    assert not any(i == "USER" and r.split(":")[0] == "root" for i, r in dockerfile)


def test_dockerignore_keeps_the_context_small():
    with open(os.path.join(DOCKER, "Dockerfile.dockerignore")) as f:
        patterns = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "**/__pycache__"} <= patterns


def test_readme_has_build_and_8_gpu_torchrun_lines():
    with open(os.path.join(DOCKER, "README.md")) as f:
        text = f.read()
    assert "docker build -f docker/Dockerfile -t loggra-megatron ." in text
    run = re.search(r"torchrun --nproc-per-node 8 pretrain_rl\.py((?:[^\n]*\\\n)*[^\n]*)", text)
    assert run, "no torchrun line for 8 GPUs"
    flags = set(re.findall(r"--[a-z0-9-]+", run[1]))
    expected = {
        "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--bf16",
        "--fp8-format", "--optimizer", "--loggra-rank", "--kl-target", "--tokenizer-model",
        "--data-path", "--save", "--load",
    }  # fmt: skip
    assert expected <= flags, expected - flags
    assert "--optimizer loggra" in run[1] and "--fp8-format hybrid" in run[1]


# ---------------------------------------------------------------------- the 8-GPU commands
def _readme() -> str:
    with open(os.path.join(DOCKER, "README.md")) as f:
        return f.read()


def _command(text: str, start: str) -> list[str]:
    """The shell words of the (backslash-continued) command that begins with ``start``."""
    m = re.search(re.escape(start) + r"((?:[^\n]*\\\n)*[^\n]*)", text)
    assert m, f"no {start!r} command"
    return shlex.split(m[1].replace("\\\n", " "))


def _flags(words: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for word in words:
        if word.startswith("--"):
            key = word
            out[key] = []
        else:
            out[key].append(word)
    return out


def test_readme_trains_with_transformer_engine_and_a_realistic_sequence_length():
    text = _readme()
    run = _flags(_command(text, "torchrun --nproc-per-node 8 pretrain_rl.py"))
    assert run["--transformer-impl"] == ["transformer_engine"]
    assert int(run["--seq-length"][0]) >= 4096
    assert int(run["--max-new-tokens"][0]) < int(run["--seq-length"][0])
    assert "--sequence-parallel" in run and run["--recompute-granularity"] == ["full"]
    before = text.split("torchrun --nproc-per-node 8 pretrain_rl.py")[0]
    assert before.rstrip().endswith("export CUDA_DEVICE_MAX_CONNECTIONS=1")


def test_readme_converts_a_large_model_with_one_process_per_tp_rank():
    text = _readme()
    m = re.search(r"torchrun --nproc-per-node (\d+) tools/convert_checkpoint\.py", text)
    assert m, "the conversion must run under torchrun (one process per TP shard)"
    conv = _flags(_command(text, m[0]))
    run = _flags(_command(text, "torchrun --nproc-per-node 8 pretrain_rl.py"))
    tp = run["--tensor-model-parallel-size"]
    assert conv["--direction"] == ["hf-to-megatron"] and conv["--tensor-model-parallel-size"] == tp
    assert m[1] == tp[0]
    assert not re.search(r"^python tools/convert_checkpoint\.py", text, re.M)


def test_readme_estimate_has_the_training_memory_flags_and_fits_80gb(capsys):
    """The README's estimate takes the torchrun command's memory flags (same names, same
    values); for the 27B configuration it fits an 80 GB H100 with >= 5 GiB to spare."""
    import importlib.util
    import json

    text = _readme()
    est_words = _command(text, "python tools/estimate_memory.py")
    est = _flags(est_words)
    run = _flags(_command(text, "torchrun --nproc-per-node 8 pretrain_rl.py"))
    spec = importlib.util.spec_from_file_location(
        "estimate_memory_cli", os.path.join(REPO, "tools", "estimate_memory.py")
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    modelled = set(cli.build_parser()._option_string_actions)
    for flag, values in run.items():
        if flag in modelled:
            assert est.get(flag) == values, f"{flag}: estimate {est.get(flag)}, run {values}"
    est_words[est_words.index("--hf-config") + 1] = os.path.join(
        REPO, "tools", "configs", "llama-style-27b.json"
    )
    assert cli.main([*est_words, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["loggra"]["total"] <= 79.1 - 5 and res["loggra"]["fits"]

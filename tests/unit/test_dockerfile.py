"""Static checks of docker/Dockerfile and docker/README.md (no Docker engine needed)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[2])
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


def _pip_installs(dockerfile, build_args) -> list[list[str]]:
    """The arguments of every ``pip install`` of the RUN instructions."""
    out = []
    for run in _runs(dockerfile, build_args):
        for m in re.finditer(r"pip install (.*?)(?:;|&&|$)", run):
            out.append(shlex.split(m[1]))
    return out


def _requirements(dockerfile, build_args) -> list:
    from packaging.requirements import Requirement

    words = [w for args in _pip_installs(dockerfile, build_args) for w in args]
    return [Requirement(w) for w in words if not w.startswith("-") and w != "."]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_runtime_requirements_installed_and_image_stack_untouched(dockerfile, build_args):
    from packaging.requirements import Requirement

    deps = [Requirement(d).name for d in _pyproject()["dependencies"]]
    names = {r.name.lower() for r in _requirements(dockerfile, build_args)}
    for name in deps:
        if name not in ("torch", "numpy"):  # in the image
            assert name.lower() in names, f"{name} (pyproject dependency) is not installed"
    provided_by_the_image = ("torch", "transformer-engine", "transformer_engine", "apex")
    for provided in (*provided_by_the_image, "numpy", "flash-attn"):
        assert provided not in names, f"{provided} comes with the NGC image; do not reinstall"
    for args in _pip_installs(dockerfile, build_args):
        assert not {"-U", "--upgrade", "--force-reinstall", "--no-build-isolation"} & set(args)


def test_installs_run_under_the_image_stack_constraints(dockerfile, build_args):
    """NGC's PIP_CONSTRAINT is replaced, before the first pip install, by a constraints file
    of the image's own torch/TE/apex/flash-attn/numpy versions (docker/image_stack.py)."""
    steps = [(i, r) for i, r in dockerfile if i in ("COPY", "RUN", "ENV")]
    env = next(k for k, (i, r) in enumerate(steps) if i == "ENV" and "PIP_CONSTRAINT=" in r)
    path = re.search(r"PIP_CONSTRAINT=(\S+)", steps[env][1])[1]
    made = next(k for k, (i, r) in enumerate(steps) if i == "RUN" and f"> {path}" in r)
    assert "image_stack.py" in steps[made][1]
    copy = next(k for k, (i, r) in enumerate(steps) if i == "COPY" and "image_stack.py" in r)
    first_pip = next(k for k, (i, r) in enumerate(steps) if i == "RUN" and "pip install" in r)
    assert copy < made < env < first_pip
    assert not any("PIP_CONSTRAINT" in r for i, r in steps[env + 1 :]), "kept to the end"


def test_image_stack_pins_exactly_the_image_stack(capsys):
    path = os.path.join(DOCKER, "image_stack.py")
    spec = importlib.util.spec_from_file_location("image_stack", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stack = ("torch", "triton", "transformer-engine", "transformer-engine-torch", "apex")
    for name in (*stack, "flash-attn", "numpy", "transformer-engine-cu12"):
        assert module.STACK.fullmatch(name), name
    for name in ("transformers", "torchvision", "megatron-core", "einops", "numpy-stl"):
        assert not module.STACK.fullmatch(name), name
    module.main()
    pins = capsys.readouterr().out.split()
    assert f"torch=={importlib.metadata.version('torch')}" in pins
    assert f"numpy=={importlib.metadata.version('numpy')}" in pins
    assert all(re.fullmatch(r"[a-z0-9-]+==\S+", pin) for pin in pins)


def test_every_install_is_pinned_within_pyproject(dockerfile, build_args):
    """Exact versions or an upper bound, inside pyproject.toml's ranges (dependencies and the
    test/gpu extras), so a new release cannot change the image."""
    from packaging.requirements import Requirement

    project = _pyproject()
    ranges = {}
    extras = project["optional-dependencies"]
    for text in (*project["dependencies"], *extras["test"], *extras["gpu"]):
        req = Requirement(text)
        ranges[req.name.lower()] = req.specifier
    for req in _requirements(dockerfile, build_args):
        ops = {s.operator for s in req.specifier}
        assert ops & {"==", "<", "<=", "~="}, f"{req} is not pinned"
        allowed = ranges.get(req.name.lower())
        assert allowed is not None, f"{req.name} is not a requirement of pyproject.toml"
        for spec in req.specifier:  # an exact pin inside the range, or bounds that meet it
            if spec.operator == "==":
                assert allowed.contains(spec.version), f"{req} is outside pyproject's {allowed}"
            elif spec.operator in ("<", "<="):
                lower = [s.version for s in allowed if s.operator in (">=", ">")]
                assert all(spec.contains(v) for v in lower), f"{req} excludes {allowed}"


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
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--bf16",
        "--fp8-format",
        "--optimizer",
        "--loggra-rank",
        "--kl-target",
        "--tokenizer-model",
        "--data-path",
        "--save",
        "--load",
    }
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
    from launch_flags import MEMORY_NEUTRAL  # flags the estimate may leave out

    modelled = set(cli.build_parser()._option_string_actions) - set(MEMORY_NEUTRAL)
    for flag, values in run.items():
        if flag in modelled:
            assert est.get(flag) == values, f"{flag}: estimate {est.get(flag)}, run {values}"
    est_words[est_words.index("--hf-config") + 1] = os.path.join(
        REPO, "tools", "configs", "llama-style-27b.json"
    )
    assert cli.main([*est_words, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["loggra"]["total"] <= 79.1 - 5 and res["loggra"]["fits"]


def test_readme_tokenizer_is_the_hugging_face_directory():
    """Llama-3-vocabulary and Qwen models ship no SentencePiece ``tokenizer.model``: the run
    reads the converted model's HF directory (its tokenizer.json)."""
    text = _readme()
    conv = _flags(_command(text, "torchrun --nproc-per-node 8 tools/convert_checkpoint.py"))
    run = _flags(_command(text, "torchrun --nproc-per-node 8 pretrain_rl.py"))
    assert run["--tokenizer-model"] == conv["--load"]
    assert not run["--tokenizer-model"][0].endswith(".model")
    assert "tokenizer.json" in text and "tokenizer.model" not in _command(
        text, "torchrun --nproc-per-node 8 pretrain_rl.py"
    )


def test_readme_estimate_has_the_run_environment():
    """The estimate's allocator and NCCL flags stand for what the run block exports."""
    text = _readme()
    est = _flags(_command(text, "python tools/estimate_memory.py"))
    exports = " ".join(re.findall(r"^export (.*)$", text, re.M))
    assert ("expandable_segments:True" in exports) == ("--expandable-segments" in est)
    assert ("NCCL_NVLS_ENABLE=0" in exports) == ("--no-nccl-nvls" in est)
    assert "--expandable-segments" in est and "--fp8-recipe" in est

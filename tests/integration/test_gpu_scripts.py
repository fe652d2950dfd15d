"""The GPU launch scripts, checked on CPU: ``examples/h100_8gpu`` (single node and Slurm) and
``benchmarks/gpu/h200_check.sh``.

* The 27B example's memory flags, fed to ``tools/estimate_memory.py`` under the same names,
  fit an 80 GB H100 with at least 5 GiB to spare, and its header quotes that command's
  output; every flag is either modelled by the estimator or listed here as memory-neutral.
  Both scripts run LoGRA's backward sketch, with no flag of the gradient sketch's.
* Every GPU script exports ``CUDA_DEVICE_MAX_CONNECTIONS=1``; the Slurm script runs in a
  pyxis container and takes ``pretrain_rl.py`` from the repository (fake ``sbatch``,
  ``scontrol``, ``srun`` and ``torchrun`` record what would run).
* ``h200_check.sh``: its flags are accepted by ``pretrain_rl.py`` and the estimator, and a
  rehearsal on CPU (tiny shapes) writes every section to the results file, a failing section
  included.
* The GPU benchmarks take ``--device`` and still run on CPU.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys

import pytest
import warm_launch
from launch_flags import (
    CONFIG_27B,
    ROOT,
    USABLE_GIB,
    assert_quotes,
    env_flags,
    estimator_cli,
    exported,
    flag_list,
    printed,
    script_argv,
    torchrun_flags,
    without,
)
from launch_flags import read as _read

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

EXAMPLES = os.path.join(ROOT, "examples", "h100_8gpu")
SH = os.path.join(EXAMPLES, "train_27b_loggra.sh")
SLURM = os.path.join(EXAMPLES, "train_27b_loggra.slurm")
H200 = os.path.join(ROOT, "benchmarks", "gpu", "h200_check.sh")
MARGIN_GIB = 5.0


@pytest.fixture(scope="module")
def cli():
    return estimator_cli()


@pytest.fixture(scope="module")
def estimator_flags(cli) -> set[str]:
    return set(cli.build_parser()._option_string_actions)


def _estimate(cli, capsys, argv) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _gradient(argv: list[str]) -> list[str]:
    """``argv`` with LoGRA's gradient sketch instead of the backward sketch (the default)."""
    return [*without(argv, "--loggra-sketch", 1), "--loggra-sketch", "gradient"]


# ---------------------------------------------------------------------- the 27B example
def test_example_flags_are_pretrain_rl_flags(estimator_flags):
    from loggra_megatron.arguments import build_parser

    pretrain = set(build_parser()._option_string_actions)
    for path in (SH, SLURM):
        flags = [f for f, _ in torchrun_flags(path)]
        assert set(flags) <= pretrain, set(flags) - pretrain
        shared = set(flags) & estimator_flags
        assert shared <= pretrain  # the estimator's counterparts carry the same names
        for needed in (
            "--inference-max-tokens",
            "--log-prob-micro-batch-size",
            "--recompute-granularity",
            "--sequence-parallel",
            "--fp8-format",
        ):
            assert needed in shared, f"{path}: {needed}"


def test_examples_run_the_backward_sketch_without_gradient_only_flags():
    """``--loggra-sketch backward``; pretrain_rl.py refuses the gradient sketch's flags with it."""
    from loggra_megatron.optim.config import LoGRAConfig

    gradient_only = set()
    for field in dataclasses.fields(LoGRAConfig):
        rule = field.metadata.get("applies")
        if rule is not None and "--loggra-sketch gradient" in rule.when:
            gradient_only.add("--" + field.name.replace("_", "-"))
    assert "--loggra-update-interval" in gradient_only
    for path in (SH, SLURM):
        flags = dict(torchrun_flags(path))
        assert flags["--optimizer"] == ["loggra"] and flags["--loggra-sketch"] == ["backward"]
        assert flags["--loggra-rank"] == ["128"] and "--loggra-param-remainders" in flags
        assert not gradient_only & set(flags), f"{path}: {gradient_only & set(flags)}"


@pytest.mark.parametrize("path,world", [(SH, 8), (SLURM, 16)])
def test_27b_example_fits_80gb_with_5gib_margin(path, world, cli, estimator_flags, capsys):
    argv = script_argv(path, world, estimator_flags)
    res = _estimate(cli, capsys, argv)
    loggra, dense = res["loggra"], res["adam"]
    assert loggra["total"] <= USABLE_GIB - MARGIN_GIB, (loggra["total"], loggra["phases"])
    # the KV budget is what makes it fit: the whole batch at once would not
    assert loggra["kv_cache"] < 32.0
    unbounded = _estimate(cli, capsys, without(argv, "--inference-max-tokens", 1))["loggra"]
    assert unbounded["kv_cache"] == pytest.approx(32.0)
    assert unbounded["total"] > loggra["total"]
    # every phase of the step is modelled; one optimizer update per RL step (64 rollouts,
    # global batch 64): π_old is the training forward's own, no recompute after the rollout
    assert set(loggra["phases"]) >= {"rollout", "old log-probs", "ref log-probs", "training"}
    assert loggra["phases"]["old log-probs"] == 0 and loggra["prefill_activations"] > 0
    if world == 8:  # the example's claims: dense Adam does not fit one node; the backward
        assert dense["total"] > USABLE_GIB  # sketch does without the allocator setting too
        pinned = _estimate(cli, capsys, without(argv, "--expandable-segments"))["loggra"]
        assert pinned["fits"] and pinned["total"] > loggra["total"]
        # the gradient sketch (quoted once) fits too; without the allocator setting the
        # freed KV buffer's pinned segment (16 GiB) is counted again
        gradient = _gradient(argv)
        default = _estimate(cli, capsys, gradient)["loggra"]
        assert default["fits"] and default["total"] > loggra["total"]
        pinned = _estimate(cli, capsys, without(gradient, "--expandable-segments"))["loggra"]
        assert pinned["total"] >= default["total"] + loggra["kv_cache"]


def _header_command(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line.lstrip("#").strip()
        if body.startswith("python tools/estimate_memory.py") or lines:
            if not body:
                break
            lines.append(body.rstrip("\\").strip())
    assert lines, "no estimate_memory.py command in the header"
    return shlex.split(" ".join(lines))[2:]


def test_27b_header_quotes_its_estimate_command(cli, estimator_flags, capsys):
    """The header's command has the script's memory flags and exported environment, and each
    paragraph quotes only numbers that its variant of that command prints."""
    text = _read(SH)
    argv = _header_command(text)
    header = {f: v for f, v in flag_list(argv)}
    script = {f: v for f, v in flag_list(script_argv(SH, 8, estimator_flags))}
    script["--hf-config"] = ["tools/configs/llama-style-27b.json"]
    assert header == script
    argv[argv.index("--hf-config") + 1] = CONFIG_27B
    comment = text.split("prints (GiB per GPU)", 1)[1].split(
        "\n# tests/integration/test_gpu_scripts.py", 1
    )[0]
    parts = re.split(r"\n# (?=Without --|With --)", comment)
    variants = {
        "": argv,
        "Without --inference-max-tokens": without(argv, "--inference-max-tokens", 1),
        "Without --expandable-segments": without(argv, "--expandable-segments"),
        "With --nccl-nvls": [*without(argv, "--no-nccl-nvls"), "--nccl-nvls"],
        "With --loggra-sketch gradient": _gradient(argv),
    }
    assert len(parts) == len(variants)
    for part in parts:
        key = next(k for k in sorted(variants, key=len, reverse=True) if part.startswith(k))
        assert_quotes(part, printed(cli, capsys, variants.pop(key)), f"header {key!r}")


def test_27b_readme_and_slurm_header_quote_the_estimator(cli, estimator_flags, capsys):
    """examples/h100_8gpu/README.md's table (one row per script) and prose, and the Slurm
    script's header, print what the estimator prints for the scripts' flags (the prose: or
    for their variants, the one-node command with the gradient sketch among them)."""
    one = script_argv(SH, 8, estimator_flags)
    two = script_argv(SLURM, 16, estimator_flags)
    out = {"one": printed(cli, capsys, one), "two": printed(cli, capsys, two)}
    readme = _read(os.path.join(EXAMPLES, "README.md"))
    rows = dict(re.findall(r"^\| (one node|two nodes)[^|]*\|(.*)$", readme, re.M))
    assert set(rows) == {"one node", "two nodes"}
    assert_quotes(rows["one node"], out["one"], "README, one node")
    assert_quotes(rows["two nodes"], out["two"], "README, two nodes")
    variants = [
        without(one, "--inference-max-tokens", 1),
        without(one, "--expandable-segments"),
        [*without(one, "--no-nccl-nvls"), "--nccl-nvls"],
        _gradient(one),
    ]
    everything = "".join([*out.values(), *(printed(cli, capsys, v) for v in variants)])
    prose = readme.split("| two nodes", 1)[1].split("These scripts have not", 1)[0]
    assert_quotes(prose, everything, "README")
    slurm = _read(SLURM).split("# Memory per GPU at 2 nodes", 1)[1].split("#SBATCH", 1)[0]
    assert_quotes(slurm, out["two"], "Slurm header")


# ---------------------------------------------------------------------- launch scripts
def _gpu_scripts() -> list[str]:
    paths = glob.glob(os.path.join(EXAMPLES, "*.sh")) + glob.glob(os.path.join(EXAMPLES, "*.slurm"))
    return [*sorted(paths), H200]


@pytest.mark.parametrize("path", _gpu_scripts(), ids=os.path.basename)
def test_gpu_scripts_export_cuda_device_max_connections(path):
    code = [line.strip() for line in _read(path).splitlines() if not line.lstrip().startswith("#")]
    exports = [
        i
        for i, line in enumerate(code)
        if re.match(r"export (\S+ )*CUDA_DEVICE_MAX_CONNECTIONS=1( |$)", line)
    ]
    assert exports, f"{path} does not export CUDA_DEVICE_MAX_CONNECTIONS=1"
    launches = [i for i, line in enumerate(code) if re.match(r"(srun|torchrun|section) ", line)]
    assert launches and exports[0] < launches[0]
    assert subprocess.run(["bash", "-n", path]).returncode == 0


@pytest.mark.parametrize("path", _gpu_scripts(), ids=os.path.basename)
def test_gpu_scripts_export_the_allocator_and_nccl_settings(path):
    """Expandable segments (a freed KV buffer's pages are reused) and no NCCL NVLS buffers,
    before anything starts; the memory tests read these exports as estimator flags."""
    assert env_flags(exported(_read(path))) == ["--expandable-segments", "--no-nccl-nvls"]
    code = [line for line in _read(path).splitlines() if not line.lstrip().startswith("#")]
    first = min(i for i, line in enumerate(code) if "NCCL_NVLS_ENABLE" in line)
    launches = [i for i, line in enumerate(code) if re.match(r"\s*(srun|torchrun|section) ", line)]
    assert first < launches[0]


def _fake_bin(tmp_path, **scripts: str) -> str:
    """A directory of fake commands, each recording its arguments (one per line) and env."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(
            "#!/usr/bin/env bash\n"
            f'printf "%s\\n" "$@" > "{tmp_path}/{name}.args"\n'
            f'env > "{tmp_path}/{name}.env"\n' + body
        )
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(bin_dir)


def _env(bin_dir: str, tmp_path, **extra) -> dict:
    unset = ("REPO", "NCCL_NVLS_ENABLE", "PYTORCH_CUDA_ALLOC_CONF")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in unset}
    env["PATH"] = bin_dir + os.pathsep + env["PATH"]
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    env.update(
        CKPT=str(tmp_path / "ckpt"),
        TOKENIZER=str(tmp_path / "tok" / "sp.model"),
        DATA=str(tmp_path / "data" / "p.jsonl"),
        **extra,
    )
    return env


def test_single_node_script_takes_pretrain_rl_from_the_repository(tmp_path):
    bin_dir = _fake_bin(tmp_path, torchrun="")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    proc = subprocess.run(
        ["bash", SH, "--extra-flag", "1"],
        cwd=cwd,
        env=_env(bin_dir, tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    args = _read(tmp_path / "torchrun.args").splitlines()
    assert args[:3] == ["--nproc-per-node", "8", os.path.join(ROOT, "pretrain_rl.py")]
    assert args[-2:] == ["--extra-flag", "1"]
    env = _read(tmp_path / "torchrun.env").splitlines()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in env and "NCCL_NVLS_ENABLE=0" in env
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in env
    assert "NCCL_GRAPH_REGISTER=0" in env  # the rollout's CUDA graphs beside expandable segments


def test_slurm_script_submits_itself_recording_the_repository(tmp_path):
    bin_dir = _fake_bin(tmp_path, sbatch="")
    cwd = tmp_path / "submit"
    cwd.mkdir()
    proc = subprocess.run(
        ["bash", SLURM],
        cwd=cwd,
        env=_env(bin_dir, tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    args = _read(tmp_path / "sbatch.args").splitlines()
    assert args[0] == f"--export=ALL,REPO={ROOT}" and os.path.samefile(args[1], SLURM)


@pytest.mark.parametrize("image", [None, "registry#team/loggra-megatron:v1"])
def test_slurm_job_runs_in_a_container_from_the_repository(tmp_path, image):
    """As Slurm runs it: a copy of the script in a spool directory, REPO unset, the job's
    working directory elsewhere; scontrol knows the submitted script's path."""
    scontrol = (
        'case "$1 $2" in\n'
        f'  "show job") echo "   Command={SLURM} WorkDir=/x";;\n'
        '  "show hostnames") printf "node1\\nnode2\\n";;\n'
        "esac\n"
    )
    bin_dir = _fake_bin(tmp_path, scontrol=scontrol, srun="")
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(SLURM, spool / "slurm_script")
    cwd = tmp_path / "submit"
    cwd.mkdir()
    extra = dict(
        SLURM_JOB_ID="77",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="node[1-2]",
        CONTAINER_MOUNTS="/lustre:/lustre",
    )
    if image:
        extra["IMAGE"] = image
    proc = subprocess.run(
        ["bash", str(spool / "slurm_script")],
        cwd=cwd,
        timeout=60,
        env=_env(bin_dir, tmp_path, **extra),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    args = _read(tmp_path / "srun.args").splitlines()
    opts = dict(a.split("=", 1) for a in args if a.startswith("--container-"))
    assert opts["--container-image"] == (image or os.path.join(ROOT, "loggra-megatron.sqsh"))
    mounts = opts["--container-mounts"].split(",")
    assert f"{ROOT}:{ROOT}" in mounts and "/lustre:/lustre" in mounts
    assert f"{tmp_path / 'ckpt'}:{tmp_path / 'ckpt'}" in mounts
    assert len(mounts) == len(set(mounts))
    assert opts["--container-workdir"] == ROOT
    assert "torchrun" in args and os.path.join(ROOT, "pretrain_rl.py") in args
    assert args[args.index("--save") + 1] == str(cwd / "runs" / "grpo_27b_multinode")
    env = _read(tmp_path / "srun.env").splitlines()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in env and "NCCL_NVLS_ENABLE=0" in env
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in env
    assert "NCCL_GRAPH_REGISTER=0" in env  # the rollout's CUDA graphs beside expandable segments


def test_slurm_script_refuses_an_unknown_repository(tmp_path):
    bin_dir = _fake_bin(tmp_path, sbatch="", srun="")
    proc = subprocess.run(
        ["bash", SLURM],
        env=_env(bin_dir, tmp_path, REPO=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "has no pretrain_rl.py" in proc.stderr
    assert not (tmp_path / "sbatch.args").exists() and not (tmp_path / "srun.args").exists()


# ---------------------------------------------------------------------- h200_check.sh
def _bash_array(text: str, name: str) -> list[str]:
    m = re.search(rf"^{name}=\((.*?)\)", text, re.S | re.M)
    assert m, name
    return shlex.split(m[1].replace("\n", " "))


def test_h200_check_flags_are_accepted_by_pretrain_rl_and_the_estimator(cli, capsys, monkeypatch):
    from loggra_megatron.arguments import build_parser

    text = _read(H200)
    shape, step = _bash_array(text, "SHAPE_RL"), _bash_array(text, "STEP_RL")
    fp8 = _bash_array(text, "FP8")
    assert fp8[-2:] == ["--fp8-recipe", "tensorwise"] and "--fp8-format" in fp8
    assert "--bf16" in shape
    packed = ["--transformer-impl", "transformer_engine", "--sequence-packing"]
    runs = ((["--transformer-impl", "local"], "static"), (fp8, "dynamic"), (packed, "static"))
    for impl, engine in runs:
        run = ["--rollout-engine", engine, "--train-iters", "3", "--device", "cuda"]
        task = ["--tokenizer-model", "t.model", "--task", "arithmetic"]
        args = build_parser().parse_args([*task, *shape, *impl, *step, *run])
        assert args.rollout_engine == engine
        est = ["--world-size", "1", "--vocab-size", "512", "--rollout-engine", engine]
        res = _estimate(cli, capsys, [*est, *shape, *impl, *step])
        assert 5 < res["loggra"]["total"] < 139  # a ~1B model: fits one H200
    # every RL run names LoGRA's backward sketch
    args = build_parser().parse_args(["--tokenizer-model", "t.model", *shape, *step])
    assert (args.optimizer, args.loggra_sketch) == ("loggra", "backward")
    # the flagship (FP8 + the dynamic engine) where it can run, then what runs anywhere (the
    # memory sweep before the RL run), then the dynamic engine, then FP8
    calls = (
        r"^    rl rl_fp8 dynamic",
        r"^section decode",
        r"^section memory_bf16",
        r"^rl rl_static static",
        r"^section kl_control",
        r"^    rl rl_dynamic dynamic",
        r"^    section memory_fp8",
        r"^    \[ -n \"\$FLAGSHIP_RAN\" \] \|\| rl rl_fp8 static",
        r"^    rl rl_packed static --transformer-impl transformer_engine --sequence-packing",
    )
    order = [re.search(call, text, re.M).start() for call in calls]
    assert order == sorted(order)
    kl = re.search(r"bench_kl_control\.py (--device .*?)\"\$\{KL_EXTRA", text, re.S)[1]
    path = os.path.join(ROOT, "benchmarks", "bench_kl_control.py")
    spec = importlib.util.spec_from_file_location("bench_kl_control", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    flags = shlex.split(kl.replace("\\\n", " ").replace('"$RL_DEVICE"', "cuda"))
    monkeypatch.setattr(sys, "argv", [path, *flags])
    args = bench.parse_args()
    assert args.skipping_only and (args.hidden, args.seq, args.device) == (2048, 1024, "cuda")
    decode = re.search(r"decode_step\.py (--device .*?)\"\$\{DECODE_EXTRA", text, re.S)[1]
    spec = importlib.util.spec_from_file_location(
        "decode_step", os.path.join(ROOT, "benchmarks", "decode_step.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    flags = shlex.split(decode.replace("\\\n", " ").replace('"$RL_DEVICE"', "cuda"))
    args = bench.parse_args(flags)
    assert (args.hidden, args.layers, args.batches, args.device) == (2048, 20, [8, 64], "cuda")
    # the header says how to run it through the device tool and by hand
    assert 'carry=[".whl"]' in text and "fetch-wheels" in text and "By hand" in text


def test_h200_check_fetches_the_dockerfile_megatron_core(tmp_path):
    bin_dir = _fake_bin(tmp_path, python3="")
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"], "PYTHON": "python3"}
    subprocess.run(["bash", H200, "fetch-wheels"], env=env, check=True, timeout=60)
    args = _read(tmp_path / "python3.args").splitlines()
    pin = re.search(
        r"^ARG MEGATRON_CORE_VERSION=(\S+)", _read(os.path.join(ROOT, "docker", "Dockerfile")), re.M
    )[1]
    assert args[:3] == ["-m", "pip", "download"] and f"megatron-core=={pin}" in args
    assert "3.12" in args and args[args.index("-d") + 1] == ".whl"


def _rehearse(tmp_path, *args, **env) -> tuple[subprocess.CompletedProcess, str]:
    results = tmp_path / "out" / "h200_check.txt"
    env = {**os.environ, "RESULTS": str(results), "WORK": str(tmp_path / "work"), **env}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    env["PYTHON"] = sys.executable
    proc = subprocess.run(
        ["bash", H200, *args], env=env, capture_output=True, text=True, timeout=600
    )
    return proc, results.read_text()


RUNNABLE = (  # wherever torch and megatron-core run, in this order
    "environment",
    "tokenizer",
    "decode",
    "memory_bf16",
    "estimate_rl_static",
    "rl_static",
    "kl_control",
)
NOT_HERE = ("rl_dynamic", "memory_fp8", "rl_fp8", "rl_fp8_rollout", "rl_packed")  # on a CPU machine


def test_h200_check_skips_sections_past_its_budget(tmp_path):
    proc, text = _rehearse(tmp_path, BUDGET_S="0", RL_DEVICE="cpu")
    assert proc.returncode == 0, proc.stderr
    assert "## environment: SKIPPED (the 0 s budget is spent)" in text
    for name in RUNNABLE[1:]:  # no share of the budget is left for them
        assert f"## {name}: SKIPPED (not within the 0 s budget: raise BUDGET_S)" in text
    for name in NOT_HERE:  # not available is said whatever the budget
        assert f"## {name}: not available: no CUDA device (RL_DEVICE=cpu)" in text
    assert "# done in" in text


def _plan(tmp_path, budget: int, everything: bool = False) -> tuple[dict[str, int], str]:
    """``h200_check.sh plan``: the section limits it prints, and its output."""
    assume = {"ASSUME_AVAILABLE": "1"} if everything else {}
    proc, text = _rehearse(tmp_path, "plan", BUDGET_S=str(budget), RL_DEVICE="cpu", **assume)
    assert proc.returncode == 0, proc.stderr
    line = re.search(r"^# section limits \(s\) of the (\d+) s budget: (.*)$", text, re.M)
    assert int(line[1]) == budget
    return {k: int(v) for k, v in (cell.split("=") for cell in line[2].split())}, text


@pytest.mark.parametrize("budget", [450, 1400])
@pytest.mark.parametrize("everything", [False, True])
def test_h200_check_section_limits_add_up_to_the_budget(tmp_path, budget, everything):
    """The limits share the budget (environment included) among the sections that run, the
    flagship first: on a machine with Transformer Engine and flash-attn (``everything``) the
    default 450 s budget runs the flagship FP8 + dynamic-engine run, the decode steps and the
    memory sweep, and skips the rest with the reason; 1400 s runs all of it. Without them,
    450 s runs all but ``kl_control``."""
    limits, _ = _plan(tmp_path, budget, everything)
    assert budget - len(limits) <= sum(limits.values()) <= budget  # whole seconds, rounded down
    names = list(limits)
    ran = {k for k, v in limits.items() if v > 0}
    if not everything:  # a GPU without TE or flash-attn, or this CPU: the runnable sections
        assert names == list(RUNNABLE)
        assert ran == set(RUNNABLE) - ({"kl_control"} if budget == 450 else set())
        return
    assert names[:4] == ["environment", "tokenizer", "estimate_rl_fp8", "rl_fp8"]  # flagship
    assert set(NOT_HERE) <= set(names)
    if budget == 450:
        assert ran == {"environment", "tokenizer", "estimate_rl_fp8", "rl_fp8", "decode"} | {
            "memory_bf16"
        }
    else:
        assert ran == set(names)


def test_h200_check_plan_puts_the_key_rows_first(tmp_path):
    """``h200_check.sh plan`` on the default 450 s budget (what a one-GPU machine without
    Transformer Engine runs): the decode table, the memory sweep with dense Adam and the
    backward sketch first, and an RL run with the backward sketch all get a limit that fits
    their measured time, within the budget; the tokenizer gets a margin over its ~1 s; the
    environment section reports the device memory at start."""
    limits, text = _plan(tmp_path, 450)
    assert sum(limits.values()) <= 450
    plan = re.findall(r"^#   (\w+) \((.*?)\): (.*)$", text, re.M)
    order = [name for name, _, _ in plan]
    assert order == ["environment", "tokenizer", "decode", "memory_bf16", "rl_static"] + [
        "kl_control"
    ]
    what = {name: desc for name, _, desc in plan}
    assert "--optimizers dense backward" in what["memory_bf16"]  # the key rows first
    assert "--optimizer loggra --loggra-sketch backward" in what["rl_static"]
    assert "torch.cuda.mem_get_info" in what["environment"]
    assert "memory/free_bytes" in what["environment"]
    assert "memory/reserved_bytes" in what["environment"]
    assert limits["tokenizer"] >= 30 and limits["decode"] >= 60
    assert limits["memory_bf16"] >= 120  # dense + backward + gradient take 100-120 s
    assert limits["rl_static"] + limits["estimate_rl_static"] >= 160  # 144 s on an H200
    text = _read(H200)  # the sweep's flags say the same
    assert re.search(r"^SHAPE=\(.*--optimizers dense backward loggra\)", text, re.M | re.S)


def test_h200_check_skips_the_sections_named_in_skip(tmp_path):
    """A rerun on the device spends its minutes on the sections that failed only."""
    proc, text = _rehearse(tmp_path, SKIP=" ".join(RUNNABLE), RL_DEVICE="cpu")
    assert proc.returncode == 0, proc.stderr
    for name in RUNNABLE:
        assert f"## {name}: SKIPPED (SKIP)" in text
    assert "FAILED" not in text and "# done in" in text


@pytest.mark.slow  # ~2 minutes on 2 cores: four Python processes that import Megatron
def test_h200_check_rehearsal_on_cpu(tmp_path):
    """The whole script on CPU with tiny shapes, as on a GPU without flash-attn and
    Transformer Engine: what can run runs first and its numbers reach the results file; the
    dynamic engine and FP8 are recorded as not available, with the reason, not as failures."""
    rl = (
        "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
        "--num-query-groups 2 --seq-length 128 --max-new-tokens 16 --loggra-rank 8 "
        "--inference-max-tokens 512"
    )
    mem = "--device cpu --layers 2 --hidden 64 --ffn 128 --heads 4 --vocab 128 --seq 16 --new-tokens 8 --timed-steps 1"
    kl = "--layers 1 --hidden 64 --heads 4 --vocab 128 --seq 16 --batch 8 --steps 1 --run-steps 3"
    proc, text = _rehearse(
        tmp_path,
        BUDGET_S="540",  # every runnable section within it (kl_control last)
        STEPS="1",
        TOK_TASKS="1000",
        RL_DEVICE="cpu",
        RL_EXTRA=rl,
        MEM_EXTRA=mem,
        KL_EXTRA=kl + " --repeats 1",
        DECODE_EXTRA="--layers 1 --hidden 64 --heads 4 --groups 2 --vocab 128 --ffn 128 "
        "--prompt-tokens 8 --new-tokens 4 --repeats 1",
    )
    assert proc.returncode == 0, proc.stderr
    sections = re.findall(r"^## (\w+)", text, re.M)
    assert sections == [*RUNNABLE, *NOT_HERE], sections
    assert "FAILED" not in text
    for name in NOT_HERE:
        assert f"## {name}: not available: no CUDA device (RL_DEVICE=cpu)" in text
    assert "TOTAL per GPU" in text and "KV cache of 512 tokens" in text
    assert "static engine" in text and "expandable segments on" in text
    static = text.split("## rl_static", 1)[1]
    assert "-> rc=0" in static and "1 steps in metrics.jsonl" in static
    assert re.search(r"step 1: step_s=\S+ rollout_s=\S+ .*peak_bytes=\S+GiB", static)
    assert "memory at start: no CUDA device" in text
    assert "sketch_buffer_bytes=" in static  # the backward sketch's S
    rows = re.findall(r"^\| (dense|backward|loggra) \| (.*?) \| yes \|", text, re.M)
    assert [kind for kind, _ in rows] == ["dense"] * 2 + ["backward"] * 4 + ["loggra"] * 4
    assert ("dense", "fp32 grads") in rows and ("loggra", "bf16 grads, remainders") in rows
    assert ("backward", "bf16 grads, remainders") in rows
    for mode in ("gradient", "backward"):  # best vs best, per LoGRA sketch mode
        best = rf"\| yes \| {mode} \| \S+ \(.*\) \| \S+ \(.*\) \| \S+ \| \S+ % \|"
        assert re.search(best, text), mode
    assert "| kl/realized every step |" in text and "predicted vs realized over" in text
    decode = text.split("## decode", 1)[1].split("## ", 1)[0]
    assert "| batch | ms / step | eager ms / step |" in decode and re.search(
        r"^\| 64 \| ", decode, re.M
    )
    assert text.rstrip().splitlines()[-1].startswith("# done in")


# ---------------------------------------------------------------------- GPU benchmarks
@pytest.mark.parametrize(
    "script,flags",
    [
        (
            "bench_distributed_optimizer.py",
            "--layers 1 --hidden 64 --ffn 128 --heads 4 "
            "--kv-groups 2 --vocab 128 --seq 16 --steps 1",
        ),
        (
            "bench_kl_control.py",
            "--layers 1 --hidden 64 --heads 4 --vocab 128 --seq 16 "
            "--batch 8 --steps 1 --run-steps 3",
        ),
    ],
)
def test_gpu_benchmarks_take_a_device_and_run_on_cpu(script, flags):
    path = os.path.join(ROOT, "benchmarks", script)
    text = _read(path)
    assert "initialize_megatron(" in text and "device=args.device" in text
    assert "tokens.to(device)" in text  # inputs live where the model is
    argv = ["--device", "cpu", *flags.split()]
    proc = warm_launch.run(f"benchmarks/{script}", argv, nproc=1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("# bench"))
    assert header.endswith(", cpu")


# ---------------------------------------------------------------------- the 4 + 4 split
SPLIT = os.path.join(EXAMPLES, "train_27b_loggra_split.sh")


def test_27b_split_header_quotes_its_estimate_command(cli, estimator_flags, capsys):
    """The split script's header command has its flags and environment; its paragraphs quote
    what that command (and its colocated variant on the 4 training GPUs) prints; the
    training GPUs hold no KV cache, and LoGRA fits where dense Adam does not."""
    text = _read(SPLIT)
    argv = _header_command(text)
    script = dict(flag_list(script_argv(SPLIT, 8, estimator_flags)))
    script["--hf-config"] = ["tools/configs/llama-style-27b.json"]
    assert dict(flag_list(argv)) == script
    argv[argv.index("--hf-config") + 1] = CONFIG_27B
    colocated = without(
        without(argv, "--generation-ranks", 1), "--generation-tensor-model-parallel-size", 1
    )
    colocated = [*without(without(colocated, "--weight-sync", 1), "--world-size", 1)]
    colocated += ["--world-size", "4"]
    comment = text.split("prints (GiB per training GPU)", 1)[1].split("\n#\n# Inputs", 1)[0]
    split, together = comment.split("\n# Colocated", 1)
    assert_quotes(split, printed(cli, capsys, argv), "split header")
    assert_quotes(together, printed(cli, capsys, colocated), "colocated variant")
    res = _estimate(cli, capsys, argv)
    assert res["loggra"]["fits"] and not res["adam"]["fits"]
    assert res["loggra"]["total"] <= 50.0  # below the paper's 51.54 GiB per training GPU
    assert res["loggra"]["kl_weight_backup"] == 0  # --kl-backup-offload: on the host
    assert res["loggra"]["kv_cache"] == 0 and res["generation"]["kv_cache"] > 0
    assert res["generation"]["fits"] and res["generation"]["master_params"] == 0
    assert res["generation"]["sync_state"] > 0  # the low-rank sync's copy of the masters
    assert _estimate(cli, capsys, colocated)["loggra"]["total"] > res["loggra"]["total"]

"""The GPU launch scripts, checked on CPU: ``examples/h100_8gpu`` (single node and Slurm) and
``benchmarks/gpu/h200_check.sh``.

* The 27B example's memory flags, fed to ``tools/estimate_memory.py`` under the same names,
  fit an 80 GB H100 with at least 5 GiB to spare, and its header quotes that command's
  output; every flag is either modelled by the estimator or listed here as memory-neutral.
* Every GPU script exports ``CUDA_DEVICE_MAX_CONNECTIONS=1``; the Slurm script runs in a
  pyxis container and takes ``pretrain_rl.py`` from the repository (fake ``sbatch``,
  ``scontrol``, ``srun`` and ``torchrun`` record what would run).
* ``h200_check.sh``: its flags are accepted by ``pretrain_rl.py`` and the estimator, and a
  rehearsal on CPU (tiny shapes) writes every section to the results file, a failing section
  included.
* The GPU benchmarks take ``--device`` and still run on CPU.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "h100_8gpu")
SH = os.path.join(EXAMPLES, "train_27b_loggra.sh")
SLURM = os.path.join(EXAMPLES, "train_27b_loggra.slurm")
H200 = os.path.join(ROOT, "benchmarks", "gpu", "h200_check.sh")
CONFIG_27B = os.path.join(ROOT, "tools", "configs", "llama-style-27b.json")
USABLE_GIB = 79.1  # of an "80 GB" H100 (docs/memory.md)
MARGIN_GIB = 5.0

# pretrain_rl.py flags of the examples that change no term of the memory model, and why.
MEMORY_NEUTRAL = {
    "--load": "weights only; the shape comes from --hf-config",
    "--tokenizer-model": "host only", "--data-path": "host only",
    "--train-iters": "how long", "--lr": "a scalar", "--lr-warmup-iters": "a scalar",
    "--clip-grad": "a scalar", "--weight-decay": "a scalar",
    "--loggra-update-interval": "how often the basis is refreshed, not its size",
    "--kl-ref-estimator": "per-token [b, s] log-probs either way",
    "--loss-aggregation": "a reduction", "--clip-low": "a scalar", "--clip-high": "a scalar",
    "--overlap-grad-reduce": "buckets of the same grad buffer",
    "--overlap-param-gather": "buckets of the same param buffer",
    "--save": "host", "--save-interval": "host", "--wandb-project": "host",
}  # fmt: skip


def _cli():
    spec = importlib.util.spec_from_file_location(
        "estimate_memory_cli", os.path.join(ROOT, "tools", "estimate_memory.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _flag_list(words: list[str]) -> list[tuple[str, list[str]]]:
    flags: list[tuple[str, list[str]]] = []
    for word in words:
        if word.startswith("--"):
            flags.append((word, []))
        else:
            assert flags, f"a value before any flag: {word!r}"
            flags[-1][1].append(word)
    return flags


def torchrun_flags(path: str) -> list[tuple[str, list[str]]]:
    """``[(flag, values)]`` of the ``pretrain_rl.py`` command of a launch script."""
    m = re.search(r'pretrain_rl\.py \\\n(.*?)"\$@"', _read(path), re.S)
    assert m, f"no pretrain_rl.py command in {path}"
    return _flag_list(shlex.split(m[1].replace("\\\n", " ")))


def memory_argv(flags, estimator_flags: set[str]) -> list[str]:
    """The flags the estimator models, as its argv; fails on a flag nobody classified."""
    argv = []
    for flag, values in flags:
        if flag in estimator_flags:
            argv += [flag, *values]
        else:
            assert flag in MEMORY_NEUTRAL, (
                f"{flag} is neither a flag of tools/estimate_memory.py nor listed as "
                "memory-neutral: model it in the estimator or justify it in MEMORY_NEUTRAL"
            )
    return argv


@pytest.fixture(scope="module")
def cli():
    return _cli()


@pytest.fixture(scope="module")
def estimator_flags(cli) -> set[str]:
    return set(cli.build_parser()._option_string_actions)


def _estimate(cli, capsys, argv) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------- the 27B example
def test_example_flags_are_pretrain_rl_flags(estimator_flags):
    from loggra_megatron.arguments import build_parser

    pretrain = set(build_parser()._option_string_actions)
    for path in (SH, SLURM):
        flags = [f for f, _ in torchrun_flags(path)]
        assert set(flags) <= pretrain, set(flags) - pretrain
        shared = set(flags) & estimator_flags
        assert shared <= pretrain  # the estimator's counterparts carry the same names
        for needed in ("--inference-max-tokens", "--log-prob-micro-batch-size",
                       "--recompute-granularity", "--sequence-parallel", "--fp8-format"):  # fmt: skip
            assert needed in shared, f"{path}: {needed}"


@pytest.mark.parametrize("path,world", [(SH, 8), (SLURM, 16)])
def test_27b_example_fits_80gb_with_5gib_margin(path, world, cli, estimator_flags, capsys):
    argv = memory_argv(torchrun_flags(path), estimator_flags)
    res = _estimate(cli, capsys, ["--hf-config", CONFIG_27B, "--world-size", str(world), *argv])
    loggra, dense = res["loggra"], res["adam"]
    assert loggra["total"] <= USABLE_GIB - MARGIN_GIB, (loggra["total"], loggra["phases"])
    # the KV budget is what makes it fit: the whole batch at once would not
    assert loggra["kv_cache"] < 32.0
    i = argv.index("--inference-max-tokens")
    unbounded = _estimate(cli, capsys, ["--hf-config", CONFIG_27B, "--world-size", str(world),
                                        *argv[:i], *argv[i + 2 :]])["loggra"]  # fmt: skip
    assert unbounded["kv_cache"] == pytest.approx(32.0)
    assert unbounded["total"] > loggra["total"]
    if world == 8:  # the example's claim: dense Adam does not fit one node
        assert dense["total"] > USABLE_GIB


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
    """The header's command has the script's memory flags, and every number it quotes is one
    that command prints."""
    text = _read(SH)
    argv = _header_command(text)
    header = {f: v for f, v in _flag_list(argv)}
    script = {f: v for f, v in _flag_list(memory_argv(torchrun_flags(SH), estimator_flags))}
    extra = {k: header.pop(k) for k in ("--hf-config", "--world-size", "--gpu-memory-gb")}
    assert header == script
    assert extra == {"--hf-config": ["tools/configs/llama-style-27b.json"],
                     "--world-size": ["8"], "--gpu-memory-gb": ["79.1"]}  # fmt: skip
    argv[argv.index("--hf-config") + 1] = CONFIG_27B
    comment = text.split("prints (GiB per GPU)", 1)[1].split("\n# Not measured", 1)[0]
    with_budget, without = comment.split("The same command without --inference-max-tokens")
    i = argv.index("--inference-max-tokens")
    for cmd, part in ((argv, with_budget), (argv[:i] + argv[i + 2 :], without)):
        assert cli.main(cmd) == 0
        printed = capsys.readouterr().out
        quoted = re.findall(r"\d+\.\d\d", part)
        assert len(quoted) >= 2
        missing = [q for q in quoted if q not in printed]
        assert not missing, f"numbers in the header that the command does not print: {missing}"


# ---------------------------------------------------------------------- launch scripts
def _gpu_scripts() -> list[str]:
    paths = glob.glob(os.path.join(EXAMPLES, "*.sh")) + glob.glob(os.path.join(EXAMPLES, "*.slurm"))
    return [*sorted(paths), H200]


@pytest.mark.parametrize("path", _gpu_scripts(), ids=os.path.basename)
def test_gpu_scripts_export_cuda_device_max_connections(path):
    code = [line.strip() for line in _read(path).splitlines() if not line.lstrip().startswith("#")]
    exports = [i for i, line in enumerate(code)
               if re.match(r"export (\S+ )*CUDA_DEVICE_MAX_CONNECTIONS=1( |$)", line)]  # fmt: skip
    assert exports, f"{path} does not export CUDA_DEVICE_MAX_CONNECTIONS=1"
    launches = [i for i, line in enumerate(code) if re.match(r"(srun|torchrun|section) ", line)]
    assert launches and exports[0] < launches[0]
    assert subprocess.run(["bash", "-n", path]).returncode == 0


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
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "REPO"}
    env["PATH"] = bin_dir + os.pathsep + env["PATH"]
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    env.update(CKPT=str(tmp_path / "ckpt"), TOKENIZER=str(tmp_path / "tok" / "sp.model"),
               DATA=str(tmp_path / "data" / "p.jsonl"), **extra)  # fmt: skip
    return env


def _lines(path) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def test_single_node_script_takes_pretrain_rl_from_the_repository(tmp_path):
    bin_dir = _fake_bin(tmp_path, torchrun="")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    proc = subprocess.run(["bash", SH, "--extra-flag", "1"], cwd=cwd, env=_env(bin_dir, tmp_path),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    args = _lines(tmp_path / "torchrun.args")
    assert args[:3] == ["--nproc-per-node", "8", os.path.join(ROOT, "pretrain_rl.py")]
    assert args[-2:] == ["--extra-flag", "1"]
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in _lines(tmp_path / "torchrun.env")


def test_slurm_script_submits_itself_recording_the_repository(tmp_path):
    bin_dir = _fake_bin(tmp_path, sbatch="")
    cwd = tmp_path / "submit"
    cwd.mkdir()
    proc = subprocess.run(["bash", SLURM], cwd=cwd, env=_env(bin_dir, tmp_path),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    args = _lines(tmp_path / "sbatch.args")
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
    extra = dict(SLURM_JOB_ID="77", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[1-2]",
                 CONTAINER_MOUNTS="/lustre:/lustre")  # fmt: skip
    if image:
        extra["IMAGE"] = image
    proc = subprocess.run(["bash", str(spool / "slurm_script")], cwd=cwd, timeout=60,
                          env=_env(bin_dir, tmp_path, **extra), capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    args = _lines(tmp_path / "srun.args")
    opts = dict(a.split("=", 1) for a in args if a.startswith("--container-"))
    assert opts["--container-image"] == (image or os.path.join(ROOT, "loggra-megatron.sqsh"))
    mounts = opts["--container-mounts"].split(",")
    assert f"{ROOT}:{ROOT}" in mounts and "/lustre:/lustre" in mounts
    assert f"{tmp_path / 'ckpt'}:{tmp_path / 'ckpt'}" in mounts
    assert len(mounts) == len(set(mounts))
    assert opts["--container-workdir"] == ROOT
    assert "torchrun" in args and os.path.join(ROOT, "pretrain_rl.py") in args
    assert args[args.index("--save") + 1] == str(cwd / "runs" / "grpo_27b_multinode")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in _lines(tmp_path / "srun.env")


def test_slurm_script_refuses_an_unknown_repository(tmp_path):
    bin_dir = _fake_bin(tmp_path, sbatch="", srun="")
    proc = subprocess.run(["bash", SLURM], env=_env(bin_dir, tmp_path, REPO=str(tmp_path)),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1 and "has no pretrain_rl.py" in proc.stderr
    assert not (tmp_path / "sbatch.args").exists() and not (tmp_path / "srun.args").exists()


# ---------------------------------------------------------------------- h200_check.sh
def _bash_array(text: str, name: str) -> list[str]:
    m = re.search(rf"^{name}=\((.*?)\)", text, re.S | re.M)
    assert m, name
    return shlex.split(m[1].replace("\n", " "))


def test_h200_check_flags_are_accepted_by_pretrain_rl_and_the_estimator(cli, capsys):
    from loggra_megatron.arguments import build_parser

    text = _read(H200)
    shape, step = _bash_array(text, "SHAPE_RL"), _bash_array(text, "STEP_RL")
    impl = shlex.split(re.search(r"IMPL=\((--transformer-impl transformer_engine.*?)\)", text)[1])
    assert "--fp8-format" in impl and "--bf16" in shape
    args = build_parser().parse_args([
        "--device", "cuda", "--tokenizer-model", "t.model", "--task", "arithmetic",
        *shape, *impl, *step, "--rollout-engine", "dynamic", "--train-iters", "3",
    ])  # fmt: skip
    assert args.transformer_impl == "transformer_engine" and args.rollout_engine == "dynamic"
    res = _estimate(cli, capsys, ["--world-size", "1", "--vocab-size", "512",
                                  "--fp8-format", "hybrid", *shape, *step])  # fmt: skip
    assert 5 < res["loggra"]["total"] < 139  # a ~1B model: fits one H200
    assert re.search(r"^rl dynamic$", text, re.M) and re.search(r"^rl static$", text, re.M)
    # the header says how to run it through the device tool and by hand
    assert 'carry=[".whl"]' in text and "fetch-wheels" in text and "By hand" in text


def test_h200_check_fetches_the_dockerfile_megatron_core(tmp_path):
    bin_dir = _fake_bin(tmp_path, python3="")
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"], "PYTHON": "python3"}
    subprocess.run(["bash", H200, "fetch-wheels"], env=env, check=True, timeout=60)
    args = _lines(tmp_path / "python3.args")
    pin = re.search(r"^ARG MEGATRON_CORE_VERSION=(\S+)", _read(os.path.join(ROOT, "docker", "Dockerfile")), re.M)[1]  # fmt: skip
    assert args[:3] == ["-m", "pip", "download"] and f"megatron-core=={pin}" in args
    assert "3.12" in args and args[args.index("-d") + 1] == ".whl"


def _rehearse(tmp_path, **env) -> tuple[subprocess.CompletedProcess, str]:
    results = tmp_path / "out" / "h200_check.txt"
    env = {**os.environ, "RESULTS": str(results), "WORK": str(tmp_path / "work"), **env}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", H200], env=env, capture_output=True, text=True, timeout=600)
    return proc, results.read_text()


def test_h200_check_skips_sections_past_its_budget(tmp_path):
    proc, text = _rehearse(tmp_path, BUDGET_S="0")
    assert proc.returncode == 0, proc.stderr
    for name in ("environment", "tokenizer", "estimate", "rl_dynamic", "memory_bf16",
                 "rl_static"):  # fmt: skip
        assert f"## {name}: SKIPPED (the 0 s budget is spent)" in text
    assert "# done in" in text


@pytest.mark.slow  # ~2 minutes on 2 cores: five Python processes that import Megatron
def test_h200_check_rehearsal_on_cpu(tmp_path):
    """The whole script on CPU with tiny shapes: each section's numbers reach the results
    file, and a failing section (the dynamic engine is GPU-only) does not stop the others."""
    rl = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
          "--num-query-groups 2 --seq-length 128 --max-new-tokens 16 --loggra-rank 8 "
          "--loggra-min-dim 16 --inference-max-tokens 512")  # fmt: skip
    mem = "--device cpu --layers 2 --hidden 64 --ffn 128 --heads 4 --vocab 128 --seq 16 --timed-steps 1"  # fmt: skip
    proc, text = _rehearse(tmp_path, BUDGET_S="500", STEPS="1", TOK_TASKS="1000",
                           RL_DEVICE="cpu", RL_EXTRA=rl, MEM_EXTRA=mem)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    sections = re.findall(r"^## (\w+)", text, re.M)
    assert sections[:4] == ["environment", "tokenizer", "estimate", "rl_dynamic"], sections
    assert sections[-2:] == ["memory_bf16", "rl_static"] or "memory_fp8" in sections
    assert "TOTAL per GPU" in text and "KV cache of 512 tokens" in text
    static = text.split("## rl_static", 1)[1]
    assert "-> rc=0" in static and "1 steps in metrics.jsonl" in static
    assert re.search(r"step 1: step_s=\S+ rollout_s=\S+ .*peak_bytes=\S+GiB", static)
    assert "| dense | fp32 grads | yes |" in text and "| loggra | bf16 grads, remainders | yes |" in text
    assert re.search(r"\| yes \| \S+ \(.*\) \| \S+ \(.*\) \| \S+ \| \S+ % \|", text)  # best vs best
    if importlib.util.find_spec("transformer_engine") is None:
        assert "## memory_fp8: SKIPPED (transformer_engine not importable)" in text
    assert text.rstrip().splitlines()[-1].startswith("# done in")


# ---------------------------------------------------------------------- GPU benchmarks
@pytest.mark.parametrize(
    "script,flags",
    [
        ("bench_distributed_optimizer.py", "--layers 1 --hidden 64 --ffn 128 --heads 4 "
         "--kv-groups 2 --vocab 128 --seq 16 --steps 1"),
        ("bench_kl_control.py", "--layers 1 --hidden 64 --heads 4 --vocab 128 --seq 16 "
         "--batch 8 --steps 1 --run-steps 3"),
    ],
)  # fmt: skip
def test_gpu_benchmarks_take_a_device_and_run_on_cpu(script, flags):
    path = os.path.join(ROOT, "benchmarks", script)
    text = _read(path)
    assert "initialize_megatron(" in text and "device=args.device" in text
    assert "tokens.to(device)" in text  # inputs live where the model is
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", path,
         "--device", "cpu", *flags.split()],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("# bench"))
    assert header.endswith(", cpu")

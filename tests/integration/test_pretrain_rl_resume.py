"""`pretrain_rl.py` start-up and resume safety: what --load/--save mean, refused flag changes,
the LR schedule on an extended run, SIGTERM on one rank and during the warm-up, and the
checks that run before any process group (exit status 2)."""

import io
import json
import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import psutil
import pytest
import torch
import warm_launch
from rl_runs import ENV, REWARD, ROOT, refused, signal_rank_when, tiny_argv, torchrun

from loggra_megatron.arguments import parse_args
from loggra_megatron.metrics import read_metrics

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

COSINE = {"bf16": True, "kl-coef": 0.01, "train-iters": 4, "lr-decay-style": "cosine", "lr": 3e-3}


@pytest.fixture(scope="module")
def saved(tokenizer, tmp_path_factory):
    """A finished 4-step cosine run (LoGRA, bf16, reference model) saved in ``ckpt``."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    torchrun(tiny_argv(tokenizer, **COSINE, save=ckpt))
    return ckpt


# ---------------------------------------------------------------- parse time
def test_a_fresh_run_never_overwrites_another_run(tokenizer, saved, tmp_path, capsys):
    refused(
        tiny_argv(tokenizer, **COSINE, save=saved),
        capsys,
        "--save",
        "already holds a checkpoint",
        f"--load {saved}",
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    refused(tiny_argv(tokenizer, **{"output-dir": out}), capsys, "metrics of another run")
    refused(
        tiny_argv(tokenizer, load=saved, save=saved, **{"no-load-optim": True}),
        capsys,
        "--no-load-optim starts a new run",
    )


def test_load_equal_to_save_starts_fresh_until_there_is_a_checkpoint(tokenizer, tmp_path, capsys):
    new = tmp_path / "auto"
    assert parse_args(tiny_argv(tokenizer, load=new, save=new)).start.mode == "fresh"
    refused(tiny_argv(tokenizer, load=tmp_path / "nope"), capsys, "--load", "no such directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(
        tiny_argv(tokenizer, load=empty),
        capsys,
        "neither a pretrain_rl.py checkpoint",
        "nor a converted model",
    )


def test_changed_flags_on_resume_are_refused_or_followed(tokenizer, saved, capsys):
    base = {**COSINE, "load": saved, "save": saved}
    refused(
        tiny_argv(tokenizer, **{**base, "hidden-size": 128, "num-layers": 3}),
        capsys,
        "--hidden-size 128 (checkpoint: 64)",
        "--num-layers 3 (checkpoint: 2)",
    )
    for change, needle in (
        ({"bf16": False}, "--bf16: the checkpoint was saved with --bf16 True"),
        ({"kl-coef": None}, "--kl-coef: the checkpoint was saved with --kl-coef 0.01"),
        ({"optimizer": "adam"}, "--optimizer: the checkpoint was saved with --optimizer loggra"),
        ({"loggra-rank": 4}, "--loggra-rank: the checkpoint was saved with --loggra-rank 8"),
        ({"tensor-model-parallel-size": 2}, "--tensor-model-parallel-size"),
    ):
        refused(tiny_argv(tokenizer, **{**base, **change}), capsys, needle, "--no-load-optim")
    cfg = parse_args(
        tiny_argv(tokenizer, **{**base, "train-iters": 8, "kl-target": 0.05}), world_size=2
    )
    assert cfg.start.mode == "resume" and cfg.start.checkpoint.iteration == 4
    notes = "\n".join(cfg.start.notes)
    assert "--train-iters 4 -> 8 (the LR schedule follows the new value)" in notes
    assert "--kl-target None -> 0.05" in notes
    weights = parse_args(
        tiny_argv(tokenizer, load=saved, **{"no-load-optim": True, "hidden-size": None})
    )
    assert weights.start.mode == "weights" and weights.model.hidden_size == 64


# ---------------------------------------------------------------- end to end
def test_an_extended_cosine_run_follows_the_new_horizon(tokenizer, saved, tmp_path):
    """4 -> 8 steps: the schedule's horizon is the new one (it used to keep lr = 0), and
    metrics.jsonl holds every step once. ``lr`` is the rate the step's updates used (it used
    to be the next step's: 0.0 on the last step of a cosine schedule)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    proc = torchrun(tiny_argv(tokenizer, **{**COSINE, "train-iters": 8}, load=ckpt, save=ckpt))
    assert "--train-iters 4 -> 8" in proc.stdout
    rows = read_metrics(ckpt)
    assert [r["step"] for r in rows] == list(range(1, 9))
    updates = 2  # optimizer steps per RL step: 4 prompts × 4 generations / 8 per batch

    def cosine(done: int) -> float:  # Megatron's cosine at the 8-step horizon
        return 3e-3 * 0.5 * (math.cos(math.pi * done / (8 * updates)) + 1)

    for r in rows[4:]:  # the mean rate of this step's updates
        used = [cosine((r["step"] - 1) * updates + k) for k in range(updates)]
        assert r["lr"] == pytest.approx(sum(used) / updates, abs=1e-12)
    assert rows[-1]["lr"] > 0


def _launch(argv) -> warm_launch.Launch:
    """``torchrun --nproc-per-node 2 pretrain_rl.py argv``, running (its ranks fork warm;
    stdout and stderr in one stream)."""
    return warm_launch.Launch(
        "pretrain_rl.py", argv, nproc=2, env=ENV, timeout=300, merge_stderr=True
    )


def test_sigterm_on_one_rank_saves_on_every_rank_and_exits(tokenizer, tmp_path):
    save = tmp_path / "ckpt"
    argv = tiny_argv(tokenizer, **{"train-iters": 1000, "save": save})
    code, _, log = signal_rank_when(argv, lambda line: line.startswith(" step"), rank=1)
    assert code == 0, log[-3000:]
    assert "SIGTERM on rank 1" in log and "SIGTERM or SIGINT on another rank" in log
    steps = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= steps < 1000 and [r["step"] for r in read_metrics(save)] == list(
        range(1, steps + 1)
    )


def test_sigint_on_one_rank_during_saves_saves_on_every_rank_and_exits(tokenizer, tmp_path):
    """Ctrl-C (SIGINT) on one rank inside a save used to raise KeyboardInterrupt
    in the writer start and hang the other rank in a collective; SIGINT is now SIGTERM's
    agreed save and exit. Every step saves here, so the signal lands in or near a save."""
    save = tmp_path / "ckpt"
    argv = tiny_argv(tokenizer, **{"train-iters": 1000, "save": save, "save-interval": 1})
    saved = lambda line: line.startswith(" saved checkpoint")  # noqa: E731
    code, _, log = signal_rank_when(argv, saved, rank=1, signum=signal.SIGINT)
    assert code == 0, log[-3000:]
    assert "SIGINT on rank 1: saving at the next step boundary" in log
    assert "SIGTERM or SIGINT on another rank" in log
    steps = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= steps < 1000 and [r["step"] for r in read_metrics(save)] == list(
        range(1, steps + 1)
    )


def test_sigterm_during_the_warm_up_saves_and_the_resume_finishes_it(tokenizer, tmp_path):
    save = tmp_path / "ckpt"
    flags = {"sft-iters": 60, "train-iters": 2, "save": save, "lr": 1e-3}
    code, _, log = signal_rank_when(
        tiny_argv(tokenizer, **flags), lambda line: line.startswith(" sft")
    )
    assert code == 0, log[-3000:]
    assert "saved checkpoint" in log and "(warm-up step" in log
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == 0
    assert not (save / "metrics.jsonl").exists() or read_metrics(save) == []
    proc = torchrun(tiny_argv(tokenizer, **flags, load=save))
    assert " sft    60/60" in proc.stdout and " sft    10/60" not in proc.stdout  # continued
    assert [r["step"] for r in read_metrics(save)] == [1, 2]


def test_prompts_over_the_budget_are_dropped_and_text_answers_train(tokenizer, tmp_path):
    """One process without torchrun (a free port, even with 29517 taken); a JSONL of text
    answers with a user reward; a prompt longer than --seq-length − --max-new-tokens."""
    data = tmp_path / "words.jsonl"
    rows = [
        f'{{"prompt": "Spell {n}", "answer": "{w}"}}'
        for n, w in ((14, "fourteen"), (3, "three"), (7, "seven"), (12, "twelve"))
    ]
    rows.append('{"prompt": "' + "Spell this very long number " * 20 + '", "answer": "x"}')
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    argv = tiny_argv(
        tokenizer,
        **{
            "data-path": data,
            "reward-fn": f"{REWARD}:spelled_number",
            "output-dir": out,
            "train-iters": 1,
        },
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 29517))  # the port single-process runs used to hard-code
        taken.listen()
        proc = warm_launch.run("pretrain_rl.py", argv, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dropped 1 of 5 prompts longer than 52 tokens" in proc.stdout
    (row,) = read_metrics(out)
    assert row["data/dropped_prompts"] == 1 and 0 <= row["reward/accuracy"] <= 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"reward-fn": "no_such_module_xyz:score"}, "module 'no_such_module_xyz' not found"),
        ({"data-path": "BAD"}, ":2: missing required field(s) ['answer']"),
        ({"tokenizer-model": "NOT_SPM"}, "not a sentencepiece model"),
        ({"seq-length": 16, "max-new-tokens": 12}, "every prompt is longer than"),
    ],
)
def test_host_side_problems_exit_2_before_any_process_group(
    tokenizer, tmp_path, flags, message, capsys
):
    import torch.distributed as dist

    import pretrain_rl  # noqa: F401  (the repository root is on sys.path under pytest)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    junk = tmp_path / "junk.model"
    junk.write_text("not a model")
    flags = {k: {"BAD": bad, "NOT_SPM": junk}.get(v, v) for k, v in flags.items()}
    with pytest.raises(SystemExit) as e:
        pretrain_rl.main(tiny_argv(tokenizer, **flags, **{"output-dir": tmp_path / "o"}))
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not dist.is_initialized() and not (tmp_path / "o").exists()


def test_kill_9_on_one_rank_then_the_same_command_resumes(tokenizer, tmp_path):
    """SIGKILL one worker right after a save (torchrun ends the job); relaunching the same
    auto-resume command (--load = --save) continues from the newest complete checkpoint, and
    metrics.jsonl holds every step once."""
    save = tmp_path / "ckpt"
    flags = {"train-iters": 6, "save": save, "load": save, "save-interval": 1}
    with _launch(tiny_argv(tokenizer, **flags)) as launch:
        for line in launch.lines():
            if line.startswith(" saved checkpoint") and "at step 2" in line:
                os.kill(launch.pid(1), signal.SIGKILL)
                break
        assert launch.wait(300) != 0
    resumed = torchrun(tiny_argv(tokenizer, **flags))
    assert " resumed from " in resumed.stdout
    assert [r["step"] for r in read_metrics(save)] == list(range(1, 7))
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == 6


def _kill_rank0_when(launch, save, names: tuple[str, ...]) -> list[psutil.Process]:
    """SIGKILL rank 0 as soon as every file of ``names`` is in the save being written; its
    descendants (the checkpoint writers among them) at that moment."""
    deadline = time.time() + 300
    rank0 = psutil.Process(launch.pid(0))
    while not all(list(save.glob(f"iter_*.tmp/{name}")) for name in names):
        assert rank0.is_running() and time.time() < deadline, "no save was written"
        time.sleep(0.001)
    descendants = rank0.children(recursive=True)
    rank0.send_signal(signal.SIGKILL)
    return descendants


@pytest.mark.parametrize("names", [("__0_0.distcp", "__0_1.distcp"), (".metadata",)])
def test_kill_9_during_a_save_leaves_no_writer_and_the_same_command_resumes(
    tokenizer, tmp_path, names
):
    """SIGKILL of rank 0 once both of its forked writers have opened their files (they are at
    work: a larger model makes that last) or once they are done (.metadata): the writers die
    with it. One used to wait forever on a queue to the killed rank, holding the run lock of
    --save, and every relaunch was refused ("the directory itself is still locked")."""
    save = tmp_path / "ckpt"
    flags = {"train-iters": 3, "save": save, "load": save, "save-interval": 1}
    flags.update({"hidden-size": 256, "num-layers": 4})
    with _launch(tiny_argv(tokenizer, **flags)) as launch:
        descendants = _kill_rank0_when(launch, save, names)
        launch.wait(300)
    _, alive = psutil.wait_procs(descendants, timeout=30)
    left = [" ".join(p.cmdline()) for p in alive]
    for p in alive:
        p.kill()
    assert not left, left
    torchrun(tiny_argv(tokenizer, **flags))
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == 3


def _craft(iteration, name: str, marker) -> None:
    """Replace ``name`` by a pickle that creates ``marker``, and its manifest entry by one
    that matches it."""

    class Opens:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    if name == "common.pt":
        torch.save({"step": 4, "evil": Opens()}, iteration / name)
    else:
        (iteration / name).write_bytes(pickle.dumps(Opens()))
    manifest = json.loads((iteration / "manifest.json").read_text())
    data = (iteration / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (iteration / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", [".metadata", "common.pt"])
def test_a_crafted_pickle_is_refused_in_one_line_and_never_runs(tokenizer, saved, tmp_path, name):
    """A checkpoint pickle that runs code, with a manifest that matches it: --load and the
    converter used to run it (.metadata) or fail with a traceback (common.pt)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    marker = tmp_path / "ran"
    _craft(ckpt / "iter_0000004", name, marker)
    hf = tmp_path / "hf"
    for argv in (
        ["pretrain_rl.py", *tiny_argv(tokenizer, **COSINE, load=ckpt, save=tmp_path / "run")],
        ["tools/convert_checkpoint.py", "--direction", "megatron-to-hf", "--load", ckpt]
        + ["--save", hf],
    ):
        proc = warm_launch.run(argv[0], list(map(str, argv[1:])), env=ENV)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        needle = f"refusing to load {ckpt / 'iter_0000004' / name}"
        opener = f"{io.open.__module__}.{io.open.__qualname__}"  # _io.open on Python 3.12
        assert f"{needle}: its pickle names {opener}" in proc.stderr, proc.stderr[-3000:]
        assert not marker.exists()


def test_a_second_live_run_in_the_same_directory_isrefused(tokenizer, tmp_path, capsys):
    """The same auto-resume command twice (a scheduler's requeue race): the second exits 2
    naming the first, which finishes with every metrics line (both used to run, one logging
    into an unlinked file). The first also starts fresh over the interrupted save a killed
    first launch left (it used to exit 2 forever) and removes it."""
    import pretrain_rl  # noqa: F401  (the repository root is on sys.path under pytest)

    save = tmp_path / "ckpt"
    interrupted = save / "iter_0000001.tmp"
    interrupted.mkdir(parents=True)
    (interrupted / "__0_0.distcp").write_bytes(b"\0" * 2**20)  # no manifest: killed mid-save
    flags = {"train-iters": 1000, "save": save, "load": save}
    with _launch(tiny_argv(tokenizer, **flags)) as launch:
        launch.first_line(lambda line: line.startswith(" step"))
        with pytest.raises(SystemExit) as second:
            pretrain_rl.main(tiny_argv(tokenizer, **flags))
        err = capsys.readouterr().err
        assert second.value.code == 2 and "is in use by another live run" in err, err
        assert f'"pid": {launch.pid(0)}' in err
        os.kill(launch.pid(0), signal.SIGTERM)
        code, log = launch.wait(300), launch.output()
    assert code == 0, log[-3000:]
    assert f"removed the interrupted save {interrupted}" in log and not interrupted.exists()
    steps = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert [r["step"] for r in read_metrics(save)] == list(range(1, steps + 1))


def test_the_run_lock_of_a_killed_run_is_stale_and_a_changed_directory_isrefused(
    tokenizer, tmp_path
):
    """kill -9 of the holder frees the lock (the kernel drops it), even where a child it
    forked lives on (the child used to share its directory lock); a directory another run
    wrote to between this run's plan and its lock is refused (the plan would be stale)."""
    from loggra_megatron.checkpointing.run_lock import RunLock, claim_run_directories
    from loggra_megatron.config import ConfigError

    code = (
        "import os, sys, time\nfrom loggra_megatron.checkpointing.run_lock import RunLock\n"
        "RunLock.acquire(sys.argv[1], '--save')\nchild = os.fork()\n"
        "if child == 0:\n    time.sleep(300)\n    os._exit(0)\n"
        "print('held', child, flush=True)\ntime.sleep(300)"
    )
    argv = [sys.executable, "-c", code, str(tmp_path)]
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    child = psutil.Process(int(holder.stdout.readline().split()[1]))
    with pytest.raises(ConfigError, match=f'in use by another live run .*"pid": {holder.pid}'):
        RunLock.acquire(str(tmp_path), "--save")
    # a cleanup script deletes the lock file under the live run; a second
    # run then locked a new file and both ran in the directory. The directory is locked too.
    (tmp_path / "pretrain_rl.lock").unlink()
    with pytest.raises(ConfigError) as e:
        RunLock.acquire(str(tmp_path), "--save")
    assert f"is locked by pid {holder.pid} ({sys.executable} -c import os, sys" in str(e.value)
    assert "holds the lock of the directory itself but not its lock file" in str(e.value)
    holder.kill()
    holder.wait()
    assert child.is_running()
    RunLock.acquire(str(tmp_path), "--save").release()
    child.kill()
    save = tmp_path / "run"
    cfg = parse_args(tiny_argv(tokenizer, save=save, load=save))
    save.mkdir()
    (save / "metrics.jsonl").write_text('{"step": 1}\n')  # another run logged meanwhile
    with pytest.raises(ConfigError, match="changed while this run started"):
        claim_run_directories(cfg.checkpoint, cfg.logging, cfg.start.seen, [])
    cfg = parse_args(tiny_argv(tokenizer, save=save, load=save))
    for lock in claim_run_directories(cfg.checkpoint, cfg.logging, cfg.start.seen, []):
        lock.release()


def test_a_resume_onto_another_vocabulary_of_the_same_size_is_refused(tokenizer, saved, tmp_path):
    """With 160 of 256 pieces different, training used to go on with scrambled ids;
    run_config.json records the vocabulary's SHA-256 and a mismatch stops the resume before
    any process group, unless --override-tokenizer-check; so does a tokenizer with the same
    pieces and another normalization."""
    from loggra_megatron.config import ConfigError
    from loggra_megatron.data.tokenizer import fingerprint, load_tokenizer
    from loggra_megatron.train.preflight import preflight

    prefix = tmp_path / "other"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--builtin-tasks"]
        + ["3000", "--vocab-size", "192", "--seed", "5", "--output-prefix", str(prefix)],
        check=True,
        capture_output=True,
    )
    other = f"{prefix}.model"
    a, b = load_tokenizer(tokenizer, None), load_tokenizer(other, None)
    assert a.vocab_size == b.vocab_size and fingerprint(a) != fingerprint(b)
    base = {**COSINE, "load": saved, "save": saved, "train-iters": 6}
    cfg = parse_args(tiny_argv(other, **base), world_size=2)
    with pytest.raises(ConfigError, match="is not the tokenizer the checkpoint in --load was"):
        preflight(cfg)
    cfg = parse_args(tiny_argv(other, **base, **{"override-tokenizer-check": True}), world_size=2)
    preflight(cfg)  # accepted when meant
    preflight(parse_args(tiny_argv(tokenizer, **base), world_size=2))  # the same tokenizer
    # the same pieces with sentencepiece's add_dummy_prefix flipped: every prompt tokenizes
    # differently, and the checkpoint's tokenizer_encoding says so
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tokenizer).read_bytes())
    proto.normalizer_spec.add_dummy_prefix = not proto.normalizer_spec.add_dummy_prefix
    flipped = tmp_path / "flipped.model"
    flipped.write_bytes(proto.SerializeToString())
    assert fingerprint(load_tokenizer(str(flipped), None)) == fingerprint(a)
    cfg = parse_args(tiny_argv(str(flipped), **base), world_size=2)
    with pytest.raises(ConfigError, match="the same pieces, but another normalization"):
        preflight(cfg)

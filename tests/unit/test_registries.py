"""The recipes of docs/architecture.md: a projection, a task, a sketch mode, a row update and an
optimizer variant are each one class/function plus one registry line, and every consumer
follows the registry."""

import dataclasses

import pytest
import torch

from loggra_megatron.config import check_fields, positive
from loggra_megatron.optim import LoGRAAdamW
from loggra_megatron.optim.gradient_sketch.projection import PROJECTIONS, Projection
from loggra_megatron.optim.registry import OPTIMIZERS, OptimizerSpec


class _FirstColumns(Projection):
    """Q = the first r standard basis vectors: a projection a test can predict."""

    def local_basis(self, grad, rank, seed, settings):
        return torch.eye(grad.shape[1])[:, :rank]

    def sharded_basis(self, rows, n, rank, seed, settings, omega_rows, all_reduce, device):
        return torch.eye(n, device=device)[:, :rank]


def test_a_new_projection_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(PROJECTIONS, "first_columns", _FirstColumns())
    w = torch.nn.Parameter(torch.zeros(8, 6))
    opt = LoGRAAdamW([w], lr=0.1, rank=2, min_dim=1, projection="first_columns", weight_decay=0)
    w.grad = torch.arange(1, 49, dtype=torch.float32).view(8, 6)
    opt.step()
    # only the first two columns move: the update lives in span(Q) = span(e1, e2)
    assert (w[:, :2] != 0).all() and (w[:, 2:] == 0).all()
    assert torch.equal(opt.state[w]["basis"], torch.eye(6)[:, :2])


SQUARES = '''"""``squares``: what is r * r?"""

from dataclasses import dataclass

from loggra_megatron.config import check_fields, positive
from loggra_megatron.tasks.base import Task


@dataclass
class SquaresFlags:
    """The squares task's knob."""

    task_max_root: int = 9
    """The largest root asked."""

    def __post_init__(self):
        check_fields(self, [("task_max_root", positive, ">= 1")])

    def knobs(self) -> dict:
        return {"max_root": self.task_max_root}


class SquaresTask(Task):
    KNOBS = {"max_root": 9}
    FLAGS = SquaresFlags

    def example(self, rng):
        r = rng.randint(1, self.knobs["max_root"])
        solution = f"{r} * {r} = {r * r}."
        metadata = {"kind": "squares", "expression": f"{r} * {r}", "solution": solution}
        return {"prompt": f"What is {r} * {r}?", "answer": str(r * r), "metadata": metadata}
'''

SQUARES_RUN = """
import json, sys
from loggra_megatron.arguments import parse_args
from loggra_megatron.tasks import generate_tasks
from loggra_megatron.train.preflight import preflight

argv = json.loads(sys.argv[1])
cfg = parse_args([*argv, "--task", "squares", "--task-max-root", "3"])
tasks = generate_tasks("squares", 20, seed=0, **cfg.task.knobs("squares"))
checked = preflight(cfg)  # the trainer's own check builds the task from the flags
print(json.dumps({"knobs": cfg.task.knobs("squares"), "answers": [t["answer"] for t in tasks],
                  "again": tasks == generate_tasks("squares", 20, seed=0, max_root=3)}))
"""


def test_a_new_task_with_a_knob_is_one_file_and_one_registry_line(tokenizer, tmp_path):
    """The recipe of docs/architecture.md done in a copy of the package, as a developer does
    it: ``tasks/squares.py`` (a ``Task`` with its ``FLAGS``) and one import plus one line in
    ``TASKS``. Then ``--task squares`` and its knob's flag ``--task-max-root`` exist, with
    help, validation and "applies to" generated from the declaration, and the task runs."""
    import json

    from package_copy import package_copy, run_in
    from rl_runs import tiny_argv

    registry = "loggra_megatron/tasks/__init__.py"
    mixed = "from loggra_megatron.tasks.mixed import MixedTask\n"
    tree = package_copy(
        tmp_path,
        {"loggra_megatron/tasks/squares.py": SQUARES},
        [
            (registry, mixed, mixed + "from loggra_megatron.tasks.squares import SquaresTask\n"),
            (
                registry,
                '    "math": MathTask,\n',
                '    "math": MathTask,\n    "squares": SquaresTask,\n',
            ),
        ],
    )
    argv = [str(a) for a in tiny_argv(tokenizer)]
    done = run_in(tree, "-c", SQUARES_RUN, json.dumps(argv))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["knobs"] == {"max_root": 3} and out["again"]
    assert set(out["answers"]) <= {"1", "4", "9"}
    pretrain = str(tree / "pretrain_rl.py")
    help_text = " ".join(run_in(tree, pretrain, "--help").stdout.split())
    assert "--task-max-root TASK_MAX_ROOT The largest root asked. --task squares only." in help_text
    assert "squares" in help_text.split("--task {", 1)[1].split("}", 1)[0]
    refused = run_in(tree, pretrain, *argv, "--task", "squares", "--task-max-root", "0")
    assert refused.returncode == 2 and "--task-max-root" in refused.stderr
    refused = run_in(tree, pretrain, *argv, "--task-max-root", "3")  # --task arithmetic
    assert refused.returncode == 2
    assert "--task-max-root=3: applies to --task squares only" in refused.stderr


def test_optimizer_choices_the_memory_model_and_the_builder_read_the_registry(
    monkeypatch, tokenizer, capsys
):
    from rl_runs import tiny_argv

    from loggra_megatron.arguments import parse_args
    from loggra_megatron.memory.model import ParamSpec, optimizer_state_bytes

    with pytest.raises(SystemExit):
        parse_args(tiny_argv(tokenizer, optimizer="my_adam"))
    assert "one of adam, loggra" in capsys.readouterr().err
    spec = OptimizerSpec(
        "my_adam",
        "dense, for the test",
        "tests:unused",
        sketched=False,
        grads_per_weight=False,
        distributed=True,
        candidate=True,
        state_bytes_per_param=8,
        state_bytes_per_tensor=4,
    )
    monkeypatch.setitem(OPTIMIZERS, "my_adam", spec)
    assert parse_args(tiny_argv(tokenizer, optimizer="my_adam")).optimizer.optimizer == "my_adam"
    params = [ParamSpec("w", (256, 256), "linear")]
    dense = optimizer_state_bytes(params, "adam")
    assert optimizer_state_bytes(params, "my_adam") == dense  # read as a dense optimizer
    assert optimizer_state_bytes(params, "loggra", rank=8) < dense


def _compared_strings(path: str) -> list[tuple[int, str, str]]:
    """``(line, the other operand's source, the string)`` of every ``==`` / ``!=`` / ``in``
    comparison with a string constant in ``path``."""
    import ast

    with open(path, encoding="utf-8") as f:
        source = f.read()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for a, b in zip(operands, operands[1:], strict=False):
            for const, other in ((a, b), (b, a)):
                if isinstance(const, ast.Constant) and isinstance(const.value, str):
                    found.append((node.lineno, ast.get_source_segment(source, other), const.value))
    return found


def test_no_module_compares_a_sketch_mode_by_name():
    """What a ``--loggra-sketch`` mode does is read from its ``SKETCH_MODES`` entry
    (``in_backward``, ``builder``, ``label``; ``backward_sketch``), never from its name: a
    new mode is one registry line."""
    import glob
    import os

    from loggra_megatron.optim.registry import SKETCH_MODES

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = glob.glob(os.path.join(root, "loggra_megatron", "**", "*.py"), recursive=True)
    paths += glob.glob(os.path.join(root, "tools", "*.py")) + [os.path.join(root, "pretrain_rl.py")]
    offending = [
        f"{os.path.relpath(path, root)}:{line}: {other} vs {value!r}"
        for path in paths
        if not path.endswith(os.path.join("optim", "registry.py"))
        for line, other, value in _compared_strings(path)
        if value in SKETCH_MODES and "sketch" in (other or "")
    ]
    assert not offending, "\n".join(offending)


def test_the_memory_model_counts_a_sketch_modes_terms_from_its_entry(monkeypatch):
    """``memory.model`` adds what the mode's ``memory_terms`` entry gives: a copy of the
    backward entry under another name is estimated alike, and the same copy without
    ``memory_terms`` adds no row state, sketch buffer or hooks (its targets stay dense)."""
    import dataclasses

    from memory_plans import plan
    from optimizer_state import SMALL

    from loggra_megatron.memory.model import TransformerShape, estimate_rl_step_memory
    from loggra_megatron.optim.registry import SKETCH_MODES

    model = TransformerShape(**SMALL, untie_embeddings_and_output_weights=True)
    backward = SKETCH_MODES["backward"]
    monkeypatch.setitem(SKETCH_MODES, "copy", dataclasses.replace(backward, name="copy"))
    monkeypatch.setitem(
        SKETCH_MODES, "bare", dataclasses.replace(backward, name="bare", memory_terms=None)
    )
    at = {m: plan(optimizer="loggra", loggra_sketch=m) for m in ("backward", "copy", "bare")}
    estimate = {m: estimate_rl_step_memory(model, p) for m, p in at.items()}
    assert estimate["copy"] == estimate["backward"]
    assert estimate["bare"].grads > estimate["backward"].grads  # the targets' grads are back
    assert estimate["bare"] != estimate["backward"]


def test_a_new_row_update_is_one_class_and_one_registry_line(monkeypatch, tokenizer):
    """An AMSGrad-like row update (the running max of RowAdam's second moment, 8 bytes per
    row): ``--loggra-row-optimizer`` accepts it, ``--loggra-row-beta2`` applies to it (it
    has a root), RowAdam steps with it as its formula says, and the memory model counts its
    state."""
    import dataclasses

    from memory_plans import plan
    from optimizer_state import SMALL
    from rl_runs import tiny_argv

    from loggra_megatron.arguments import parse_args
    from loggra_megatron.memory.model import TransformerShape, estimate_rl_step_memory
    from loggra_megatron.optim.backward_sketch.row_adam import RowAdam
    from loggra_megatron.optim.backward_sketch.row_updates import ROW_UPDATES, RowUpdate

    class RowMaxRoot(RowUpdate):
        name = "amsgrad"
        state_bytes_per_row = 8
        has_root = True

        def init_state(self, p):
            return {"v": p.new_zeros(p.shape[0]).float(), "v_max": p.new_zeros(p.shape[0]).float()}

        def update(self, sketch, state, beta2, step):
            v = state["v"] * beta2 + sketch.square().mean(dim=1) * (1 - beta2)
            v_max = torch.maximum(state["v_max"], v)
            return {"v": v, "v_max": v_max}, sketch, v_max.sqrt()

    monkeypatch.setitem(ROW_UPDATES, "amsgrad", RowMaxRoot())
    flags = {"loggra-sketch": None, "loggra-row-optimizer": "amsgrad", "loggra-row-beta2": 0.9}
    assert parse_args(tiny_argv(tokenizer, **flags)).loggra.loggra_row_beta2 == 0.9

    rows = torch.nn.Parameter(torch.ones(3, 4))
    opt = RowAdam([rows], lr=0.1, betas=(0.9, 0.5), eps=0.0, row_optimizer="amsgrad")
    sketch, signs = torch.tensor([[2.0], [1.0], [4.0]]), torch.ones(1, 4)
    opt.set_sketches({rows: (sketch, signs)})
    opt.step()
    v = 0.5 * sketch.square().mean(dim=1)  # then D = S / √v, the step −lr·D·A
    expected = 1 - 0.1 * (sketch / v.sqrt().unsqueeze(1)) @ signs
    torch.testing.assert_close(rows.detach(), expected)
    assert set(opt.state[rows]) == {"v", "v_max"}

    step = dataclasses.replace(plan(loggra_sketch="backward"), optimizer="loggra")
    shape = TransformerShape(**SMALL)
    adam = estimate_rl_step_memory(shape, dataclasses.replace(step, loggra_row_optimizer="adam"))
    ams = estimate_rl_step_memory(shape, dataclasses.replace(step, loggra_row_optimizer="amsgrad"))
    sgd = estimate_rl_step_memory(shape, dataclasses.replace(step, loggra_row_optimizer="sgd"))
    row_state = adam.optimizer_state - sgd.optimizer_state  # RowAdam's 4 bytes per row
    assert row_state > 0 and ams.optimizer_state - sgd.optimizer_state == 2 * row_state


@dataclasses.dataclass
class _ProbeSettings:
    """A sketch mode's own flags, for the test."""

    loggra_probe_width: int = 3
    """Columns the probe mode reads."""

    def __post_init__(self):
        check_fields(self, [("loggra_probe_width", positive, ">= 1")])

    def probe_columns(self) -> range:
        return range(self.loggra_probe_width)


def test_a_sketch_mode_owns_its_flags(monkeypatch):
    """A ``SketchMode`` names the dataclass of its flags (``settings``); ``LoGRAConfig`` is
    generated from the registry: the flag exists with its help, validates with its class,
    applies to its mode only (given with another mode it is refused naming its mode), the
    modes' own flags stay theirs, and the class's methods are the config's."""
    import argparse

    from loggra_megatron.config import ConfigError, add_flags, settings_that_do_not_apply
    from loggra_megatron.optim.config import LoGRAConfig, OptimConfig, loggra_section
    from loggra_megatron.optim.registry import SKETCH_MODES

    probe = dataclasses.replace(
        SKETCH_MODES["gradient"],
        name="probe",
        settings=f"{_ProbeSettings.__module__}:_ProbeSettings",
    )
    monkeypatch.setitem(SKETCH_MODES, "probe", probe)
    section = loggra_section(SKETCH_MODES)
    names = {f.name for f in dataclasses.fields(section)}
    assert names == {f.name for f in dataclasses.fields(LoGRAConfig)} | {"loggra_probe_width"}

    parser = argparse.ArgumentParser()
    add_flags(parser, {"loggra": section})
    text = " ".join(parser.format_help().split())
    assert (
        "--loggra-probe-width LOGGRA_PROBE_WIDTH Columns the probe mode reads. --loggra-sketch probe only."
        in text
    )
    assert "--loggra-min-dim LOGGRA_MIN_DIM Matrices" in text  # the gradient sketch's own, still

    assert list(section(loggra_sketch="probe", loggra_probe_width=5).probe_columns()) == [*range(5)]
    with pytest.raises(ConfigError, match="--loggra-probe-width=0: must be >= 1"):
        section(loggra_sketch="probe", loggra_probe_width=0)

    def refused(sketch: str, **given) -> list[str]:
        settings = {**vars(OptimConfig()), **vars(section(loggra_sketch=sketch, **given))}
        settings["bf16"] = False
        return list(settings_that_do_not_apply([section], settings, set(given)))

    assert refused("probe", loggra_probe_width=5) == []
    assert refused("backward", loggra_probe_width=5) == [
        "--loggra-probe-width=5: applies to --optimizer loggra --loggra-sketch probe only "
        "(here it would do nothing); drop it"
    ]
    assert refused("probe", loggra_min_dim=8)[0].startswith(
        "--loggra-min-dim=8: applies to --optimizer loggra --loggra-sketch gradient only"
    )

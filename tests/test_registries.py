"""The recipes of docs/architecture.md: a projection, a task and an optimizer variant are each
one class/function plus one registry line, and every consumer follows the registry."""

import random

import pytest
import torch

from loggra_megatron.optim import LoGRAAdamW
from loggra_megatron.optim.projection import PROJECTIONS, Projection
from loggra_megatron.optim.registry import OPTIMIZERS, OptimizerSpec
from loggra_megatron.tasks import TASKS, Task, generate_tasks


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


class _Squares(Task):
    KNOBS = {"max_root": 9}

    def example(self, rng: random.Random) -> dict:
        r = rng.randint(1, self.knobs["max_root"])
        return {
            "prompt": f"What is {r} * {r}?",
            "answer": str(r * r),
            "metadata": {
                "kind": "squares",
                "expression": f"{r} * {r}",
                "solution": f"{r} * {r} = {r * r}.",
            },
        }


def test_a_new_task_is_one_class_and_one_registry_line(monkeypatch, tokenizer):
    from rl_runs import tiny_argv

    from loggra_megatron.arguments import parse_args

    monkeypatch.setitem(TASKS, "squares", _Squares)
    tasks = generate_tasks("squares", 5, seed=0, max_root=3)
    assert tasks == generate_tasks("squares", 5, seed=0, max_root=3)
    assert all(int(t["answer"]) in (1, 4, 9) for t in tasks)
    with pytest.raises(TypeError, match="unknown difficulty knob"):
        generate_tasks("squares", 1, seed=0, max_number=3)
    assert parse_args(tiny_argv(tokenizer, task="squares")).data.task == "squares"


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

"""The ``task`` section of the settings: every task's command-line knobs, generated from the
registry (``TASKS``), so that a task owns its flags as every other component owns its section.

Each task declares its flags in ``Task.FLAGS`` (a dataclass: a field per flag, its docstring
the help, validation in its ``__post_init__``, ``knobs()`` for the constructor). This module
gathers the fields of all of them into one settings dataclass: a field shared by several tasks
(``mixed`` takes the arithmetic flags) appears once, and each field applies to the tasks that
declare it (given with another ``--task``, the flag exits 2 naming the tasks it applies to).
The section validates each declaration's fields with its own class, and gives the knobs of the
chosen task (``knobs``).
"""

from __future__ import annotations

import dataclasses

from loggra_megatron.config import chosen_section

__all__ = ["data_defining_flags", "flag_defaults", "task_flags_section"]


def data_defining_flags(tasks: dict[str, type]) -> tuple[str, ...]:
    """The flags of the generated tasks (their examples, so a run's data, depend on them)."""
    names = []
    for task in tasks.values():
        if task.FLAGS is not None and not task.needs_data:
            names += [f.name for f in dataclasses.fields(task.FLAGS) if f.name not in names]
    return tuple(names)


def flag_defaults(tasks: dict[str, type]) -> dict[str, object]:
    """``{flag field: its default}`` of every task's ``FLAGS`` (the knobs' defaults: a task's
    ``KNOBS`` take theirs from its ``FLAGS``)."""
    return {
        f.name: f.default
        for task in tasks.values()
        if task.FLAGS is not None
        for f in dataclasses.fields(task.FLAGS)
    }


def task_flags_section(tasks: dict[str, type]) -> type:
    """A settings dataclass with the flags of every task in ``tasks`` (``{--task name: Task
    subclass}``), defined as ``loggra_megatron.train.run_config.TaskFlags``."""

    def knobs(self, task: str) -> dict:
        """The constructor knobs of ``--task task`` from these flags."""
        flags = tasks[task].FLAGS
        if flags is None:
            return {}
        return flags(**{f.name: getattr(self, f.name) for f in dataclasses.fields(flags)}).knobs()

    return chosen_section(
        "TaskFlags",
        {name: task.FLAGS for name, task in tasks.items() if task.FLAGS is not None},
        "task",
        doc="Knobs of the tasks (each task's FLAGS: loggra_megatron/tasks).",
        module="loggra_megatron.train.run_config",
        namespace={"knobs": knobs},
    )

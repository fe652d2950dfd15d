"""docs/data.md's task table lists the task registry (``loggra_megatron.tasks.TASKS``): every
registered task has a row, no row names a task that is not registered, and a row says
"generated" exactly for the tasks that need no ``--data-path``."""

import re
from pathlib import Path

from loggra_megatron.tasks import TASKS

DOCS = Path(__file__).resolve().parents[3] / "docs" / "data.md"


def test_the_task_table_is_the_registry():
    section = DOCS.read_text().split("## Tasks (`--task`)", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)`[^|]*\| ([^|]*) \|", section, flags=re.M)
    assert sorted(name for name, _ in rows) == sorted(TASKS)
    for name, examples in rows:
        generated = not TASKS[name].needs_data
        assert ("generated" in examples or "either" in examples) == generated, name

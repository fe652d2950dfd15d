"""A reward function run in the trainer's process that ends it (``os._exit``) or is interrupted
is reported as a reward failure naming the sample, in a process of its own (without the guard
``os._exit`` would end the test process)."""

import os
import subprocess
import sys

from rl_runs import ENV, ROOT


def test_a_reward_that_calls_os_exit_or_is_interrupted_is_reported(tmp_path):
    """os._exit ended the run without a word, KeyboardInterrupt with an unwrapped traceback:
    both are reward failures now, with the sample (run in a subprocess: without the guard
    os._exit would end the test process)."""
    code = """
import os
from loggra_megatron.tasks.scoring import RewardFunctionError, Scoring

def exits(p, c, a, m):
    os._exit(7)

def interrupted(p, c, a, m):
    raise KeyboardInterrupt

for fn in (exits, interrupted):
    try:
        Scoring(fn, None, 1.0).score(["q0", "q1"], ["c", "c"], ["1", "1"])
    except RewardFunctionError as e:
        print(str(e).splitlines()[0])
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "exits called os._exit(7) on sample 0" in lines[0] and "'q0'" in lines[0]
    assert "interrupted raised on sample 0" in lines[1]
    assert os.getpid()  # the test process is still here

"""One launch of a multi-rank worker for every test that reads it.

Where two tests start the same ranks on the same worker and arguments to check different
things of the result, ``shared_run`` launches once per test session and hands both the
same results (the workers are deterministic: fixed seeds, gloo on CPU). The results are
shared: a test must not change them.
"""

import functools

from loggra_megatron.testing import run_distributed


@functools.cache
def shared_run(fn, world_size: int = 2, *args, **kwargs) -> tuple:
    """``run_distributed(fn, world_size, *args, **kwargs)``, launched once per distinct call
    (arguments must be hashable); the per-rank results as a tuple."""
    return tuple(run_distributed(fn, world_size, *args, **kwargs))

"""``grad/clipped`` counts an update as clipped exactly when Megatron's
``clip_grad_by_total_norm_fp32`` scales it: the coefficient ``clip / (norm + 1e-6)`` is
below 1, and never with ``--clip-grad 0``."""

from types import SimpleNamespace

import pytest

from loggra_megatron.optim.megatron.stepper import MegatronStepper

pytestmark = pytest.mark.megatron  # the stepper module imports megatron-core


def _stepper(clip_grad: float) -> MegatronStepper:
    stepper = object.__new__(MegatronStepper)  # only the leaves' config is read
    stepper.leaves = [SimpleNamespace(config=SimpleNamespace(clip_grad=clip_grad))]
    return stepper


@pytest.mark.parametrize(
    ("clip", "norm", "clipped"),
    [
        (1.0, 1.5, True),
        (1.0, 0.5, False),
        (1.0, 1.0, True),
        (1.0, 0.999998, False),
        (0.0, 1e9, False),
    ],
)
def test_an_update_is_clipped_where_megatron_scales_it(clip, norm, clipped):
    assert _stepper(clip).clips(norm) is clipped

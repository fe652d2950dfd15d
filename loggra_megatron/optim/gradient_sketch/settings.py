"""The gradient sketch's own flags (``--loggra-sketch gradient``), declared here and named by
its ``SKETCH_MODES`` entry (``settings``). ``optim.config.LoGRAConfig`` gathers them: each
applies to ``--optimizer loggra --loggra-sketch gradient`` (and to what its own ``applies``
adds), and this class validates them."""

from __future__ import annotations

from dataclasses import dataclass

from loggra_megatron.config import applies, at_least, check_fields, one_of, positive
from loggra_megatron.optim.gradient_sketch.projection import PROJECTIONS


def _refreshes(s: dict) -> bool:
    return PROJECTIONS[s["loggra_projection"]].refreshes


def _range_finder(s: dict) -> bool:
    return s["loggra_projection"] == "range_finder"


@dataclass
class GradientSketchSettings:
    """The gradient sketch's basis, its refresh and which weights it sketches."""

    loggra_projection: str = "range_finder"
    """range_finder | svd (GaLore baseline: the all-reduced Gram matrix) | random | identity."""
    loggra_update_interval: int = applies(
        200, "with a --loggra-projection that refreshes its basis", _refreshes
    )
    """Optimizer steps between basis refreshes."""
    loggra_oversample: int = applies(8, "with --loggra-projection range_finder", _range_finder)
    """Extra range-finder probe vectors."""
    loggra_power_iters: int = applies(1, "with --loggra-projection range_finder", _range_finder)
    """Range-finder power iterations."""
    loggra_min_dim: int = 64
    """Matrices with a (TP-local) side shorter than this are updated densely."""
    loggra_scale: float = 1.0
    """α, multiplies the low-rank update."""
    loggra_energy_warn_threshold: float = 0.5
    """Warn once when a weight family's captured energy (``loggra/captured_energy/<family>/
    mean``) stays below this for 10 consecutive RL steps; 0: never (docs/optimizer.md
    #captured-energy)."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("loggra_projection", one_of(*PROJECTIONS), f"one of {', '.join(PROJECTIONS)}"),
                ("loggra_update_interval", positive, ">= 1"),
                ("loggra_oversample", at_least(0), ">= 0"),
                ("loggra_power_iters", at_least(0), ">= 0"),
                ("loggra_min_dim", positive, ">= 1"),
                ("loggra_scale", positive, "> 0"),
                ("loggra_energy_warn_threshold", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ],
        )

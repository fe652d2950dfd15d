"""Generation on ranks of its own (``--generation-ranks``): the roles and their process
groups (``groups``), the channel between the two leaders (``channel``), the weight sync
(``weights``, ``weight_sender``; low-rank: ``row_records``, ``lowrank``) and the trainer's
side (``remote``); the generation ranks' loop is ``train.generation_worker``.
docs/placement.md."""

from loggra_megatron.placement.config import PlacementConfig
from loggra_megatron.placement.groups import Placement, Role, start_placement

__all__ = ["Placement", "PlacementConfig", "Role", "start_placement"]

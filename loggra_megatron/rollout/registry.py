"""The rollout engines ``pretrain_rl.py`` can generate with (``--rollout-engine``), by name.

Each entry is a ``RolloutEngine``, defined in its own
module (``rollout/static/__init__.py``, ``rollout/dynamic/__init__.py``): the flag's choices
(``rollout.config``), the start-up refusals (``arguments.validate``), the choice and the
generation (``rl.experience``) and the memory model (``memory``) read it; ``auto`` is
``select_engine``'s rule over the registry. Imports neither torch nor Megatron; the
engines import their generation code when they generate. Adding an engine: one module with
a ``RolloutEngine`` subclass (it may subclass ``rollout.static.StaticEngine``: no import of
this registry, so no cycle), one line in ``ROLLOUT_ENGINES`` (``docs/architecture.md``).
"""

from __future__ import annotations

from loggra_megatron.rollout.dynamic import DynamicEngine
from loggra_megatron.rollout.protocol import EngineTarget, RolloutEngine
from loggra_megatron.rollout.static import StaticEngine

AUTO = "auto"
"""``--rollout-engine auto``: ``select_engine`` chooses."""


ROLLOUT_ENGINES: dict[str, RolloutEngine] = {
    "static": StaticEngine(),
    "dynamic": DynamicEngine(),
}


def is_fallback(engine: RolloutEngine) -> bool:
    """``auto`` took ``engine`` because one it ranks higher cannot run."""
    ranks = [e.auto_priority for e in ROLLOUT_ENGINES.values() if e.auto_priority is not None]
    return engine.auto_priority is not None and engine.auto_priority < max(ranks)


def engine_choices() -> tuple[str, ...]:
    """What ``--rollout-engine`` accepts: ``auto`` and every registered engine."""
    return (AUTO, *ROLLOUT_ENGINES)


def select_engine(
    name: str, target: EngineTarget, planning: bool = False
) -> tuple[RolloutEngine, str | None]:
    """The engine ``--rollout-engine name`` runs on ``target``, and a note for the log.

    ``auto``: the engine of highest ``auto_priority`` that can run (registry order breaks
    ties); the note says which and why the engines passed over cannot run (None for a
    named engine). A named engine that cannot run raises ``RuntimeError``
    (``arguments.validate`` refuses it at start-up). ``planning``: judge by the settings
    alone (``refusal``: the memory estimator), and take a named engine as
    it is.
    """
    if name != AUTO:
        engine = ROLLOUT_ENGINES[name]
        reason = None if planning else engine.unavailable(target)
        if reason is not None:
            raise RuntimeError(f"--rollout-engine {name}: {reason}")
        return engine, None
    reasons = []
    for engine in _auto_ranking():
        reason = _why_not(engine, target, planning)
        if reason is None:
            why = "; ".join(reasons) or "the first choice, and it runs here"
            return engine, f"--rollout-engine auto: {engine.name} ({why})"
        reasons.append(f"not {engine.name}: {reason}")
    raise RuntimeError(f"--rollout-engine auto: no engine can run here ({'; '.join(reasons)})")


def _why_not(engine: RolloutEngine, target: EngineTarget, planning: bool) -> str | None:
    """Why ``engine`` cannot run on ``target`` (by the settings alone when ``planning``)."""
    return engine.refusal(target) if planning else engine.unavailable(target)


def _auto_ranking() -> list[RolloutEngine]:
    """The engines ``auto`` considers, first choice first."""
    ranked = [e for e in ROLLOUT_ENGINES.values() if e.auto_priority is not None]
    return sorted(ranked, key=lambda e: -e.auto_priority)


def passed_over(engine: RolloutEngine, target: EngineTarget, planning: bool = False) -> list[str]:
    """Why ``auto`` did not take the engines it ranks above ``engine`` on ``target``
    (``not <name>: <reason>``, first choice first; ``planning`` as in ``select_engine``)."""
    reasons = []
    for other in _auto_ranking():
        if other is engine:
            break
        reasons.append(f"not {other.name}: {_why_not(other, target, planning)}")
    return reasons

"""The megatron-core releases this project is tested on, and a start-up check against them.

CI runs the whole CPU suite on the oldest tested release (Python 3.11, where nothing newer
installs) and every Megatron-Core test on the newest (Python 3.12): ``.ci/run``. The
version-dependent code is feature-detected in one place per subsystem
(``rollout/dynamic/mcore_engine.py`` for the inference API); ``docs/megatron_versions.md`` lists
what differs and what moves when the oldest release is dropped.
"""

from __future__ import annotations

from packaging.version import Version

TESTED = ("0.16.1", "0.19.2")
"""Oldest and newest megatron-core release CI passes on (``pyproject.toml``'s bounds)."""


def untested_version_note(version: str | None = None) -> str | None:
    """A one-line warning if megatron-core ``version`` (default: the installed one) lies
    outside the tested range, else ``None``."""
    if version is None:
        from megatron.core.package_info import __version__ as version
    low, high = TESTED
    if Version(low) <= Version(version) <= Version(high):
        return None
    return (
        f"warning: megatron-core {version} is outside the tested range {low}..{high} "
        f"(pip install 'megatron-core>={low},<={high}'); an API change may fail late"
    )

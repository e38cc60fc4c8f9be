"""Plugin types by config `type`. Each plugin class declares `type` and `from_config`.

The table is built from an explicit list in `epp.scheduling.plugins` (no import-time
registration side effects), so what exists is visible in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.datastore import Datastore
from epp.scheduling.framework import Plugin


@dataclass(slots=True)
class PluginContext:
    """What a plugin factory may use: the datastore (read-only) and the plugins built so far."""

    datastore: Datastore
    plugins: dict[str, Plugin] = field(default_factory=dict)


def plugin_types() -> dict[str, type[Plugin]]:
    from epp.scheduling.plugins import PLUGIN_CLASSES

    return {cls.type: cls for cls in PLUGIN_CLASSES}

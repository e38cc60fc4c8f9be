"""Plugins that need a helper plugin (a data producer) the user may not have configured.

The reference creates missing producers with default parameters (`CreateMissingDataProducers`),
e.g. `prefix-cache-scorer` pulls in `approx-prefix-cache-producer`. A plugin that needs one
implements this protocol; the config loader calls it once every configured plugin exists and adds
whatever it returns to the plugin table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from epp.scheduling.framework import Plugin
    from epp.plugin import PluginContext


@runtime_checkable
class RequiresProducers(Protocol):
    def create_missing_producers(self, ctx: PluginContext) -> list[Plugin]:
        """Bind to a configured producer or create one; return the plugins created."""
        ...


def unique_name(base: str, taken: Mapping[str, object]) -> str:
    """`base`, or `base-2`, `base-3`, ... whichever is free."""
    if base not in taken:
        return base
    i = 2
    while f"{base}-{i}" in taken:
        i += 1
    return f"{base}-{i}"

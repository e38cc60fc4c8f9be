"""What every picker shares: `maxNumOfEndpoints` and its own random source.

Each picker owns a `random.Random` (never the global one) so tests can seed it and two pickers do
not disturb each other's sequences.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from epp.params import Params
from epp.scheduling.framework import Picker

if TYPE_CHECKING:
    from epp.plugin import PluginContext


class CountedPicker(Picker):
    """A picker returning up to `max_endpoints` targets: the primary, then fallbacks."""

    def __init__(self, name: str = "", max_endpoints: int = 1, rng: random.Random | None = None) -> None:
        super().__init__(name)
        if max_endpoints < 1:
            raise ValueError("max_endpoints must be >= 1")
        self.max_endpoints = max_endpoints
        self.rng = rng if rng is not None else random.Random()

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> CountedPicker:
        max_endpoints = params.int("maxNumOfEndpoints", 1, min=1)
        params.done()
        return cls(name, max_endpoints, ctx.rng(name))

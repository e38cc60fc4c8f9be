"""The base of every configurable plugin, whatever layer it serves (scheduling, data layer,
flow control). It lives here, below all of them, so no layer imports another just for it."""

from __future__ import annotations

import random
from abc import ABC
from dataclasses import dataclass, field
from typing import ClassVar

from epp.datastore import Datastore
from epp.params import Params


@dataclass(slots=True)
class PluginContext:
    """What a plugin factory may use: the datastore (read-only) and the plugins built so far.

    `seed` is set by the simulator so that every plugin's randomness is reproducible; a plugin
    that draws random numbers takes its generator from `rng`, never from the global one."""

    datastore: Datastore
    plugins: dict[str, Plugin] = field(default_factory=dict)
    seed: int | None = None

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}:{name}") if self.seed is not None else random.Random()


class Plugin(ABC):
    """Every plugin has a config `type` (its registry key, also its file name) and a `name`."""

    type: ClassVar[str] = ""

    def __init__(self, name: str = "") -> None:
        self.name = name or self.type

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> Plugin:
        """Build from config. The default takes no parameters; `params.done()` rejects any."""
        params.done()
        return cls(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

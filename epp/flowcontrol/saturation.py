"""How full the pool is, as one number: the gate flow control dispatches against.

`saturation(endpoints)` is 0 for an idle pool and reaches 1.0 when the pool is full; "saturated"
means >= 1.0 (the reference's rule). Detectors are also scheduling Filters, so the same notion
of "full" can keep a full endpoint out of a profile.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from epp.datastore import Endpoint

SATURATED = 1.0


class SaturationDetector(ABC):
    @abstractmethod
    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        """Pool saturation over these candidates; 1.0 when there are none."""

    def is_saturated(self, endpoints: Sequence[Endpoint]) -> bool:
        return self.saturation(endpoints) >= SATURATED

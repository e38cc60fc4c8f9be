"""Min-max normalisation shared by the load scorers (queue, running, in-flight).

Lower load scores higher: `(max - x) / (max - min)`. When every candidate has the same load the
signal carries no preference, so all score 1.0 (the reference's rule), leaving the decision to the
other scorers and the picker's random tie-break.
"""

from __future__ import annotations

from collections.abc import Sequence


def inverted_min_max(values: Sequence[float]) -> list[float]:
    if not values:
        return []
    lo = min(values)
    hi = max(values)
    if hi == lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]

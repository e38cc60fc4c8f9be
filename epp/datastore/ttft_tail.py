"""The pool's tail of observed times to first token: the TTFT beyond which a request is among the
slowest share (10% by default) lately, and how often each pod's first tokens land there.

The TTFT bars an operator watches are on that tail (p90, p99), and a pick that saves the pool a
little TTFT per request by making one request wait long moves the mean one way and the tail the
other. `predicted-latency-producer` charges for it (`_charge_tail`) against this running quantile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Per observation, in log space: a pool of 50 ms and one of 5 s settle equally fast, in ~1 / _STEP
# observations (a few seconds of a busy pool's first tokens).
_STEP = 0.02
_MIN_SECONDS = 1e-4


@dataclass(slots=True)
class TtftTail:
    """A running `quantile` of the pool's observed times to first token.

    Stochastic approximation: each observation beyond the estimate raises it by `quantile` × the
    step, each other one lowers it by (1 − `quantile`) × the step, so it rests where a share
    1 − `quantile` lies beyond (`ServiceModel.calibrate` tracks a median so, at 0.5). No
    histogram to keep or window to expire, and a client cannot move it further than its share of
    the first tokens."""

    quantile: float = 0.9
    seconds: float = 0.0  # the estimate (0: nothing observed yet)

    def observe(self, ttft: float) -> bool:
        """One observed time to first token; whether it was beyond the tail as it stood."""
        if not (ttft > 0.0 and math.isfinite(ttft)):
            return False
        tail = self.seconds
        if tail <= 0.0:
            self.seconds = max(_MIN_SECONDS, ttft)
            return False
        beyond = ttft > tail
        self.seconds = max(_MIN_SECONDS, tail * math.exp(_STEP * (self.quantile - (0.0 if beyond else 1.0))))
        return beyond

"""One measured point (an arm at a rate) reduced to the figures the reports compare."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench.client import Outcome, RunResult
from bench.common import pct
from bench.podmon import Delta


@dataclass(slots=True)
class Point:
    scenario: str
    arm: str
    rate: float  # offered requests/s
    achieved: float = float("nan")  # completed requests/s (sent in the measured window)
    sent: int = 0
    ok: int = 0
    errors: int = 0
    not_sent: int = 0
    ttft: tuple[float, float, float] = (math.nan, math.nan, math.nan)  # p50, p90, p99 seconds
    itl: tuple[float, float] = (math.nan, math.nan)  # p50, p99 seconds
    out_tps: float = float("nan")
    hit_rate: float = float("nan")
    share: list[float] = field(default_factory=list)
    clock: float = float("nan")  # client e2e / (time_scale × engine e2e): ~1 when the pods kept up
    by_kind: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # TTFT p50/p90/p99 per class
    loadgen: str = "own"
    load_series: list[list[tuple[float, float]]] = field(default_factory=list)  # per pod: (t, running+waiting)

    @property
    def share_spread(self) -> str:
        if not self.share:
            return "–"
        return f"{min(self.share):.0%}–{max(self.share):.0%}"


def ttft_triplet(outcomes: list[Outcome]) -> tuple[float, float, float]:
    values = [o.ttft for o in outcomes if o.ok and not math.isnan(o.ttft)]
    return pct(values, 0.5), pct(values, 0.9), pct(values, 0.99)


def from_run(scenario: str, arm: str, rate: float, run: RunResult, warmup: float, duration: float,
             pods: Delta, whole: Delta, time_scale: float) -> Point:
    """Requests sent during [warmup, duration) count; earlier ones warm the caches. `pods` covers
    that window; `whole` covers the entire run, the same requests as all of the client's, so the
    engine's own latency can be set against the client's (the `clock` check)."""
    window = [o for o in run.outcomes if o.sent >= warmup]
    ok = [o for o in window if o.ok]
    span = max(1e-9, duration - warmup)
    itls = [g for o in ok for g in o.itls]
    kinds = sorted({o.kind for o in window})
    e2e = [o.e2e for o in run.outcomes if o.ok]
    client_e2e = sum(e2e) / len(e2e) if e2e else math.nan
    engine = whole.engine_e2e_mean * time_scale
    return Point(
        scenario, arm, rate,
        achieved=len(ok) / span,
        sent=len(window), ok=len(ok), errors=len(window) - len(ok), not_sent=run.not_sent,
        ttft=ttft_triplet(window), itl=(pct(itls, 0.5), pct(itls, 0.99)),
        out_tps=sum(o.tokens for o in ok) / span,
        hit_rate=pods.hit_rate, share=pods.share,
        clock=client_e2e / engine if engine and not math.isnan(engine) else math.nan,
        by_kind={k: ttft_triplet([o for o in window if o.kind == k]) for k in kinds} if len(kinds) > 1 else {},
    )

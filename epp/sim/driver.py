"""Drive one engine in virtual time: an arrival list in, finished requests and queue trace out.

The smallest event loop over `Engine.schedule`/`update`: requests that arrive during a step join
at its end (keeping their own arrival times), and an idle engine jumps to the next arrival.
A multi-engine cluster does the same with one busy-until time per engine.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from epp.sim.engine import Engine, StepResult
from epp.sim.request import Request


@dataclass(slots=True)
class QueueSample:
    time: float
    num_waiting: int
    num_running: int
    kv_cache_usage: float


@dataclass(slots=True)
class RunResult:
    finished: list[Request] = field(default_factory=list)
    end_time: float = 0.0
    num_steps: int = 0
    samples: list[QueueSample] = field(default_factory=list)

    def output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.finished)


def run(engine: Engine, arrivals: Iterable[Request], *, until: float | None = None,
        sample_every: float = 0.0, on_step: Callable[[StepResult], None] | None = None) -> RunResult:
    """Run until every request has finished, or until virtual time `until` (arrivals sorted by time)."""
    result = RunResult()
    it = iter(arrivals)
    nxt = next(it, None)
    now = 0.0
    next_sample = 0.0
    while True:
        while nxt is not None and nxt.arrival_time <= now:
            engine.add_request(nxt)
            nxt = next(it, None)
        if until is not None and now >= until:
            break
        if sample_every and now >= next_sample:
            snap_kv = engine.kv.usage
            result.samples.append(QueueSample(now, len(engine.waiting), len(engine.running), snap_kv))
            next_sample = now + sample_every
        out = engine.schedule(now)
        if out is None:
            if nxt is None:
                break
            now = nxt.arrival_time
            continue
        step = engine.update(out)
        result.num_steps += 1
        result.finished.extend(step.finished)
        if on_step is not None:
            on_step(step)
        now = out.end_time
    result.end_time = now
    return result


def poisson_times(rate: float, rng: random.Random, *, count: int | None = None,
                  duration: float | None = None) -> Iterator[float]:
    """Arrival times of a Poisson process of `rate` per second (stop after count or duration)."""
    t = 0.0
    i = 0
    while (count is None or i < count):
        t += rng.expovariate(rate)
        if duration is not None and t > duration:
            return
        i += 1
        yield t

"""Why a policy won or lost: what each pick looked like against the engines' true state.

At every dispatch the cluster records, from the simulated engines themselves:
- how much more uncached prefill was queued on the chosen pod than on the least loaded one
  (a pick "behind ≥ 4k" waits for another pod's worth of prefill it could have skipped);
- what the router believed the chosen pod had cached for this prompt (routers that keep a prefix
  index say so) and what the engine really had at admission — the index's accuracy;
- the router's predicted time to first token, when it predicts one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from epp.sim.engine import Engine

BEHIND_TOKENS = 4096


@dataclass(slots=True)
class PickInfo:
    """One dispatch, for the report (the job's outcome says what really happened)."""

    job_id: int
    queued_excess: int  # uncached prefill queued on the chosen pod minus the least loaded pod's
    believed_cached: int = -1  # prompt tokens the router believed the pod held (-1: it keeps no index)
    predicted_ttft: float = math.nan  # seconds (nan: the router does not predict)


class QueuedPrefill:
    """Uncached prefill tokens each engine has queued, memoised per engine step."""

    __slots__ = ("_memo",)

    def __init__(self, pods: int) -> None:
        self._memo: list[tuple[int, int, int]] = [(-1, -1, 0)] * pods  # (steps, waiting, tokens)

    def tokens(self, i: int, engine: Engine) -> int:
        steps, waiting, tokens = self._memo[i]
        if steps == engine.num_steps and waiting == len(engine.waiting):
            return tokens
        kv = engine.kv
        bs = engine.config.block_size
        total = 0
        for r in engine.waiting:
            total += max(0, r.num_tokens - kv.cached_prefix_blocks(r) * bs)
        for r in engine.running:
            if r.num_output_tokens == 0:
                total += r.prompt_len - r.num_computed_tokens
        self._memo[i] = (engine.num_steps, len(engine.waiting), total)
        return total

    def excess(self, chosen: int, engines: list[Engine]) -> int:
        queued = [self.tokens(i, e) for i, e in enumerate(engines)]
        return queued[chosen] - min(queued)

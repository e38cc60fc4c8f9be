"""Decision traces: why each request went where it went, for logs, `epp status` and a debug header.

One record per request that reached a decision (a pick, a shed, an error after parsing). Records
are cheap to make: the scheduler already keeps each scorer's raw scores per candidate; the trace
only holds references, and formats them when someone looks (a log line at -v 4, the admin API,
the optional `x-epp-decision` response header).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from epp.api.headers import DEBUG_DECISION
from epp.api.request import InferenceRequest
from epp.scheduling.framework import SchedulingResult
from epp.scheduling.prefix_match import SOURCE_APPROXIMATE, PrefixMatch

log = logging.getLogger("epp.decision")

DEBUG_HEADER = DEBUG_DECISION


@dataclass(slots=True)
class DecisionRecord:
    request_id: str
    time: float  # unix seconds
    model: str
    target_model: str
    objective: str
    fairness_id: str
    priority: int
    outcome: str  # "picked" or the reason it ended without one
    http_status: int = 200
    message: str = ""
    result: SchedulingResult | None = None
    scheduling_seconds: float = 0.0
    queued_seconds: float = 0.0

    @property
    def targets(self) -> list[str]:
        return [ep.address for ep in self.result.targets] if self.result else []

    def candidates(self) -> list[tuple[str, float, dict[str, float]]]:
        """(address, weighted total, {scorer: raw score}) per candidate of the primary profile."""
        if self.result is None:
            return []
        profile = self.result.profiles[self.result.primary_profile]
        rows = []
        for i, endpoint in enumerate(profile.candidates):
            scores = {name: values[i] for name, values in profile.scores.items()}
            rows.append((endpoint.address, profile.total[i] if i < len(profile.total) else 0.0, scores))
        return rows

    def prefix(self) -> list[dict[str, object]]:
        """What each prefix producer matched, and for which endpoints it fell back to the
        approximate index (endpoints without KV events, requests without token ids)."""
        if self.result is None:
            return []
        rows: list[dict[str, object]] = []
        for name, value in self.result.cycle.data.items():
            if isinstance(value, PrefixMatch) and (value.sources or value.note) and "/" not in name:
                rows.append({"producer": name, "blocks": value.total, "block_tokens": value.block_size_tokens,
                             "matched": dict(value.matched), "sources": dict(value.sources),
                             "tiers": dict(value.tiers), "note": value.note})
        return rows

    def predictions(self) -> list[dict[str, object]]:
        """Per candidate, the predicted-latency producer's TTFT and its parts (empty when the
        configuration predicts nothing)."""
        if self.result is None:
            return []
        rows: list[dict[str, object]] = []
        for address, p in self.result.cycle.predictions.items():
            rows.append({"address": address, "ttft_ms": round(p.ttft * 1e3, 2), "cost_ms": round(p.cost * 1e3, 2),
                         "queued_prefill": round(p.queued_prefill), "own_prefill": p.own_prefill,
                         "cache_credit": p.cached_tokens, "recompute": p.recompute_tokens,
                         "expected_output": p.output_tokens,
                         "credited_ttft_ms": round((p.credited_ttft or p.ttft) * 1e3, 2),
                         "uncalibrated_ttft_ms": round((p.raw_ttft or p.ttft) * 1e3, 2),
                         "drain_ms": round(p.drain_seconds * 1e3, 2),
                         "drain_charge_ms": round(p.drain_charge * 1e3, 2),
                         "eviction_charge_ms": round(p.eviction_charge * 1e3, 2),
                         "kv_overflow": round(p.kv_overflow, 4),
                         "slot_charge_ms": round(p.slot_charge * 1e3, 2),
                         "kv_time_charge_ms": round(p.kv_time_charge * 1e3, 2),
                         "tail_charge_ms": round(p.tail_charge * 1e3, 2),
                         "prefill_ms": round(p.prefill_seconds * 1e3, 2),
                         "wait_ms": round(p.wait_seconds * 1e3, 2),
                         "paced_wait_ms": round(p.paced_wait_seconds * 1e3, 2), "itl_ms": round(p.itl * 1e3, 2),
                         "copy_credit_ms": round(p.copy_credit * 1e3, 2), "copy_reason": p.copy_reason,
                         "recompute_ms": round(p.recompute_seconds * 1e3, 2), "saturated": p.saturated,
                         "saturation_charge_ms": round(p.saturation_charge * 1e3, 2), "young_prefix": p.young_prefix,
                         "beyond_bound_ms": round(p.beyond_bound * 1e3, 2), "ttft_bounded": p.ttft_bounded,
                         "decode_charge_ms": round(p.decode_charge * 1e3, 2), "at_busy_cap": p.at_busy_cap,
                         "chunk_charge_ms": round(p.chunk_charge * 1e3, 2),
                         "first_token_ranked": p.first_token_ranked, "overload_ranked": p.overload_ranked,
                         "prefix_source": p.prefix_source})
        return rows

    def as_dict(self) -> dict[str, object]:
        return {
            "prefix": self.prefix(),
            "predictions": self.predictions(),
            "request_id": self.request_id,
            "model": self.model,
            "target_model": self.target_model,
            "objective": self.objective,
            "fairness_id": self.fairness_id,
            "priority": self.priority,
            "outcome": self.outcome,
            "status": self.http_status,
            "message": self.message,
            "targets": self.targets,
            "candidates": [{"address": a, "total": round(t, 4), "scores": {k: round(v, 4) for k, v in s.items()}}
                           for a, t, s in self.candidates()],
            "scheduling_us": round(self.scheduling_seconds * 1e6, 1),
            "queued_ms": round(self.queued_seconds * 1e3, 3),
        }

    def compact(self, limit: int = 4) -> str:
        """One header-sized line: pick and the top candidates with their per-scorer scores."""
        if self.result is None:
            return f"outcome={self.outcome};status={self.http_status}"
        rows = sorted(self.candidates(), key=lambda r: -r[1])[:limit]
        parts = [f"pick={','.join(self.targets)}"]
        predictions = self.result.cycle.predictions
        for address, total, scores in rows:
            detail = ",".join(f"{name}={value:.2f}" for name, value in scores.items())
            prediction = predictions.get(address)
            if prediction is not None:
                detail += "," + prediction.compact()
            parts.append(f"{address}={total:.2f}({detail})")
        for row in self.prefix():
            sources = row["sources"]
            assert isinstance(sources, dict)
            approx = sum(1 for v in sources.values() if v == SOURCE_APPROXIMATE)
            parts.append(f"prefix={row['producer']}:precise={len(sources) - approx},approximate={approx}")
        return ";".join(parts)


@dataclass(slots=True)
class DecisionTrace:
    """The most recent decisions in memory, and one structured log record each at -v 4."""

    capacity: int = 256
    recent: deque[DecisionRecord] = field(init=False)
    total: int = 0

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.capacity)

    def record(self, request: InferenceRequest, outcome: str, *, result: SchedulingResult | None = None,
               http_status: int = 200, message: str = "", scheduling_seconds: float = 0.0,
               queued_seconds: float = 0.0) -> DecisionRecord:
        entry = DecisionRecord(
            request_id=request.request_id, time=time.time(), model=request.model,
            target_model=request.target_model, objective=request.objective, fairness_id=request.fairness_id,
            priority=request.priority, outcome=outcome, http_status=http_status, message=message,
            result=result, scheduling_seconds=scheduling_seconds, queued_seconds=queued_seconds,
        )
        self.recent.append(entry)
        self.total += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decision", extra={"decision": entry.as_dict()})
        return entry

    def latest(self, n: int) -> list[DecisionRecord]:
        """Newest first."""
        if n <= 0:
            return []
        items = list(self.recent)[-n:]
        items.reverse()
        return items

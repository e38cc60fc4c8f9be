"""What flow control reports to the observability layer.

A structural protocol, so the controller never imports Prometheus and the simulator can pass its
own recorder (or nothing). `epp.observability.metrics.EppMetrics` implements it with the
reference's metric names.
"""

from __future__ import annotations

from typing import Protocol


class FlowMetricsSink(Protocol):
    def flow_queue_changed(self, fairness_id: str, priority: int, model: str, target_model: str,
                           requests: int, size: int) -> None:
        """Queued requests/bytes of one flow and model changed by these deltas."""

    def flow_request_done(self, fairness_id: str, priority: int, model: str, target_model: str,
                          outcome: str, seconds: float) -> None:
        """A request left flow control (any outcome) after `seconds` in it."""

    def flow_rejected(self, reason: str, priority: int) -> None:
        """A request ended without being dispatched (capacity, saturated, ttl, evicted, ...)."""

    def flow_enqueue_duration(self, fairness_id: str, priority: int, outcome: str, seconds: float) -> None:
        """Time the enqueue step took (wall time)."""

    def flow_dispatch_cycle(self, seconds: float) -> None:
        """Time one dispatch cycle took (wall time)."""

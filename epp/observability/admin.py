"""The admin gRPC API (`proto/epp/admin/v1/admin.proto`): a snapshot for `epp status`.

It reads the same objects the request path reads (datastore, saturation detector, flow-control
queues, decision trace) through plain callables, so it imports nothing above observability.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from epp import __version__
from epp.admin.v1 import admin_pb2, admin_pb2_grpc
from epp.datastore import Datastore
from epp.observability.trace import DecisionTrace


@dataclass(slots=True)
class QueueInfo:
    priority: int
    fairness_id: str
    requests: int
    bytes: int
    oldest_seconds: float


@dataclass(slots=True)
class StatusSources:
    datastore: Datastore
    ready: Callable[[], bool]
    saturation: Callable[[], float]
    trace: DecisionTrace
    queues: Callable[[], list[QueueInfo]] = field(default=lambda: [])
    flow_control_enabled: bool = False
    started: float = field(default_factory=time.monotonic)


def build_status(sources: StatusSources, decisions: int) -> admin_pb2.Status:
    store = sources.datastore
    now = store.clock()
    status = admin_pb2.Status(
        pool_name=store.pool.name, pool_namespace=store.pool.namespace, version=__version__,
        uptime_seconds=time.monotonic() - sources.started, ready=sources.ready(),
        pool_saturation=sources.saturation(), flow_control_enabled=sources.flow_control_enabled,
        requests_total=sources.trace.total,
    )
    for ep in store.endpoints():
        m, load, service = ep.metrics, ep.load, ep.service
        status.endpoints.append(admin_pb2.EndpointStatus(
            address=ep.address, name=ep.name, engine=ep.spec.engine or "default",
            waiting_queue_size=m.waiting_queue_size, running_requests=m.running_requests,
            kv_cache_usage=m.kv_cache_usage, inflight_requests=ep.inflight_requests,
            inflight_tokens=ep.inflight_tokens,
            metrics_age_seconds=(now - m.update_time) if m.update_time > 0 else -1.0,
            scrape_error=ep.scrape_error, active_adapters=sorted(m.active_models),
            inter_token_latency_seconds=getattr(m, "inter_token_latency", 0.0),
            queued_prefill_tokens=load.backlog_at(now), decoding_requests=load.decoding,
            prefill_tokens_per_second=service.prefill_rate(load.decoding, load.context_tokens),
            step_seconds=service.step_seconds(load.decoding, load.context_tokens),
            step_scale=service.step_scale, prefill_scale=service.prefill_scale,
            ttft_prediction_error=service.ttft_error, service_observations=service.observations,
            batch_limit=ep.batch_limit.most_running if ep.batch_limit.taken else 0,
            ttft_calibration=service.ttft_factor, first_token_interval_seconds=load.busy_interval,
        ))
    for q in sources.queues():
        status.queues.append(admin_pb2.QueueStatus(priority=q.priority, fairness_id=q.fairness_id,
                                                   requests=q.requests, bytes=q.bytes,
                                                   oldest_seconds=q.oldest_seconds))
    for record in sources.trace.latest(decisions):
        decision = admin_pb2.Decision(
            request_id=record.request_id, time=record.time, model=record.model,
            target_model=record.target_model, objective=record.objective, fairness_id=record.fairness_id,
            priority=record.priority, outcome=record.outcome, http_status=record.http_status,
            message=record.message, targets=record.targets,
            scheduling_seconds=record.scheduling_seconds, queued_seconds=record.queued_seconds,
        )
        for address, total, scores in record.candidates():
            decision.candidates.append(admin_pb2.CandidateScore(address=address, total=total, scores=scores))
        status.decisions.append(decision)
    return status


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, sources: StatusSources) -> None:
        self.sources = sources

    async def GetStatus(self, request: admin_pb2.GetStatusRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> admin_pb2.Status:
        return build_status(self.sources, min(request.decisions, 1000))


def add_to_server(servicer: AdminServicer, server: grpc.aio.Server) -> None:
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, server)

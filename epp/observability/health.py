"""gRPC health (`grpc.health.v1`) with the reference's service names and semantics.

`liveness` is always SERVING; `readiness`, "" and the ext_proc service name are SERVING only when
discovery has synced the pool and, with leader election on, this replica leads.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READINESS_NAMES = ("readiness", "", EXTPROC_SERVICE, "inference-extension")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, ready: Callable[[], bool]) -> None:
        self.ready = ready

    def status(self, service: str) -> int | None:
        if service == "liveness":
            return _SERVING
        if service in READINESS_NAMES:
            return _SERVING if self.ready() else _NOT_SERVING
        return None

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request, context):  # noqa: N802
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=self.status(name)) for name in
                      ("liveness", "readiness", EXTPROC_SERVICE)}
        )

    async def Watch(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not implemented")

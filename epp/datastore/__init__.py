"""Endpoints and their latest signals: the data every decision reads."""

from epp.datastore.datastore import Datastore, PoolInfo
from epp.datastore.endpoint import (
    EMPTY_METRICS,
    Endpoint,
    EndpointMetrics,
    EndpointSpec,
    join_host_port,
    split_host_port,
)

__all__ = [
    "Datastore",
    "PoolInfo",
    "EMPTY_METRICS",
    "Endpoint",
    "EndpointMetrics",
    "EndpointSpec",
    "join_host_port",
    "split_host_port",
]

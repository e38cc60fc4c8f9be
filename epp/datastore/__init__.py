"""Endpoints and their latest signals: the data every decision reads."""

from epp.datastore.datastore import Datastore, PoolInfo
from epp.datastore.endpoint import (
    EMPTY_METRICS,
    Endpoint,
    EndpointMetrics,
    EndpointSpec,
    join_host_port,
    longest_sequence,
    output_room,
    split_host_port,
)
from epp.datastore.load import EndpointLoad, Outstanding
from epp.datastore.model_stats import ModelStats
from epp.datastore.service_model import ServiceModel, StepCosts, TtftEstimate

__all__ = [
    "Datastore",
    "PoolInfo",
    "EMPTY_METRICS",
    "Endpoint",
    "EndpointMetrics",
    "EndpointSpec",
    "join_host_port",
    "longest_sequence",
    "output_room",
    "split_host_port",
    "EndpointLoad",
    "Outstanding",
    "ModelStats",
    "ServiceModel",
    "StepCosts",
    "TtftEstimate",
]

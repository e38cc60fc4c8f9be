"""A simulated vLLM model server: an engine model steppable on any clock, and HTTP pods around it.

Engine (pure, virtual time): `Engine`, `EngineConfig`, `Request`, `RequestFactory`, `driver.run`.
HTTP pods (aiohttp): `SimPod`, `SimConfig`, `start_pods`, `stop_pods` (imported lazily from
`epp.sim.server`, so engine-only users do not load aiohttp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from epp.sim.config import EngineConfig, SimConfig
from epp.sim.engine import Engine, EngineSnapshot, SchedulerOutput, StepResult
from epp.sim.factory import RequestFactory
from epp.sim.request import Request, RequestStatus
from epp.sim.steptime import StepTimeModel

if TYPE_CHECKING:
    from epp.sim.server import SimPod, start_pods, stop_pods

__all__ = [
    "Engine", "EngineConfig", "EngineSnapshot", "Request", "RequestFactory", "RequestStatus",
    "SchedulerOutput", "SimConfig", "SimPod", "StepResult", "StepTimeModel", "start_pods",
    "stop_pods",
]


def __getattr__(name: str) -> Any:
    if name in ("SimPod", "start_pods", "stop_pods"):
        from epp.sim import server
        return getattr(server, name)
    raise AttributeError(name)

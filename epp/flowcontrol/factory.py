"""Build the admission a loaded config asks for: flow control when its gate is on, else legacy."""

from __future__ import annotations

from epp.datastore import Datastore
from epp.flowcontrol.admission import Admission, LegacyAdmission
from epp.flowcontrol.config import FlowControlConfig
from epp.flowcontrol.controller import FlowController
from epp.flowcontrol.flow_admission import FlowControlAdmission
from epp.flowcontrol.saturation import SaturationDetector
from epp.flowcontrol.sink import FlowMetricsSink


def build_admission(
    flow_control: FlowControlConfig | None,
    detector: SaturationDetector,
    datastore: Datastore,
    *,
    tick: float,
    metrics: FlowMetricsSink | None = None,
) -> Admission:
    """`tick`: how often a dispatch cycle runs while requests wait (use the scrape interval)."""
    if flow_control is None:
        return LegacyAdmission(detector, metrics)
    controller = FlowController(flow_control, detector, datastore.endpoints, datastore.clock, metrics)
    return FlowControlAdmission(controller, tick=tick, datastore=datastore, metrics=metrics)

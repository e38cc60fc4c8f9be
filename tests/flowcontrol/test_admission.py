"""The asyncio adapter with the real director: late binding, wake-ups, and no leak whichever way a
request ends — including a caller cancelled in the instant between its dispatch and its wake-up."""

from __future__ import annotations

import asyncio

import pytest

from epp.api.response import Usage
from epp.config.loader import load_config
from epp.datastore import Datastore
from epp.flowcontrol.flow_admission import STATE_KEY, FlowControlAdmission
from epp.flowcontrol.item import ItemState
from epp.requestcontrol.director import Director
from epp.scheduling.framework import PreRequest, SchedulingResult

from .helpers import HEADER, Pool, controller, request

CONFIG = HEADER + """\
plugins:
- type: queue-scorer
- type: token-fairness-policy
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
dataLayer: {sources: []}
flowControl:
  vllmPriority: {}
  defaultPriorityBand:
    fairnessPolicyRef: token-fairness-policy
    dispatchGate: {inflightRequestsThreshold: 1}
"""


class Rig:
    def __init__(self, pre_request: list[PreRequest] | None = None) -> None:
        self.pool = Pool(1)
        loaded = load_config(CONFIG, Datastore())
        assert loaded.flow_control_config is not None
        self.controller = controller(self.pool, loaded.flow_control_config)
        self.admission = FlowControlAdmission(self.controller, tick=0.01, datastore=self.pool.datastore)
        self.director = Director(self.pool.datastore, loaded.scheduler, self.admission, pre_request=pre_request)
        self.endpoint = self.pool.endpoints[0]

    def assert_nothing_held(self) -> None:
        assert self.endpoint.inflight_requests == 0 and self.endpoint.inflight_tokens == 0
        assert len(self.controller) == 0 and self.controller.inflight == 0
        assert all(band.flows == {} for band in self.controller.bands())


async def test_late_binding_wakes_the_next_request_when_one_finishes() -> None:
    rig = Rig()
    await rig.admission.start()
    try:
        decision, first = await rig.director.handle_request(request("a"))
        assert decision.targets == [rig.endpoint] and rig.endpoint.inflight_requests == 1
        second = asyncio.create_task(rig.director.handle_request(request("b")))
        await asyncio.sleep(0)
        assert not second.done() and len(rig.controller) == 1
        rig.director.release(first, Usage(prompt_tokens=10, completion_tokens=20))
        decision2, record2 = await asyncio.wait_for(second, 5)
        assert decision2.targets == [rig.endpoint]
        assert decision2.body is not None and b'"priority":0' in decision2.body
        rig.director.release(record2)
        rig.assert_nothing_held()
    finally:
        await rig.admission.stop()


async def test_cancelled_while_queued() -> None:
    rig = Rig()
    await rig.admission.start()
    try:
        _, first = await rig.director.handle_request(request("a"))
        waiting = asyncio.create_task(rig.director.handle_request(request("b")))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert len(rig.controller) == 0 and rig.endpoint.inflight_requests == 1
        rig.director.release(first)
        rig.assert_nothing_held()
    finally:
        await rig.admission.stop()


async def test_cancelled_between_its_dispatch_and_its_wake_up() -> None:
    rig = Rig()
    await rig.admission.start()
    try:
        _, first = await rig.director.handle_request(request("a"))
        waiting = asyncio.create_task(rig.director.handle_request(request("b")))
        await asyncio.sleep(0)
        [item] = list(rig.controller.band(0).arrivals)
        rig.director.release(first)
        rig.admission._cycle()  # the dispatch happens: the pick is accounted for "b" ...
        assert item.state is ItemState.DISPATCHED and rig.endpoint.inflight_requests == 1
        waiting.cancel()  # ... and its client goes away before the coroutine resumes
        with pytest.raises(asyncio.CancelledError):
            await waiting
        rig.assert_nothing_held()
    finally:
        await rig.admission.stop()


class _Exploding(PreRequest):
    type = "exploding"

    def pre_request(self, request, result: SchedulingResult) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")  # any failure after the pick


async def test_a_failure_after_the_pick_releases_it() -> None:
    rig = Rig(pre_request=[_Exploding()])
    await rig.admission.start()
    try:
        with pytest.raises(RuntimeError):
            await rig.director.handle_request(request("a"))
        rig.assert_nothing_held()
    finally:
        await rig.admission.stop()


async def test_usage_from_the_response_corrects_the_token_charge() -> None:
    rig = Rig()
    await rig.admission.start()
    try:
        req = request("a", max_tokens=50)
        _, record = await rig.director.handle_request(req)
        item = req.state[STATE_KEY]
        assert item.charged == req.prompt_tokens_estimate + 2 * 50
        rig.director.release(record, Usage(prompt_tokens=7, completion_tokens=3))
        assert item.charged == 7 + 2 * 3
        assert STATE_KEY not in req.state
        rig.assert_nothing_held()
    finally:
        await rig.admission.stop()


async def test_a_response_over_frees_the_slot_before_its_usage_comes() -> None:
    """Envoy's access log brings a plain response's usage after its end (`Director.response_over`):
    the next queued request is dispatched at the end, and the usage still corrects the charge."""
    rig = Rig()
    await rig.admission.start()
    try:
        req = request("a", max_tokens=50)
        _, first = await rig.director.handle_request(req)
        second = asyncio.create_task(rig.director.handle_request(request("b")))
        await asyncio.sleep(0)
        assert not second.done()
        rig.director.response_over(first)
        decision2, record2 = await asyncio.wait_for(second, 5)  # dispatched with no usage yet
        assert decision2.targets == [rig.endpoint] and rig.endpoint.inflight_requests == 1
        item = req.state[STATE_KEY]
        rig.director.release(first, Usage(prompt_tokens=7, completion_tokens=3))  # the usage, later
        assert item.charged == 7 + 2 * 3 and rig.controller.inflight == 1  # dropped once, not twice
        rig.director.release(record2)
        rig.assert_nothing_held()
    finally:
        await rig.admission.stop()

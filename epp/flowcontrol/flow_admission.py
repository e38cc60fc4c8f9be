"""Flow control behind the ext_proc server: the synchronous controller plus asyncio plumbing.

`run` enqueues the request, runs a dispatch cycle at once (an idle pool dispatches without a
single extra loop turn) and waits on a future the cycle resolves. A background loop runs a cycle
whenever something may have freed capacity: a request completed or streamed its first byte (its
prefill is over), an endpoint was added, a TTL is due, a queued-tokens gate reopens by the
ledger's timeline, and every `tick` seconds while requests wait (new scraped metrics arrive on
that cadence; the default is the scrape interval).

A caller that is cancelled while queued (the client went away, so Envoy closed the stream) takes
its request out of the queue synchronously in its `except` block: nothing stays behind. One
cancelled just after its dispatch keeps nothing here either: the director releases the pick it
accounted in `schedule`, which calls `completed`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from epp.api.engines import accepts_vllm_priority
from epp.api.request import InferenceRequest
from epp.api.response import Usage
from epp.datastore import Datastore, Endpoint
from epp.flowcontrol.admission import Admission, ScheduleFn
from epp.flowcontrol.controller import FlowController
from epp.flowcontrol.item import Ending, ItemState, Outcome, QueueItem
from epp.flowcontrol.sink import FlowMetricsSink
from epp.scheduling.framework import SchedulingResult

log = logging.getLogger("epp.flowcontrol")

_MIN_REOPEN_SLEEP = 0.001  # seconds: the loop never spins on a reopening it just missed
STATE_KEY = "flow-control"  # the request's dispatched QueueItem, in `InferenceRequest.state`


class FlowControlAdmission(Admission):
    def __init__(self, controller: FlowController, *, tick: float = 0.05, datastore: Datastore | None = None,
                 metrics: FlowMetricsSink | None = None) -> None:
        if tick <= 0:
            raise ValueError("tick must be > 0")
        self.controller = controller
        self.tick = tick
        self.datastore = datastore
        self.metrics = metrics
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._sleep_until = math.inf  # when the loop runs its next cycle unless woken (controller clock)
        self._no_priority_engines: set[str] = set()  # engines already logged as getting no `priority`

    # -- lifecycle --

    async def start(self) -> None:
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="flow-control dispatch")
        if self.datastore is not None:
            self.datastore.subscribe(on_add=self._on_endpoint_added)

    async def stop(self) -> None:
        if self.datastore is not None:
            self.datastore.unsubscribe(on_add=self._on_endpoint_added)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._resolve(self.controller.drain())

    def _on_endpoint_added(self, endpoint: Endpoint) -> None:
        self.wake()

    def wake(self) -> None:
        """Run a dispatch cycle soon (capacity may have appeared)."""
        if self._wake is not None:
            self._wake.set()

    # -- Admission --

    async def run(self, request: InferenceRequest, candidates: list[Endpoint], schedule: ScheduleFn) -> SchedulingResult:
        eligible = self.eligible(request, candidates)
        narrowed = request.subset is not None or len(eligible) < len(candidates)
        allowed = frozenset(ep.address for ep in eligible) if narrowed else None
        waiter: asyncio.Future[Ending] = asyncio.get_running_loop().create_future()
        item = QueueItem(request, schedule, allowed, waiter=waiter)
        started = time.perf_counter()
        self._resolve(self.controller.enqueue(item))
        if self.metrics is not None:
            outcome = "Enqueued" if item.state is ItemState.QUEUED else (
                waiter.result().outcome.value if waiter.done() else "Unknown")
            self.metrics.flow_enqueue_duration(item.flow_id, item.priority, outcome, time.perf_counter() - started)
        if item.state is ItemState.QUEUED:
            self._cycle()
            if item.state is ItemState.QUEUED and (self._sleep_until == math.inf or item.deadline < self._sleep_until):
                self.wake()  # the loop sleeps past this request's tick or TTL: let it re-plan
        try:
            ending = await waiter
        except asyncio.CancelledError:
            if item.state is ItemState.QUEUED:
                self.controller.remove(item)
            raise
        if ending.error is not None:
            raise ending.error
        assert ending.result is not None
        return ending.result

    def progressed(self) -> None:
        if len(self.controller):
            self.wake()

    def left_pod(self, request: InferenceRequest) -> None:
        item = request.state.get(STATE_KEY)
        if item is None:
            return
        self.controller.left_pod(item)
        self.wake()

    def completed(self, request: InferenceRequest, usage: Usage | None) -> None:
        item = request.state.pop(STATE_KEY, None)
        if item is None:
            return
        self.controller.complete(item, usage)
        self.wake()

    def body_fields(self, request: InferenceRequest, endpoint: Endpoint) -> dict[str, Any]:
        """vLLM's `priority`, when enabled and the picked endpoint's engine has the field; for
        any other engine (TGI has none; SGLang orders the other way) flow control's own queues
        are the only ordering, and the first such engine is logged once."""
        item = request.state.get(STATE_KEY)
        if item is None or item.engine_priority is None:
            return {}
        engine = self.engine_of(endpoint)
        if not accepts_vllm_priority(engine):
            if engine not in self._no_priority_engines:
                self._no_priority_engines.add(engine)
                log.info("vllmPriority: not written for engine %r (first: endpoint %s); its requests are "
                         "ordered by flow control's queues only", engine, endpoint.name)
            return {}
        return {"priority": item.engine_priority}

    # -- dispatch --

    def _resolve(self, endings: list[Ending]) -> None:
        for ending in endings:
            item = ending.item
            if ending.outcome is Outcome.DISPATCHED and ending.error is None:
                item.request.state[STATE_KEY] = item  # until `completed`
            waiter = item.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(ending)

    def _cycle(self) -> None:
        busy = len(self.controller) > 0
        started = time.perf_counter()
        try:
            endings = self.controller.dispatch()
        except Exception:  # a bug must not stop the loop and strand every queued request
            log.exception("flow-control dispatch cycle failed")
            return
        self._resolve(endings)
        if busy and self.metrics is not None:
            self.metrics.flow_dispatch_cycle(time.perf_counter() - started)

    async def _loop(self) -> None:
        assert self._wake is not None
        wake = self._wake
        while True:
            timeout = self.tick if len(self.controller) else math.inf
            deadline = self.controller.next_deadline()
            now = self.controller.clock()
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - now))
            if timeout > _MIN_REOPEN_SLEEP and len(self.controller):
                reopening = self.controller.next_reopening(now)
                if reopening < math.inf:  # a token gate reopens before the tick: be there
                    timeout = min(timeout, max(_MIN_REOPEN_SLEEP, reopening - now))
            self._sleep_until = now + timeout
            if not wake.is_set():
                try:
                    async with asyncio.timeout(None if timeout == math.inf else timeout):
                        await wake.wait()
                except TimeoutError:
                    pass
            wake.clear()
            self._cycle()

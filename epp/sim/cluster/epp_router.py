"""The EPP under test: its real config loader, scheduler, admission (legacy or flow control)
and `Director`, driven in-process on the cluster's virtual clock.

Each request takes the production path from the ext_proc stream on: an OpenAI completions body
and the gateway's headers go through `parse_request`, then `Director.handle_request` (objective
→ priority, admission — which may queue it in flow control — scheduling, pick-time accounting,
pre-request plugins such as the prefix index); when the engine finishes it, `Director.release`
gets the response's usage (flow control's token fairness reads it). Scraped metrics are written
into the datastore's endpoints exactly as the data layer would, unless the config turns metric
collection off (`dataLayer: {sources: []}`).

Pickers are reseeded from the run seed, so a run is reproducible.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import orjson

from epp.api.headers import FAIRNESS_ID, OBJECTIVE, SLO_TTFT
from epp.api.request import parse_request
from epp.api.response import Usage
from epp.core import build_core
from epp.datastore import Datastore, Endpoint, EndpointMetrics, EndpointSpec
from epp.flowcontrol.flow_admission import FlowControlAdmission
from epp.requestcontrol.director import Decision, RequestRecord
from epp.scheduling.prefix_match import PrefixMatch
from epp.sim.cluster.routers import Router
from epp.sim.kv_events import EventBatch
from epp.sim.cluster.traffic import Job

if TYPE_CHECKING:
    from epp.sim.cluster.cluster import Cluster

COMPLETIONS = "/v1/completions"


def pod_address(index: int) -> tuple[str, int]:
    """A stable fake pod IP (10.x.y.z) and the vLLM port."""
    n = index + 1
    return f"10.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}", 8000


class EppRouter(Router):
    """Routes through the EPP; `config_text` is an EndpointPickerConfig (None: the default)."""

    wants_metrics = True
    wants_first_token = True  # the EPP reads the first streamed bytes, as the ext_proc stream does

    def __init__(self, config_text: str | None = None, *, name: str = "epp", seed: int = 0,
                 refresh_interval: float = 0.05) -> None:
        self.name = name
        self.config_text = config_text
        self.seed = seed
        self.refresh_interval = refresh_interval
        self.endpoints: list[Endpoint] = []
        self._index: dict[str, int] = {}
        self.classes: list[dict[str, str]] = []
        self._last: Decision | None = None  # the decision `route` just made, for `belief`

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        self.datastore = Datastore(clock=cluster.loop.time)
        for i in range(len(cluster.pods)):
            ip, port = pod_address(i)
            ep = self.datastore.upsert(EndpointSpec(name=f"pod-{i}", ip=ip, port=port))
            self.endpoints.append(ep)
            self._index[ep.address] = i
        self.datastore.synced = True
        workload = cluster.workload
        for objective, priority in workload.all_objectives().items():
            self.datastore.set_objective(objective, priority)
        core = build_core(self.datastore, self.config_text, tick=self.refresh_interval, seed=self.seed)
        self.config = core.config
        self.admission = core.admission
        self.director = core.director
        self.wants_metrics = self.config.data_layer is not None
        # A precise prefix index hears every pod's KV events, as the runner's ZMQ subscribers
        # would deliver them (after the feed's transport delay).
        self._indexes = [producer.index for producer in core.precise_producers]
        if self._indexes:
            cluster.kv_events.subscribe(self._kv_events)
        # Per class: the headers its requests carry.
        self.classes = []
        for spec in workload.classes:
            headers = {}
            if spec.objective:
                headers[OBJECTIVE] = spec.objective
            if spec.slo_ttft is not None:
                headers[SLO_TTFT] = str(int(spec.slo_ttft * 1000))
            self.classes.append(headers)
        self._model = workload.model

    def _kv_events(self, pod: int, seq: int, batch: EventBatch) -> None:
        address = self.endpoints[pod].address
        now = self.datastore.clock()
        for index in self._indexes:
            index.apply(address, batch.events, now)

    async def start(self) -> None:
        await self.admission.start()

    async def stop(self) -> None:
        await self.admission.stop()

    @property
    def flow_control(self) -> bool:
        return isinstance(self.admission, FlowControlAdmission)

    def queued(self) -> int:
        admission = self.admission
        return len(admission.controller) if isinstance(admission, FlowControlAdmission) else 0

    def observe(self, pod: int, metrics: EndpointMetrics) -> None:
        self.endpoints[pod].update_metrics(metrics)

    async def route(self, job: Job) -> int:
        body = {"model": job.lora or self._model, "prompt": job.prompt, "max_tokens": job.max_tokens,
                "stream": True}
        headers = dict(self.classes[job.cls])
        if job.tenant:
            headers[FAIRNESS_ID] = job.tenant
        request = parse_request(orjson.dumps(body), path=COMPLETIONS, request_id=str(job.id), headers=headers)
        decision, record = await self.director.handle_request(request)
        job.handle = record
        self._last = decision
        if decision.body is not None and job.request is not None:
            sent = orjson.loads(decision.body)
            priority = sent.get("priority")
            if isinstance(priority, int):  # flow control's order, carried into vLLM
                job.request.priority = priority
        return self._index[decision.targets[0].address]

    def belief(self, job: Job) -> tuple[int, float]:
        """What the pick's cycle believed of the chosen pod: the cache credit (the prediction's, or
        the first prefix producer's match) and the predicted TTFT."""
        decision, self._last = self._last, None
        if decision is None or decision.result is None:
            return -1, math.nan
        cycle = decision.result.cycle
        address = decision.targets[0].address
        prediction = cycle.predictions.get(address)
        if prediction is not None:
            return prediction.cached_tokens, prediction.ttft
        for value in cycle.data.values():
            if isinstance(value, PrefixMatch):
                return value.tokens(address), math.nan
        return -1, math.nan

    def predicted_ttfts(self) -> list[float] | None:
        decision = self._last
        if decision is None or decision.result is None:
            return None
        predictions = decision.result.cycle.predictions
        by_pod = [math.inf] * len(self._index)
        for address, index in self._index.items():
            prediction = predictions.get(address)
            if prediction is not None:
                by_pod[index] = prediction.ttft
        return by_pod

    def first_token(self, job: Job) -> None:
        record = job.handle
        if isinstance(record, RequestRecord):
            self.director.first_byte(record)

    def finished(self, job: Job) -> None:
        record = job.handle
        if not isinstance(record, RequestRecord):
            return
        job.handle = None
        usage = None
        if job.ok:
            usage = Usage(prompt_tokens=job.prompt_tokens, completion_tokens=job.generated,
                          total_tokens=job.prompt_tokens + job.generated, cached_tokens=job.cached_tokens)
        else:
            record.error_code = job.error
        self.director.release(record, usage)

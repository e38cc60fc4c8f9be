"""Request control: the path from a parsed request to a pick, and from a response to accounting.

The director owns the EPP's exact in-flight accounting: a request counts against its endpoint
from the moment it is picked (so a burst between two scrapes spreads) until it ends, and it is
released exactly once whatever way it ends (response done, error, client gone, stream reset).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Protocol

import orjson

from epp.api.preparer import RequestPreparer
from epp.api.request import InferenceRequest
from epp.api.response import Usage
from epp.datastore import Datastore, Endpoint, Outstanding, output_room, split_host_port
from epp.errors import Code, EppError
from epp.flowcontrol.admission import Admission
from epp.observability.trace import DecisionRecord, DecisionTrace
from epp.requestcontrol.sink import RequestMetricsSink
from epp.scheduling.framework import PreRequest, ResponseComplete, ResponseReceived, SchedulingResult
from epp.scheduling.prefix_match import held_tokens
from epp.scheduling.scheduler import Scheduler

log = logging.getLogger("epp.requestcontrol")


@dataclass(slots=True)
class Decision:
    """The outcome of one request's admission and scheduling."""

    targets: list[Endpoint]
    body: bytes | None  # the body to forward when we changed it; None forwards the client's bytes
    result: SchedulingResult | None = None  # None for header-only requests


@dataclass(slots=True)
class RequestRecord:
    """Accounting for one in-flight request; `release` makes ending idempotent.

    Times are on the datastore's clock (virtual in the simulator)."""

    request: InferenceRequest
    endpoint: Endpoint | None = None
    tokens: int = 0
    start: float = 0.0
    first_byte: float = 0.0
    released: bool = False
    over: bool = False  # the pod no longer carries it (`Director.response_over`); `released` may follow later
    over_at: float = 0.0  # when (the request's duration ends there, not when its usage came)
    error_code: str = ""
    admitted: bool = False  # went through `Admission.run`, which is told when it ends
    decision: DecisionRecord | None = None  # the trace entry, for the debug response header
    outstanding: Outstanding | None = None  # its entry in the endpoint's ledger
    decode_seen: DecodeSeen | None = None  # a streamed response's decode, from its end to its usage


@dataclass(slots=True)
class DecodeSeen:
    """What the ledger saw of a streamed response's decode, from its first byte to its end."""

    window: float  # seconds
    decode_integral: float  # decoding requests x seconds
    context_integral: float  # context tokens x seconds
    prefill_tokens: float  # prefill computed there meanwhile
    counted_steps: float  # steps the ledger counted (-1: not counted)


class SharedAccounting(Protocol):
    """Hooks for request-path processes that share one view of the pool (`epp.scale`): the
    director stays the exact accountant of its own picks; these fold the other processes' in and
    publish its own. None (the default): this process alone."""

    def refresh(self) -> None:
        """Before a pick: bring the others' latest accounting into the endpoints."""

    def changed(self, endpoint: Endpoint) -> None:
        """This process's own accounting of `endpoint` moved (a pick, a first byte, an end)."""


class Director:
    def __init__(
        self,
        datastore: Datastore,
        scheduler: Scheduler,
        admission: Admission,
        *,
        pre_request: list[PreRequest] | None = None,
        response_received: list[ResponseReceived] | None = None,
        response_complete: list[ResponseComplete] | None = None,
        metrics: RequestMetricsSink | None = None,
        subset_filter: bool = True,
        rng: random.Random | None = None,
        trace: DecisionTrace | None = None,
        preparers: list[RequestPreparer] | None = None,
    ) -> None:
        self.datastore = datastore
        self.preparers = preparers or []  # async steps before admission (e.g. token-producer)
        self.scheduler = scheduler
        self.admission = admission
        self.pre_request = pre_request or []
        self.response_received = response_received or []
        self.response_complete = response_complete or []
        self.metrics = metrics
        self.subset_filter = subset_filter
        self.trace = trace
        self._rng = rng or random.Random()
        self.shared: SharedAccounting | None = None  # set by the runner with several workers or replicas

    # -- request path --

    def candidates(self, request: InferenceRequest) -> list[Endpoint]:
        """The pool's endpoints, narrowed by the proxy's subset hint when it sent one.

        Hint entries match by IP, or by exact ip:port when a port is given (the reference matches
        IP only; matching the port too is what the spec intends for data-parallel ranks).
        """
        endpoints = list(self.datastore.endpoints())
        if request.subset is None or not self.subset_filter:
            return endpoints
        ips: set[str] = set()
        addresses: set[str] = set()
        for entry in request.subset:
            entry = entry.strip()
            try:
                split_host_port(entry)
                addresses.add(entry)
            except ValueError:
                ips.add(entry.strip("[]"))
        return [ep for ep in endpoints if ep.spec.ip in ips or ep.address in addresses]

    async def handle_request(self, request: InferenceRequest) -> tuple[Decision, RequestRecord]:
        """Admit and schedule a request with a body. Raises `EppError` to end it."""
        arrived = time.perf_counter()
        request.received_at = self.datastore.clock()
        timing = [0.0, 0.0]  # [dispatched at, scheduling seconds]
        if request.objective:
            request.priority = self.datastore.objective_priority(request.objective)
        if self.metrics:
            self.metrics.request_received(request)
        if self.preparers:
            await self._prepare(request)
        # The pick is accounted inside `schedule`, when it happens: flow control may dispatch
        # several requests in one cycle and each must see the ones before it. If this coroutine
        # ends without returning the record (cancelled just after its dispatch, a plugin raised),
        # the pick is released here so no in-flight count or flow slot is left behind.
        picked: list[RequestRecord] = []

        def schedule(req: InferenceRequest, eligible: list[Endpoint]) -> SchedulingResult:
            timing[0] = time.perf_counter()
            result = self._schedule(req, eligible)
            timing[1] = time.perf_counter() - timing[0]
            picked.append(self._account(req, result.primary, admitted=True, result=result))
            return result

        try:
            candidates = self.candidates(request)
            if not candidates:
                raise EppError(
                    Code.SERVICE_UNAVAILABLE,
                    "failed to find endpoint candidates for serving the request",
                    reason="no_candidates",
                )
            result = await self.admission.run(request, candidates, schedule)
            record = picked[-1] if picked else self._account(request, result.primary, admitted=True)
            for plugin in self.pre_request:
                plugin.pre_request(request, result)
            body = self._body(request, result.primary)
        except BaseException as exc:
            if (isinstance(exc, EppError) and exc.reason == "no_endpoint" and request.sheddable
                    and request.slo_ttft is not None and self.metrics):
                self.metrics.slo_outcome(request, "shed")  # no pod was predicted to meet it
            code = exc.code.value if isinstance(exc, EppError) else (
                Code.INTERNAL.value if isinstance(exc, Exception) else "Cancelled")
            for leftover in picked:
                leftover.error_code = code
                self.release(leftover)
            if self.trace is not None:
                if isinstance(exc, EppError):
                    self.trace.record(request, exc.reason, http_status=exc.http_status, message=exc.message,
                                      scheduling_seconds=timing[1],
                                      queued_seconds=(timing[0] or time.perf_counter()) - arrived)
                elif not isinstance(exc, Exception):
                    self.trace.record(request, "client_gone", http_status=0, message="stream cancelled",
                                      queued_seconds=(timing[0] or time.perf_counter()) - arrived)
            raise
        if self.trace is not None:
            record.decision = self.trace.record(request, "picked", result=result, scheduling_seconds=timing[1],
                                                queued_seconds=(timing[0] or arrived) - arrived)
        return Decision(targets=result.targets, body=body, result=result), record

    async def _prepare(self, request: InferenceRequest) -> None:
        """Run the request preparers (I/O and heavy CPU the scheduling plugins must not do), each
        bounded by its timeout. A failure only loses its result: its readers fall back."""
        for preparer in self.preparers:
            try:
                await asyncio.wait_for(preparer.prepare_request(request), preparer.timeout)
            except asyncio.TimeoutError:
                log.warning("request preparer timed out", extra={"plugin": preparer.name,
                                                                  "request_id": request.request_id})
            except Exception:
                log.exception("request preparer %s failed", preparer.name)

    def handle_headers_only(self, request: InferenceRequest) -> tuple[Decision, RequestRecord]:
        """A request without a body: a uniformly random candidate, as the reference does."""
        candidates = self.candidates(request)
        if not candidates:
            if request.subset is not None:
                raise EppError(
                    Code.SERVICE_UNAVAILABLE,
                    "failed to find endpoint candidates for serving the request",
                    reason="no_candidates",
                )
            raise EppError(Code.INTERNAL, "no pods available in datastore", reason="no_endpoints")
        endpoint = self._rng.choice(candidates)
        return Decision(targets=[endpoint], body=None), self._account(request, endpoint)

    def _schedule(self, request: InferenceRequest, candidates: list[Endpoint]) -> SchedulingResult:
        if self.shared is not None:
            self.shared.refresh()
        start = time.perf_counter()
        try:
            result = self.scheduler.schedule(request, candidates)
        except EppError:
            if self.metrics:
                self.metrics.scheduled(request, None, time.perf_counter() - start)
            raise
        if self.metrics:
            self.metrics.scheduled(request, result.primary, time.perf_counter() - start)
        return result

    def _account(self, request: InferenceRequest, endpoint: Endpoint, *, admitted: bool = False,
                 result: SchedulingResult | None = None) -> RequestRecord:
        tokens = request.prompt_tokens_estimate + (request.max_tokens or 0)
        longest = endpoint.metrics.max_model_len
        if 0 < longest < tokens:  # vLLM stops the output there: a huge max_tokens holds no more
            tokens = longest
        endpoint.inflight_requests += 1
        endpoint.inflight_tokens += tokens
        if self.metrics:
            self.metrics.running_changed(request.model, +1)
        now = self.datastore.clock()
        record = RequestRecord(request=request, endpoint=endpoint, tokens=tokens, admitted=admitted, start=now)
        if request.body is not None:
            record.outstanding = self._book(request, endpoint, result, now)
        if self.shared is not None:
            self.shared.changed(endpoint)
        return record

    def _book(self, request: InferenceRequest, endpoint: Endpoint, result: SchedulingResult | None,
              now: float) -> Outstanding:
        """Enter the pick in the endpoint's ledger: what it will cost that pod, as predicted."""
        prediction = result.cycle.predictions.get(endpoint.address) if result is not None else None
        load, service = endpoint.load, endpoint.service
        if prediction is not None:
            # The timeline runs on the prediction with the whole cache credit, as the ranking does;
            # the expected one (with the prefix blocks the pod will compute again) is reported.
            item = Outstanding(prediction.prompt_tokens, prediction.cached_tokens, prediction.output_tokens, now,
                               predicted_ttft=prediction.credited_ttft or prediction.ttft,
                               reported_ttft=prediction.ttft, raw_ttft=prediction.raw_ttft or prediction.ttft,
                               streamed=request.stream, model=request.target_model,
                               recompute_tokens=prediction.recompute_tokens)
            if prediction.wait_seconds == 0.0:  # a prediction that waited on a slot teaches nothing
                item.step_feature = prediction.step_feature
                item.prefill_feature = prediction.prefill_feature
        else:  # no predicted-latency producer configured: the service model's own estimate
            prompt = self.datastore.models.get(request.target_model).prompt_tokens(len(request.prompt))
            lengths = self.datastore.models.output_stats(request.target_model, request.fairness_id)
            output = lengths.expected_output(request.max_tokens, output_room(endpoint.metrics.max_model_len, prompt))
            cached = min(prompt - 1, held_tokens(result.cycle.data, endpoint.address)) if result is not None else 0
            item = Outstanding(prompt, max(0, cached), max(1, output), now, streamed=request.stream,
                               model=request.target_model)
            estimate = service.ttft(load.backlog_at(now) + item.prefill_tokens, item.attention_pairs,
                                    load.decoding, load.context_tokens)
            item.predicted_ttft = estimate.seconds
        if prediction is not None:
            load.add(item, now, prediction.work_seconds, prediction.prefill_work_seconds, prediction.kv_token_seconds)
            _pace(endpoint)
            if self.metrics:
                if prediction.copy_credit > 0.0:
                    self.metrics.prefix_copied(request, prediction.copy_credit, prediction.copy_reason)
                if prediction.saturated:
                    self.metrics.saturated_pick(request)
                if prediction.ttft_bounded:
                    self.metrics.ttft_bounded_pick(request)
                if prediction.overload_ranked:
                    self.metrics.overload_ranked_pick(request)
                self.metrics.cold_prompts_reused(request, prediction.cold_prompts_reused)
        else:
            load.add(item, now)
            _pace(endpoint)
        return item

    def _body(self, request: InferenceRequest, endpoint: Endpoint) -> bytes | None:
        """Re-serialise only when we changed the body (unlike the reference, which always does):
        a model rewrite, or fields the admission sets for the picked endpoint's engine (flow
        control's vLLM `priority`)."""
        if request.body is None:
            return None
        fields = self.admission.body_fields(request, endpoint)
        if not request.model_rewritten and not fields:
            return None
        if request.model_rewritten:
            request.body["model"] = request.target_model
        request.body.update(fields)
        return orjson.dumps(request.body)

    # -- response path --

    def first_byte(self, record: RequestRecord) -> None:
        """The response's first body bytes arrived. For a streamed response that is the first
        token: the pod's prefill of this request (and of those it queued behind) is over, and the
        time it took teaches the pod's service model."""
        if record.first_byte or record.released:
            return
        now = self.datastore.clock()
        record.first_byte = now
        item, endpoint = record.outstanding, record.endpoint
        if item is None or endpoint is None or not record.request.stream:
            return  # a buffered response's first byte is its last: no time to first token
        load, service = endpoint.load, endpoint.service
        load.first_byte(item, now)
        _pace(endpoint)
        self.admission.progressed()
        item.mark_time = now
        item.mark_decode_integral = load.decode_integral
        item.mark_context_integral = load.context_integral
        item.mark_prefill_total = load.prefill_total
        observed = now - item.dispatched
        load.observe_tail(self.datastore.ttft_tail.observe(observed))
        if item.step_feature or item.prefill_feature:
            service.observe(item.step_feature, item.prefill_feature, observed)
        if item.raw_ttft > 0.0:
            service.calibrate(item.raw_ttft, observed)
        if self.shared is not None:
            self.shared.changed(endpoint)
        if self.metrics:
            predicted = item.reported_ttft or item.predicted_ttft
            if predicted > 0.0:
                self.metrics.ttft_predicted(record.request, predicted, observed)
            slo = record.request.slo_ttft
            if slo is not None:
                met = now - record.request.received_at <= slo
                self.metrics.slo_outcome(record.request, "met" if met else "missed")

    @staticmethod
    def _decode_seen(record: RequestRecord, now: float) -> DecodeSeen | None:
        """A streamed response ended: what the ledger saw of its decode since its first byte (its
        time integrals; the steps it counted), for its usage to teach the step part."""
        item, endpoint = record.outstanding, record.endpoint
        if item is None or endpoint is None or record.error_code or item.first_token < 0:
            return None
        window = now - item.mark_time
        if window <= 0.0:
            return None
        load = endpoint.load
        return DecodeSeen(window, load.decode_integral - item.mark_decode_integral,
                          load.context_integral - item.mark_context_integral,
                          load.prefill_total - item.mark_prefill_total,
                          load.steps - item.first_step if item.first_step >= 0.0 else -1.0)

    @staticmethod
    def _learn_decode(record: RequestRecord, seen: DecodeSeen | None, usage: Usage | None) -> None:
        """Its mean inter-token latency against the batch it decoded in teaches the step part;
        the steps it had correct the pace of the ledger's step count."""
        endpoint = record.endpoint
        if seen is None or endpoint is None or usage is None or record.error_code or usage.completion_tokens < 2:
            return
        load, service = endpoint.load, endpoint.service
        steps = usage.completion_tokens - 1
        window = seen.window
        step_feature, prefill_feature = service.itl_features(seen.decode_integral / window,
                                                             seen.context_integral / window,
                                                             seen.prefill_tokens / steps)
        service.observe(step_feature, prefill_feature, window / steps)
        load.observe_step_count(seen.counted_steps, steps)

    def on_response_headers(self, record: RequestRecord, served: str) -> dict[str, str]:
        headers: dict[str, str] = {}
        for plugin in self.response_received:
            headers.update(plugin.response_received(record.request, served))
        return headers

    def response_over(self, record: RequestRecord) -> None:
        """The response is over but its usage is reported later (Envoy's access log, batched): the
        pod's share ends now (in flight, the ledger, flow control's slot), the rest when `release`
        brings the usage.
        Safe to call more than once, and after `release`."""
        if record.released or record.over:
            return
        self._end_on_pod(record, None, self.datastore.clock())
        if record.admitted:
            try:
                self.admission.left_pod(record.request)  # its batch slot frees now
            except Exception:  # never leak the rest of the accounting
                log.exception("admission's end on the pod failed")

    def release(self, record: RequestRecord, usage: Usage | None = None, response_bytes: int = 0) -> None:
        """End a request's accounting. Safe to call more than once; only the first call counts."""
        if record.released:
            return
        record.released = True
        endpoint = record.endpoint
        now = self.datastore.clock()
        if not record.over:
            self._end_on_pod(record, usage, now)
        elif record.decode_seen is not None:  # its usage came after its end
            self._learn_decode(record, record.decode_seen, usage)
        if usage is not None and not record.error_code and record.request.body is not None:
            self.datastore.models.observe(record.request.target_model, record.request.fairness_id,
                                          record.request.prompt_chars, usage.prompt_tokens, usage.completion_tokens,
                                          record.request.max_tokens)
        if record.admitted:
            try:
                self.admission.completed(record.request, usage)
            except Exception:  # never leak the rest of the accounting
                log.exception("admission completion failed")
        for plugin in self.response_complete:
            try:
                plugin.response_complete(record.request, endpoint, usage)
            except Exception:  # a plugin must never leak the request's accounting
                log.exception("response-complete plugin %s failed", plugin.name)
        if self.metrics and not record.error_code:
            self.metrics.request_finished(record.request, usage, response_bytes, record.over_at - record.start)

    def _end_on_pod(self, record: RequestRecord, usage: Usage | None, now: float) -> None:
        """What the pod carried for the request: in flight, its ledger entry, the running gauge."""
        record.over = True
        record.over_at = now
        endpoint = record.endpoint
        if endpoint is None:
            return
        endpoint.inflight_requests = max(0, endpoint.inflight_requests - 1)
        endpoint.inflight_tokens = max(0, endpoint.inflight_tokens - record.tokens)
        if record.outstanding is not None:
            load = endpoint.load
            load.settle(now)
            if record.request.stream:
                record.decode_seen = self._decode_seen(record, now)
                if usage is not None:
                    self._learn_decode(record, record.decode_seen, usage)
            load.release(record.outstanding, now)
            _pace(endpoint)
        if self.shared is not None:
            self.shared.changed(endpoint)
        if self.metrics:
            self.metrics.running_changed(record.request.model, -1)


def _pace(endpoint: Endpoint) -> None:
    """After a ledger write: the decode step time of its batch now, which paces the ledger's count
    of the pod's steps (`EndpointLoad.steps`) until the next write. What steps also carry (prefill
    chunks) the count learns from the responses that end (`EndpointLoad.step_pace`): priced with
    the queued prefill instead, each pick's chunk slowed the count until the next write, and the
    head-of-line routing swung more from seed to seed."""
    load = endpoint.load
    load.step_seconds = endpoint.service.step_seconds(load.decoding, load.context_tokens)

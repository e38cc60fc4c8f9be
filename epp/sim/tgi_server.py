"""A simulated Hugging Face TGI 3.3 server: TGI's router in front of the simulator's engine.

`SimPod` builds this app instead of its vLLM one when `SimConfig.server == "tgi"`
(`epp sim --engine tgi`). The engine, its step loop and the request lifecycle are the pod's, the
same continuous-batching model as the vLLM pods: a handler adds a request, sleeps on its waiter
and aborts the request if the client leaves, exactly as SimPod's own handlers do. What is TGI's
here: the routes (`/generate`, `/generate_stream`, `/v1/chat/completions`, `/v1/completions`,
`/info`, `/health`, `/v1/models`, `/metrics`), request validation and error shapes (`epp.sim.tgi_protocol`),
response bodies, events and headers (`epp.sim.tgi_responses`), the concurrency limit
(`--max-concurrent-requests`, 429 beyond it) and the metrics (`epp.sim.tgi_metrics`,
`epp.sim.tgi_exposition`). TGI has no request priority: every request is engine priority 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from aiohttp import web

from epp.sim.config import SimConfig
from epp.sim.generation import token_text
from epp.sim.protocol import ParsedRequest
from epp.sim.request import Request
from epp.sim.server import SimPod, _Waiter
from epp.sim.tgi_exposition import CONTENT_TYPE, TgiExposition
from epp.sim.tgi_metrics import TgiMetrics
from epp.sim import tgi_responses as out
from epp.sim.tgi_protocol import (Generation, Limits, Rejection, TgiError, check_completion, parse_chat,
                                  parse_completion, parse_generate, validate_chat, validate_completion,
                                  validate_generate)

_JSON = "application/json"
_TEXT = "text/plain"
_OVERLOADED = TgiError(429, "Model is overloaded", "overloaded")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def tgi_metrics(config: SimConfig) -> tuple[TgiMetrics, TgiExposition]:
    """A fresh TGI process's metrics and their exposition (nothing recorded yet)."""
    limits = Limits.for_model_len(config.engine.max_model_len)
    return TgiMetrics(limits.max_input_tokens, limits.max_total_tokens), TgiExposition()


@web.middleware
async def _axum_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Unknown paths and methods answer as axum does: the status and an empty body."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:
        return web.Response(status=e.status)


def _text(e: Rejection) -> web.Response:
    return web.Response(status=e.status, text=e.text, content_type=_TEXT, charset="utf-8")


def _json_error(e: TgiError) -> web.Response:
    return web.Response(status=e.status, body=e.body(), content_type=_JSON)


class TgiRouter:
    """The HTTP side of one simulated TGI pod."""

    def __init__(self, pod: SimPod) -> None:
        self.pod = pod
        self.limits = Limits.for_model_len(pod.config.engine.max_model_len, pod.factory.tokenizer)
        self.in_flight = 0  # requests holding one of the max_concurrent_requests permits
        # Top-level body keys TGI ignored (serde skips unknown fields), e.g. a `priority`: TGI has none.
        self.ignored_fields: Counter[str] = Counter()
        self._rng = random.Random(pod.config.seed ^ 0x7617)

    @property
    def vocab(self) -> Sequence[str]:
        """Single-token words the pod's generated text is made of (re-tokenizes exactly)."""
        return self.pod.factory.tokenizer.output_vocab

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_axum_errors])
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/generate_stream", self._generate_stream)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/info", self._info)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        return app

    @property
    def metrics(self) -> TgiMetrics:
        metrics = self.pod.metrics
        assert isinstance(metrics, TgiMetrics)
        return metrics

    # ------------------------------------------------------------------ the engine underneath

    @contextlib.contextmanager
    def _tracked(self) -> Iterator[None]:
        """Registered with the pod, so stopping the pod cancels this handler."""
        task = asyncio.current_task()
        assert task is not None
        self.pod._handlers.add(task)
        try:
            yield
        finally:
            self.pod._handlers.discard(task)

    def _submit(self, gen: Generation, stream: bool) -> Request:
        pod = self.pod
        lora = gen.adapter_id if gen.adapter_id in pod.config.lora_adapters else None  # else the base model
        req = pod._make_request(ParsedRequest(
            kind="completion", model=lora or pod.config.model, lora=lora, prompt_text=gen.inputs,
            prompt_ids=gen.input_ids, prompt_tokens=gen.input_length, max_tokens=gen.max_new_tokens, ignore_eos=False,
            stream=stream, include_usage=False, priority=0))
        req.user_data = _Waiter(stream)
        pod.engine.add_request(req)
        assert pod._wake is not None
        pod._wake.set()
        return req

    async def _tokens(self, req: Request) -> AsyncIterator[int]:
        """Wait for the engine; yield how many tokens the request has each time it woke us."""
        waiter = req.user_data
        assert isinstance(waiter, _Waiter)
        while True:
            await waiter.event.wait()
            waiter.event.clear()
            self.pod._raise_if_broken()
            yield req.num_output_tokens
            if req.is_finished:
                return

    def _release(self, req: Request | None) -> None:
        self.in_flight -= 1
        if req is not None and not req.is_finished:
            self.pod.engine.abort_request(req.request_id, now=self.pod.vnow())

    def _seed(self, gen: Generation) -> int | None:
        """TGI draws a seed when none is given and reports it only when sampling."""
        if not gen.sampling:
            return None
        return gen.seed if gen.seed is not None else self._rng.getrandbits(64)

    def _note_ignored(self, keys: list[str]) -> None:
        self.ignored_fields.update(keys)

    # ------------------------------------------------------------------ /generate

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        with self._tracked():
            raw = await request.read()
            try:
                body, ignored = parse_generate(raw, request.headers.get("Content-Type", ""))
            except Rejection as e:
                return _text(e)
            self._note_ignored(ignored)
            metrics = self.metrics
            metrics.request_received()
            if self.in_flight >= self.limits.max_concurrent_requests:
                metrics.request_failed("overloaded")
                return _json_error(_OVERLOADED)
            try:
                gen = validate_generate(body, ignored, self.limits, stream=False)
            except TgiError as e:
                metrics.request_failed("validation")
                return _json_error(e)
            metrics.request_validated(gen.input_length, gen.max_new_tokens)
            self.in_flight += 1
            req: Request | None = None
            try:
                req = self._submit(gen, stream=False)
                async for _ in self._tokens(req):
                    pass
            finally:
                self._release(req)
            metrics.request_succeeded(req)
            n = req.num_output_tokens
            text = token_text(req.salt, 0, n, self.vocab)
            if (body.get("parameters") or {}).get("return_full_text"):
                text = gen.inputs + text
            details = out.details(req.finish_reason, n, self._seed(gen), req.salt, self.pod.factory.tokenizer) if gen.details else None
            return web.Response(body=out.generate_body(text, details), content_type=_JSON,
                                headers=self._timings(gen, req))

    def _timings(self, gen: Generation, req: Request) -> dict[str, str]:
        return out.timing_headers(len(gen.inputs), req.finish_time - req.arrival_time,
                                  req.first_scheduled_time - req.arrival_time,
                                  req.finish_time - req.first_scheduled_time, gen.input_length,
                                  req.num_output_tokens)

    async def _open_stream(self, request: web.Request, characters: int) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "x-compute-type": out.COMPUTE_TYPE, "x-compute-characters": str(characters),
            "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        return resp

    async def _generate_stream(self, request: web.Request) -> web.StreamResponse:
        with self._tracked():
            raw = await request.read()
            try:
                body, ignored = parse_generate(raw, request.headers.get("Content-Type", ""))
            except Rejection as e:
                return _text(e)
            self._note_ignored(ignored)
            metrics = self.metrics
            resp = await self._open_stream(request, len(body["inputs"]))
            metrics.request_received()
            try:
                if self.in_flight >= self.limits.max_concurrent_requests:
                    metrics.request_failed("overloaded")
                    raise _OVERLOADED
                gen = validate_generate(body, ignored, self.limits, stream=True)
            except TgiError as e:
                if e is not _OVERLOADED:
                    metrics.request_failed("validation")
                await resp.write(out.error_event(e.error, e.error_type))
                await resp.write_eof()
                return resp
            metrics.request_validated(gen.input_length, gen.max_new_tokens)
            self.in_flight += 1
            req: Request | None = None
            try:
                req = self._submit(gen, stream=True)
                sent = 0
                full_text = bool((body.get("parameters") or {}).get("return_full_text"))
                async for n in self._tokens(req):
                    events: list[bytes] = []
                    for i in range(sent, n):
                        last = req.is_finished and i == n - 1
                        if last:
                            metrics.request_succeeded(req)
                        text = ((gen.inputs if full_text else "") + token_text(req.salt, 0, n, self.vocab)) if last else None
                        details = (out.stream_details(req.finish_reason, n, self._seed(gen), gen.input_length)
                                   if last and gen.details else None)
                        events.append(out.stream_event(i + 1, out.token(req.salt, i, self.pod.factory.tokenizer), text, details))
                    sent = n
                    if events:
                        await resp.write(b"".join(events))
            finally:
                self._release(req)
            await resp.write_eof()
            return resp

    # ------------------------------------------------------------------ the Messages API

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        with self._tracked():
            raw = await request.read()
            try:
                chat = parse_chat(raw, request.headers.get("Content-Type", ""), self.limits.tokenizer)
            except Rejection as e:
                return _text(e)
            self._note_ignored(chat.ignored)
            metrics = self.metrics
            metrics.request_received(openai=True)
            model = chat.model if chat.model not in (None, "tgi") else self.pod.config.model
            created = int(time.time())
            resp = await self._open_stream(request, len(chat.inputs)) if chat.stream else None
            try:
                if self.in_flight >= self.limits.max_concurrent_requests:
                    metrics.request_failed("overloaded")
                    raise _OVERLOADED
                gen = validate_chat(chat, self.limits)
            except TgiError as e:
                if e is not _OVERLOADED:
                    metrics.request_failed("validation")
                if resp is None:
                    return _json_error(e)
                await resp.write(out.chat_error_event(e.error) + out.DONE)
                await resp.write_eof()
                return resp
            metrics.request_validated(gen.input_length, gen.max_new_tokens)
            self.in_flight += 1
            req: Request | None = None
            try:
                req = self._submit(gen, stream=chat.stream)
                sent = 0
                async for n in self._tokens(req):
                    if resp is None:
                        continue
                    events = [out.chat_chunk(created, model, out.token(req.salt, i, self.pod.factory.tokenizer)["text"],
                                             req.finish_reason if req.is_finished and i == n - 1 else None)
                              for i in range(sent, n)]
                    sent = n
                    if req.is_finished and chat.include_usage:
                        events.append(out.chat_usage_chunk(created, model, gen.input_length, n))
                    if events:
                        await resp.write(b"".join(events))
            finally:
                self._release(req)
            metrics.request_succeeded(req)
            n = req.num_output_tokens
            if resp is None:
                return web.Response(body=out.chat_body(created, model, token_text(req.salt, 0, n, self.vocab), req.finish_reason,
                                                       gen.input_length, n),
                                    content_type=_JSON, headers=self._timings(gen, req))
            await resp.write(out.DONE)
            await resp.write_eof()
            return resp

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        with self._tracked():
            raw = await request.read()
            try:
                completion = parse_completion(raw, request.headers.get("Content-Type", ""))
            except Rejection as e:
                return _text(e)
            self._note_ignored(completion.ignored)
            metrics = self.metrics
            model, created = self.pod.config.model, int(time.time())  # TGI names its own model here
            metrics.request_received()  # the handler counts it, and generate_internal again below
            try:
                check_completion(completion)
                metrics.request_received()
                if self.in_flight >= self.limits.max_concurrent_requests:
                    metrics.request_failed("overloaded")
                    return _json_error(_OVERLOADED)
                gen = validate_completion(completion, self.limits)
            except TgiError as e:
                metrics.request_failed("validation")
                return _json_error(e)
            metrics.request_validated(gen.input_length, gen.max_new_tokens)
            resp = await self._open_stream(request, len(gen.inputs)) if completion.stream else None
            self.in_flight += 1
            req: Request | None = None
            try:
                req = self._submit(gen, stream=completion.stream)
                sent = 0
                async for n in self._tokens(req):
                    if resp is None:
                        continue
                    events = []
                    for i in range(sent, n):
                        text = out.token(req.salt, i, self.pod.factory.tokenizer)["text"]
                        if req.is_finished and i == n - 1:
                            events.append(out.completion_final_event(created, model, text, req.finish_reason,
                                                                     gen.input_length, n))
                        else:
                            events.append(out.completion_chunk(created, model, text))
                    sent = n
                    if events:
                        await resp.write(b"".join(events))
            finally:
                self._release(req)
            metrics.request_succeeded(req)
            n = req.num_output_tokens
            if resp is None:
                return web.Response(body=out.completion_body(created, model, token_text(req.salt, 0, n, self.vocab),
                                                             req.finish_reason, gen.input_length, n),
                                    content_type=_JSON, headers=self._timings(gen, req))
            await resp.write(out.DONE)
            await resp.write_eof()
            return resp

    # ------------------------------------------------------------------ the rest

    async def _info(self, request: web.Request) -> web.Response:
        limits = self.limits
        return web.Response(body=out.info_body(self.pod.config.model, limits.max_input_tokens,
                                               limits.max_total_tokens, limits.max_concurrent_requests),
                            content_type=_JSON)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.Response(body=out.models_body(self.pod.config.model), content_type=_JSON)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if self.pod.fault is not None:
            return await self.pod._metrics(request)  # the pod's broken-/metrics modes
        exposition = self.pod.exposition
        assert isinstance(exposition, TgiExposition)
        text = exposition.render(self.pod.engine, self.metrics)
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

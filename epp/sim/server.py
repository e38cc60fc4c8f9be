"""Simulated vLLM pods over HTTP: the OpenAI endpoints, /health and /metrics of vLLM 0.32.

With `SimConfig.server == "tgi"` a pod speaks Hugging Face TGI 3.3 instead (`epp.sim.tgi_server`).

Each pod is one aiohttp site on its own port with one engine loop task: it schedules a step,
sleeps the step's modelled duration times `time_scale`, applies it and wakes only the requests
that got a token (streams) or finished (non-streaming). Many pods share one event loop.

Engine time is "modelled seconds since the pod started". While busy it advances by exactly the
modelled step durations (the GPU timeline); when idle it jumps to wall time / `time_scale`. If
the process cannot keep up, engine time falls behind wall time and tokens reach clients in
bursts, but latency metrics, which are in engine time, still describe the modelled GPU.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Literal

import orjson
from aiohttp import web

from epp.sim.config import EngineConfig, SimConfig
from epp.sim.engine import Engine
from epp.sim.exposition import CONTENT_TYPE, Exposition, restrict
from epp.sim.factory import RequestFactory
from epp.sim.generation import token_piece, token_text
from epp.sim.kv_events import EventBatch
from epp.sim.kv_publisher import KVEventsConfig, ZmqEventPublisher
from epp.sim.metrics import VllmMetrics
from epp.sim.protocol import ApiError, Kind, ParsedRequest, error_bytes, parse_request
from epp.sim.request import Request
from epp.sim.responses import DONE, ChatEvents, CompletionEvents, chat_body, completion_body, models_body

__all__ = ["FAULTS", "EngineConfig", "SimConfig", "SimPod", "start_pods", "stop_pods"]

log = logging.getLogger(__name__)

Fault = Literal["hang", "garbage", "error"]
FAULTS: tuple[str, ...] = ("hang", "garbage", "error")
_GARBAGE = b"\x00\xffnot prometheus {{{\nvllm:num_requests_running{engine= 1 2 3\n# TYPE\n"
_JSON = "application/json"
# Longest a lagging engine loop runs steps back to back before letting handlers run.
_MAX_BURST = 0.02
_SSE = "text/event-stream; charset=utf-8"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Waiter:
    """What a request handler sleeps on; the engine loop sets it."""

    __slots__ = ("event", "stream")

    def __init__(self, stream: bool) -> None:
        self.event = asyncio.Event()
        self.stream = stream


class SimPod:
    """One simulated vLLM server. `fault` breaks its /metrics on purpose: "hang" never answers,
    "garbage" answers 200 with unparsable text, "error" answers 500; None is healthy.

    `kv_events` is vLLM's `--kv-events-config`: when enabled the pod publishes its KV-cache events
    over ZMQ (`kv_publisher`), pod `index` offsetting the endpoints it binds. `dev_mode` serves
    `POST /reset_prefix_cache`, as vLLM does only with VLLM_SERVER_DEV_MODE=1."""

    def __init__(self, config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 name: str | None = None, index: int = 0, kv_events: KVEventsConfig | None = None,
                 dev_mode: bool = False) -> None:
        self.config = config or SimConfig()
        self.config.validate()
        self.host = host
        self._port = port
        self.name = name or f"sim-{id(self):x}"
        self.index = index
        self.kv_events = kv_events if kv_events is not None and kv_events.enabled else None
        self.kv_publisher: ZmqEventPublisher | None = None
        self.dev_mode = dev_mode
        self._fresh_state()
        self.fault: Fault | None = None
        self._rng = random.Random(self.config.seed ^ 0x5EED)
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._t0 = 0.0
        self._handlers: set[asyncio.Task[object]] = set()
        self._inflight_end: float | None = None
        self._broken: BaseException | None = None
        # Engine calls that must wait for the step in flight (vLLM's engine core runs utility
        # calls such as reset_prefix_cache between steps).
        self._between_steps: list[Callable[[], None]] = []

    def _fresh_state(self) -> None:
        """A new engine, cache and metrics: what a (re)started vLLM process begins with."""
        engine_config = self.config.engine
        if self.kv_events is not None:
            engine_config = replace(engine_config, enable_kv_cache_events=True)
        self.engine = Engine(engine_config)
        self.factory = RequestFactory(self.config)
        if self.config.server == "tgi":  # TGI's metric names over the same engine model
            from epp.sim.tgi_server import tgi_metrics
            self.metrics, self.exposition = tgi_metrics(self.config)  # type: ignore[assignment]
        else:
            self.metrics = VllmMetrics(self.config.engine.max_model_len)
            self.exposition = Exposition(self.config.model, self.config.engine, created=time.time(),
                                         lora_enabled=bool(self.config.lora_adapters))

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._port}"

    @property
    def address(self) -> str:
        """host:port, as an endpoint picker names the pod."""
        return self.url.removeprefix("http://")

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("pod already started")
        loop = asyncio.get_running_loop()
        self._t0 = loop.time()
        self._wake = asyncio.Event()
        if self.config.server == "tgi":  # TGI's routes, validation and error shapes
            from epp.sim.tgi_server import TgiRouter
            self.tgi = TgiRouter(self)
            app = self.tgi.app()
        else:
            app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_fastapi_errors])
            app.router.add_post("/v1/completions", self._completions)
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_get("/v1/models", self._models)
            app.router.add_get("/health", self._health)
            app.router.add_get("/metrics", self._metrics)
            if self.dev_mode:
                app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
            app.on_response_prepare.append(_uvicorn_headers)
        runner = web.AppRunner(app, handle_signals=False, access_log=None,
                               handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._port))
            site = web.SockSite(runner, sock)
            await site.start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._port = sock.getsockname()[1]
        if self.kv_events is not None:
            try:  # binding may wait for a port our previous incarnation is releasing: off the loop
                settings = self.kv_events.for_pod(self.index, ip=self.host, port=self._port, model=self.config.model)
                self.kv_publisher = await asyncio.to_thread(ZmqEventPublisher, settings, host=self.host,
                                                            name=f"{self.name}-kv-events")
            except BaseException:
                await runner.cleanup()
                raise
        self._runner = runner
        self._loop_task = asyncio.create_task(self._engine_loop(), name=f"{self.name}-engine")

    async def stop(self) -> None:
        """Stop serving at once, cutting in-flight requests (the pod "dies").

        `start()` may be called again: the pod comes back on the same port with a fresh engine.
        """
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for task in list(self._handlers):
            task.cancel()
        await runner.cleanup()
        self._between_steps.clear()
        publisher, self.kv_publisher = self.kv_publisher, None
        if publisher is not None:
            await asyncio.to_thread(publisher.close)
        self._inflight_end = None
        self._fresh_state()  # a restarted pod comes back empty, like a restarted vLLM

    async def __aenter__(self) -> SimPod:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def vnow(self) -> float:
        """Engine-clock now, for stamping arrivals: wall seconds since start / time_scale, but
        never past the end of the step in flight (a lagging engine sees a request when it can)."""
        w = (asyncio.get_running_loop().time() - self._t0) / self.config.time_scale
        end = self._inflight_end
        return w if end is None or w < end else end

    # ------------------------------------------------------------------ engine loop

    async def _engine_loop(self) -> None:
        """Steps back to back on the engine clock, sleeping until each step's wall-clock end.

        If the process falls behind (handlers took longer than the step), the next steps run
        without sleeping until the engine clock catches up with the wall clock, yielding every
        `_MAX_BURST` seconds: streams then get several tokens per write, so an overloaded
        process spends less per token instead of more, and the engine timeline stays exact.
        """
        loop = asyncio.get_running_loop()
        engine = self.engine
        scale = self.config.time_scale
        lora = bool(self.config.lora_adapters)
        publisher = self.kv_publisher
        wake = self._wake
        assert wake is not None
        clock = 0.0
        last_yield = loop.time()
        try:
            while True:
                if not engine.has_unfinished():
                    self._inflight_end = None
                    wake.clear()
                    await wake.wait()
                    # Idle until now: the engine clock jumps to the wall clock.
                    clock = max(clock, (loop.time() - self._t0) / scale)
                    continue
                out = engine.schedule(clock)
                if out is None:  # nothing runnable (should not happen); wait for news
                    self._inflight_end = None
                    wake.clear()
                    try:
                        await asyncio.wait_for(wake.wait(), 0.01)
                    except TimeoutError:
                        pass
                    clock = max(clock, (loop.time() - self._t0) / scale)
                    continue
                self._inflight_end = out.end_time
                t = loop.time()
                delay = self._t0 + out.end_time * scale - t
                if delay > 0:
                    await asyncio.sleep(delay)
                    last_yield = loop.time()
                elif t - last_yield > _MAX_BURST:
                    await asyncio.sleep(0)
                    last_yield = loop.time()
                step = engine.update(out)
                clock = out.end_time
                if publisher is not None:  # one batch per step with events, as vLLM's scheduler
                    events = engine.take_kv_events()
                    if events:
                        publisher.publish(EventBatch(ts=time.time(), events=events))
                if self._between_steps:
                    calls, self._between_steps = self._between_steps, []
                    for call in calls:
                        call()
                self.metrics.record_step(step)
                if lora:
                    snap = engine.snapshot()
                    self.metrics.record_lora(snap.running_loras, snap.waiting_loras, time.time())
                for r in step.new_tokens:
                    w = r.user_data
                    if isinstance(w, _Waiter) and (w.stream or r.is_finished):
                        w.event.set()
                for r in step.finished:
                    w = r.user_data
                    if isinstance(w, _Waiter):
                        w.event.set()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug: fail the waiting requests loudly rather than hang them
            log.exception("engine loop of %s failed", self.name)
            self._broken = e
            for r in list(engine.requests.values()):
                if isinstance(r.user_data, _Waiter):
                    r.user_data.event.set()

    # ------------------------------------------------------------------ handlers

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            raw = await request.read()
            cfg = self.config
            xrid = request.headers.get("x-request-id")
            headers = {"x-request-id": xrid} if xrid else {}
            try:
                p = parse_request(raw, kind, cfg.model, cfg.lora_adapters, cfg.engine.max_model_len,
                                  self.factory.tokenizer)
            except ApiError as e:
                return web.Response(status=e.status, body=error_bytes(e), content_type=_JSON,
                                    headers=headers)
            req = self._make_request(p)
            prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
            rid = prefix + (xrid or f"{self._rng.getrandbits(64):016x}")
            created = int(time.time())
            waiter = _Waiter(p.stream)
            req.user_data = waiter
            self.engine.add_request(req)
            assert self._wake is not None
            self._wake.set()
            try:
                if p.stream:
                    return await self._stream(request, req, p, waiter, rid, created, headers)
                while not req.is_finished:
                    await waiter.event.wait()
                    waiter.event.clear()
                    self._raise_if_broken()
                make = completion_body if kind == "completion" else chat_body
                text = token_text(req.salt, 0, req.num_output_tokens, self.factory.tokenizer.output_vocab)
                body = make(rid, created, p.model, text,
                            req.finish_reason or "stop", req.prompt_len, req.num_output_tokens)
                return web.Response(body=body, content_type=_JSON, headers=headers)
            finally:
                if not req.is_finished:
                    self.engine.abort_request(req.request_id, now=self.vnow())
        finally:
            self._handlers.discard(task)

    def _make_request(self, p: ParsedRequest) -> Request:
        return self.factory.from_token_ids(p.prompt_ids, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos,
                                           priority=p.priority, lora=p.lora, arrival_time=self.vnow(),
                                           request_id=f"{self.name}-{next(self._ids)}",
                                           cache_salt=p.cache_salt)

    async def _stream(self, request: web.Request, req: Request, p: ParsedRequest, waiter: _Waiter,
                      rid: str, created: int, headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={**headers, "Content-Type": _SSE})
        await resp.prepare(request)
        chat = p.kind == "chat"
        events = ChatEvents(rid, created, p.model) if chat else CompletionEvents(rid, created, p.model)
        sent = 0
        salt = req.salt
        vocab = self.factory.tokenizer.output_vocab
        while True:
            await waiter.event.wait()
            waiter.event.clear()
            self._raise_if_broken()
            n = req.num_output_tokens
            done = req.is_finished
            parts: list[str] = []
            if chat and sent == 0 and n > 0:
                parts.append(events.role())  # type: ignore[union-attr]
            last = n - 1
            for i in range(sent, n):
                parts.append(events.token(token_piece(salt, i, vocab),
                                          req.finish_reason if done and i == last else None))
            sent = n
            if done and p.include_usage:
                parts.append(events.usage(req.prompt_len, n))
            if parts:
                data = "".join(parts).encode()
                await resp.write(data + DONE if done else data)
            elif done:
                await resp.write(DONE)
            if done:
                break
        await resp.write_eof()
        return resp

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise web.HTTPInternalServerError(text="simulated engine failed")

    async def _models(self, request: web.Request) -> web.Response:
        cfg = self.config
        perms = [f"{self._rng.getrandbits(64):016x}" for _ in range(1 + len(cfg.lora_adapters))]
        body = models_body(cfg.model, cfg.lora_adapters, cfg.engine.max_model_len,
                           int(time.time()), perms)
        return web.Response(body=body, content_type=_JSON)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev endpoint: forget cached blocks (AllBlocksCleared goes out with the next step)."""
        try:
            reset_running = _query_bool(request, "reset_running_requests")
            _query_bool(request, "reset_external")  # no KV connector here: nothing external to reset
        except ApiError as e:
            return web.Response(status=e.status, body=error_bytes(e), content_type=_JSON)
        log.info("%s: resetting prefix cache (reset_running_requests=%s)", self.name, reset_running)
        engine = self.engine
        if engine.busy:  # wait for the step in flight, as vLLM's engine core does
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

            def reset() -> None:
                if not done.done():
                    done.set_result(engine.reset_prefix_cache(reset_running_requests=reset_running))

            self._between_steps.append(reset)
            task = asyncio.current_task()
            assert task is not None
            self._handlers.add(task)  # a pod stopped meanwhile cancels the wait
            try:
                success = await done
            finally:
                self._handlers.discard(task)
        else:
            success = engine.reset_prefix_cache(reset_running_requests=reset_running)
        return web.Response(body=orjson.dumps({"success": bool(success)}), content_type=_JSON)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        fault = self.fault
        if fault == "hang":
            task = asyncio.current_task()
            assert task is not None
            self._handlers.add(task)
            try:
                await asyncio.Event().wait()
            finally:
                self._handlers.discard(task)
        if fault == "garbage":
            return web.Response(body=_GARBAGE, headers={"Content-Type": CONTENT_TYPE})
        if fault == "error":
            return web.Response(status=500, body=b"Internal Server Error",
                                headers={"Content-Type": "text/plain; charset=utf-8"})
        page = self.exposition.render(self.engine, self.metrics).encode()
        names = request.query.getall("name[]", [])
        if names:  # vLLM's /metrics is prometheus_client's: it serves only the series asked for
            page = restrict(page, set(names))
        return web.Response(body=page, headers={"Content-Type": CONTENT_TYPE})


_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


def _query_bool(request: web.Request, key: str) -> bool:
    """A boolean query parameter as FastAPI (pydantic) parses it; default False."""
    raw = request.query.get(key)
    if raw is None:
        return False
    value = raw.lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    item = {"type": "bool_parsing", "loc": f"query.{key}",
            "msg": "Input should be a valid boolean, unable to interpret input", "input": raw[:100]}
    raise ApiError(400, f"1 validation error:\n  {item!r}", "Bad Request", f"query.{key}")


@web.middleware
async def _fastapi_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Unknown paths and methods answer like FastAPI does, as JSON."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.Response(status=404, body=b'{"detail":"Not Found"}', content_type=_JSON)
    except web.HTTPMethodNotAllowed:
        return web.Response(status=405, body=b'{"detail":"Method Not Allowed"}', content_type=_JSON)


async def _uvicorn_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["server"] = "uvicorn"
    response.headers.setdefault("vary", "Origin")


async def start_pods(n: int, base_port: int = 0, host: str = "127.0.0.1",
                     config: SimConfig | None = None, configs: Sequence[SimConfig] | None = None, *,
                     kv_events: KVEventsConfig | None = None, dev_mode: bool = False) -> list[SimPod]:
    """Start `n` pods on consecutive ports from `base_port` (0: free ports chosen by the OS).

    Every pod runs `config`, or pod i runs `configs[i]` (a heterogeneous pool, see
    `epp.sim.pool`). Pod i gets its config's seed + i, so pods differ in sampled output lengths
    but are reproducible, and index i for its KV-event endpoints.
    """
    shapes = list(configs) if configs is not None else [config or SimConfig()] * n
    if len(shapes) != n:
        raise ValueError(f"{len(shapes)} pod configs for {n} pods")
    pods: list[SimPod] = []
    try:
        for i, base in enumerate(shapes):
            cfg = replace(base, seed=base.seed + i)
            pod = SimPod(cfg, host=host, port=base_port + i if base_port else 0, name=f"pod-{i}", index=i,
                         kv_events=kv_events, dev_mode=dev_mode)
            await pod.start()
            pods.append(pod)
    except BaseException:
        await stop_pods(pods)
        raise
    return pods


async def stop_pods(pods: list[SimPod]) -> None:
    await asyncio.gather(*(p.stop() for p in pods), return_exceptions=True)

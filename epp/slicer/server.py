"""The slicer's HTTP server: an aiohttp proxy that serves sliceable completions as token slices.

Every slice is an ordinary request to the upstream (the gateway, so the EPP routes and flow control
queues each slice; or one model server) with the client's headers, so it belongs to the same user
(`x-gateway-inference-fairness-id`) and objective; `x-request-id`, when sent, gets a `-s<k>` suffix
on later slices (vLLM refuses two live requests with one id). Requests that are not sliced
(`plan.unsliceable`) and every other path go through unchanged; `/health` and `/metrics` are the
slicer's own.

The end of a request: a slice that stops for any reason but its length, the client's limit
reached, a slice with no tokens, `max_slices`, or a continuation the server refuses with 400
(the context is full: the response ends with `finish_reason: length`, as an unsliced one would).
Any other error from a continuation ends a stream with vLLM's error event and a whole response
with that error. A client that goes away — between slices or while one streams — cancels the
rest: the slice in flight is closed (the server aborts it) and no further slice is sent.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from epp.api.headers import REQUEST_ID
from epp.slicer.plan import CHAT, PATHS, limit, slice_body, unsliceable
from epp.slicer.stitch import StreamStitcher, event, merge

log = logging.getLogger("epp.slicer")

MAX_BODY = 64 * 1024 * 1024  # a request body the slicer reads into memory
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host", "content-length", "content-encoding"})


class SlicerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("epp_slicer_requests", "Client requests by how they were served: sliced, "
                                "passthrough (not sliceable), client_gone, upstream_error",
                                ["outcome"], registry=self.registry)
        self.slices = Counter("epp_slicer_slices", "Slice requests sent upstream (first slices included)",
                              registry=self.registry)
        self.continuation_prompt_tokens = Counter(
            "epp_slicer_continuation_prompt_tokens", "Prompt tokens of continuation slices as the upstream "
            "counted them: what slicing can cost in prefill when a slice lands where nothing is cached",
            registry=self.registry)


class Slicer:
    """`upstream`: base URL (http://host:port); `slice_tokens`: S; `max_slices`: a chain's bound."""

    def __init__(self, upstream: str, *, slice_tokens: int = 128, max_slices: int = 256,
                 timeout: float = 600.0) -> None:
        if slice_tokens < 1 or max_slices < 1:
            raise ValueError("slice_tokens and max_slices must be >= 1")
        self.upstream = upstream.rstrip("/")
        self.slice_tokens = slice_tokens
        self.max_slices = max_slices
        self.timeout = timeout
        self.metrics = SlicerMetrics()
        self._session: aiohttp.ClientSession | None = None

    # -- lifecycle --

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        for path in PATHS:
            app.router.add_post(path, self._generate)
        app.router.add_route("*", "/{tail:.*}", self._proxy)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=self.timeout),
                                              auto_decompress=False)

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the slicer's app is not started"
        return self._session

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- pass-through --

    @staticmethod
    def _headers(request: web.Request, index: int = 0) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        rid = request.headers.get(REQUEST_ID)
        if rid and index:
            out = {k: v for k, v in out.items() if k.lower() != REQUEST_ID}
            out[REQUEST_ID] = f"{rid}-s{index}"
        return out

    async def _proxy(self, request: web.Request, body: bytes | None = None) -> web.StreamResponse:
        data = await request.read() if body is None else body
        try:
            async with self.session.request(request.method, self.upstream + request.rel_url.raw_path_qs,
                                            headers=self._headers(request), data=data) as up:
                resp = web.StreamResponse(status=up.status, reason=up.reason, headers=_forwardable(up.headers))
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except aiohttp.ClientError as exc:
            return _bad_gateway(exc)

    # -- slicing --

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        path = request.path
        why = unsliceable(body, path, self.slice_tokens) if body is not None else "not JSON"
        if why is not None:
            log.debug("not sliced (%s): %s", why, path)
            self.metrics.requests.labels("passthrough").inc()
            return await self._proxy(request, raw)
        assert isinstance(body, dict)
        try:
            if body.get("stream"):
                return await self._stream(request, body, path)
            return await self._whole(request, body, path)
        except aiohttp.ClientError as exc:
            self.metrics.requests.labels("upstream_error").inc()
            return _bad_gateway(exc)

    def _budget(self, cap: int | None, done: int) -> int:
        return self.slice_tokens if cap is None else min(self.slice_tokens, cap - done)

    async def _whole(self, request: web.Request, body: dict[str, Any], path: str) -> web.StreamResponse:
        chat = path == CHAT
        cap = limit(body, path)
        responses: list[dict[str, Any]] = []
        headers: dict[str, str] = {}
        generated, done = "", 0
        for index in range(self.max_slices):
            if index and _gone(request):
                self.metrics.requests.labels("client_gone").inc()
                return web.Response(status=499)  # nobody reads it
            sent = slice_body(body, path, generated, self._budget(cap, done), index)
            self.metrics.slices.inc()
            async with self.session.post(self.upstream + path, headers=self._headers(request, index),
                                         data=orjson.dumps(sent)) as up:
                data = await up.read()
                if up.status != 200:
                    if index and up.status == 400:
                        break  # the context is full: end as an unsliced request would ("length")
                    self.metrics.requests.labels("upstream_error").inc()
                    return web.Response(status=up.status, body=data, headers=_forwardable(up.headers))
                if not index:
                    headers = _forwardable(up.headers)
            obj = orjson.loads(data)
            responses.append(obj)
            choice = (obj.get("choices") or [{}])[0]
            text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
            generated += text or ""
            usage = obj.get("usage") or {}
            made = int(usage.get("completion_tokens") or 0)
            if index:
                self.metrics.continuation_prompt_tokens.inc(int(usage.get("prompt_tokens") or 0))
            done += made
            if choice.get("finish_reason") != "length" or not made or (cap is not None and done >= cap):
                break
        self.metrics.requests.labels("sliced").inc()
        return web.Response(body=orjson.dumps(merge(responses, chat)), headers=headers)

    async def _stream(self, request: web.Request, body: dict[str, Any], path: str) -> web.StreamResponse:
        options = body.get("stream_options") or {}
        stitcher = StreamStitcher(chat=path == CHAT, client_wants_usage=bool(options.get("include_usage")))
        cap = limit(body, path)
        resp: web.StreamResponse | None = None
        ending: str | None = None
        try:
            for index in range(self.max_slices):
                if index and _gone(request):
                    self.metrics.requests.labels("client_gone").inc()
                    return resp or web.Response(status=499)
                sent = slice_body(body, path, stitcher.text, self._budget(cap, stitcher.completion_tokens), index)
                self.metrics.slices.inc()
                async with self.session.post(self.upstream + path, headers=self._headers(request, index),
                                             data=orjson.dumps(sent)) as up:
                    if up.status != 200:
                        data = await up.read()
                        if resp is None:  # the first slice: the client gets the server's answer as is
                            self.metrics.requests.labels("upstream_error").inc()
                            return web.Response(status=up.status, body=data, headers=_forwardable(up.headers))
                        if up.status == 400:
                            ending = "length"  # the context is full
                        else:
                            self.metrics.requests.labels("upstream_error").inc()
                            await resp.write(event(data.strip() or b'{"error":"upstream error"}'))
                        break
                    if resp is None:
                        resp = web.StreamResponse(status=200, headers=_forwardable(up.headers))
                        await resp.prepare(request)
                    else:
                        await resp.write(stitcher.resume())
                    stitcher.begin_slice()
                    async for line in up.content:
                        out = stitcher.feed(line)
                        if out:
                            await resp.write(out)
                end = stitcher.end_slice()
                if index:
                    self.metrics.continuation_prompt_tokens.inc(end.prompt_tokens)
                if end.finish_reason != "length" or not end.completion_tokens or (
                        cap is not None and stitcher.completion_tokens >= cap):
                    break
            assert resp is not None
            await resp.write(stitcher.finish(ending))
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.metrics.requests.labels("client_gone").inc()  # leaving the `async with` closes the slice
            return resp or web.Response(status=499)
        self.metrics.requests.labels("sliced").inc()
        return resp


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _forwardable(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() not in ("date", "server")}


def _bad_gateway(exc: BaseException) -> web.Response:
    message = f"upstream unreachable: {type(exc).__name__}"
    return web.Response(status=502, body=orjson.dumps({"error": {"message": message, "type": "BadGateway",
                                                                 "code": 502}}),
                        content_type="application/json")

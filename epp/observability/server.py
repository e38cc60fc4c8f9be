"""The HTTP server on `--metrics-port`: Prometheus exposition of the EPP's own registry.

With a bearer token configured, `/metrics` answers 401 to requests without it (compared in
constant time). `/healthz` stays open for simple probes.

The exposition is built on a thread of its own, never on the event loop: the loop serves
ext_proc and scrapes the pods, and a build that ran on it once stalled both (pod scrapes timed
out, requests waited seconds). One thread builds at a time, scrapes that arrive during a build
share its result, and a build finished less than `min_interval` (100 ms) ago is served again, so
however many clients fetch `/metrics` the builds take at most a small share of a core. The
thread still shares the GIL with the loop; what keeps a build cheap is that its size is bounded
(`labels.LabelGuard`). `python -m bench.metrics_scrape` measures what scraping costs requests.
"""

from __future__ import annotations

import asyncio
import hmac
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from epp.observability.metrics import EppMetrics

EXPOSITION_THREAD = "epp-metrics-exposition"


class Exposition:
    """Builds the text exposition of a registry on one worker thread; concurrent callers of
    `render` share the build in progress, and callers within `min_interval` seconds of the last
    build get its result (no scraper needs fresher numbers than that)."""

    def __init__(self, registry: CollectorRegistry, min_interval: float = 0.1) -> None:
        self.registry = registry
        self.min_interval = min_interval
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=EXPOSITION_THREAD)
        self._pending: asyncio.Future[bytes] | None = None
        self._last: bytes | None = None
        self._last_at = 0.0

    async def render(self) -> bytes:
        loop = asyncio.get_running_loop()
        if self._last is not None and loop.time() - self._last_at < self.min_interval:
            return self._last
        pending = self._pending
        if pending is None:
            pending = loop.run_in_executor(self._executor, generate_latest, self.registry)
            self._pending = pending
            pending.add_done_callback(self._done)
        # A scraper that hangs up must not cancel the build the others wait for.
        return await asyncio.shield(pending)

    def _done(self, future: asyncio.Future[bytes]) -> None:
        if self._pending is future:
            self._pending = None
        if not future.cancelled() and future.exception() is None:
            self._last = future.result()
            self._last_at = asyncio.get_running_loop().time()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def metrics_app(metrics: EppMetrics, bearer_token: str = "") -> web.Application:
    expected = f"Bearer {bearer_token}".encode() if bearer_token else b""
    exposition = Exposition(metrics.registry)

    async def handle_metrics(request: web.Request) -> web.Response:
        if expected:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.Response(status=401, text="unauthorized\n", headers={"WWW-Authenticate": "Bearer"})
        body = await exposition.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def close_exposition(_: web.Application) -> None:
        exposition.close()

    app = web.Application()
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/healthz", handle_healthz)
    app.on_cleanup.append(close_exposition)
    return app


async def start_metrics_server(metrics: EppMetrics, host: str, port: int, bearer_token: str = "") -> web.AppRunner:
    runner = web.AppRunner(metrics_app(metrics, bearer_token), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

"""The HTTP server on `--metrics-port`: Prometheus exposition of the EPP's own registry.

With a bearer token configured, `/metrics` answers 401 to requests without it (compared in
constant time). `/healthz` stays open for simple probes.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp.observability.metrics import EppMetrics


def metrics_app(metrics: EppMetrics, bearer_token: str = "") -> web.Application:
    expected = f"Bearer {bearer_token}".encode() if bearer_token else b""

    async def handle_metrics(request: web.Request) -> web.Response:
        if expected:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.Response(status=401, text="unauthorized\n", headers={"WWW-Authenticate": "Bearer"})
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/healthz", handle_healthz)
    return app


async def start_metrics_server(metrics: EppMetrics, host: str, port: int, bearer_token: str = "") -> web.AppRunner:
    runner = web.AppRunner(metrics_app(metrics, bearer_token), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

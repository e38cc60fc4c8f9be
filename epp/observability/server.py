"""The HTTP server on `--metrics-port`: Prometheus exposition of the EPP's own registry."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp.observability.metrics import EppMetrics


def metrics_app(metrics: EppMetrics) -> web.Application:
    async def handle_metrics(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle_metrics)
    return app


async def start_metrics_server(metrics: EppMetrics, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(metrics_app(metrics), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
